// Loads web/qi21.js (copied into a sandbox next to a stub scripts/app.js) with a fake app and fake graph, plays a
// scenario and prints what it observed as JSON for tests/test_web_extension.py to check.
// Usage: node extension_driver.mjs <sandbox>/extensions/<pack>/qi21.js <scenario>
import { pathToFileURL } from "node:url";

import { FakeGraph, nodeClass } from "./fake_graph.mjs";

const [modulePath, scenario] = process.argv.slice(2);
const warnings = [];
console.warn = (...args) => warnings.push(args.map(String).join(" "));
const timers = [];
globalThis.setInterval = (fn, ms) => {
  timers.push({ fn, ms });
  return timers.length;
};
globalThis.clearInterval = () => {};

const SAMPLER_INPUTS = ["model", "positive", "seed", "steps", "cfg", "width", "height", "batch_size", "negative",
  "prefix_cache", "keep_cache"];
const SAMPLER_WIDGETS = [["number", "seed", 0], ["combo", "control_after_generate", "randomize", { values: ["fixed", "randomize"] }],
  ["number", "steps", 40], ["number", "cfg", 1.0], ["number", "width", 0], ["number", "height", 0],
  ["number", "batch_size", 1], ["combo", "prefix_cache", "on", { values: ["on", "off"] }], ["toggle", "keep_cache", false]];
const TURBO_INPUTS = ["model", "positive", "seed", "width", "height", "batch_size", "prefix_cache", "keep_cache"];
const TURBO_WIDGETS = SAMPLER_WIDGETS.filter(([, name]) => !["steps", "cfg"].includes(name));

async function load(app) {
  globalThis.__QI21_TEST_APP__ = app;
  await import(pathToFileURL(modulePath).href);
}

function fakeApp() {
  const app = { extensions: [], registerExtension(ext) { this.extensions.push(ext); } };
  return app;
}

async function registerTypes(ext, names) {
  const classes = {};
  for (const name of names) {
    classes[name] = nodeClass(name);
    await ext.beforeRegisterNodeDef?.(classes[name], { name }, undefined);
  }
  return classes;
}

function widget(node, name) {
  return node.widgets.find((w) => w.name === name);
}

function snapshot(node) {
  return {
    widgets: node.widgets.map((w) => ({
      name: w.name, type: w.type, value: w.value, label: w.label ?? null,
      serialize: w.serialize ?? null, optionsSerialize: w.options?.serialize ?? null,
      values: w.options?.values ?? null,
    })),
    ...node.serialize(),
    prompt: node.promptInputs(),
  };
}

async function main() {
  const out = { warnings };
  if (scenario === "full") {
    const app = fakeApp();
    const graph = new FakeGraph();
    app.graph = graph;
    await load(app);
    out.extensions = app.extensions.map((e) => ({ name: e.name, hooks: Object.keys(e).filter((k) => typeof e[k] === "function") }));
    const ext = app.extensions[0];
    const C = await registerTypes(ext, ["QI21Sampler", "QI21TurboSampler", "QI21TextEncode", "QI21Reference", "LoadImage", "VAEDecode", "Reroute"]);
    const make = async (name, spec) => {
      const node = new C[name](spec);
      await ext.nodeCreated?.(node, app);
      return graph.add(node);
    };
    const load1 = await make("LoadImage", { widgets: [["combo", "image", "a.png", { values: ["a.png"] }]] });
    load1.imgs = [{ naturalWidth: 1600, naturalHeight: 1200 }];
    const decoded = await make("VAEDecode", { inputs: ["samples", "vae"] });
    const refSpec = { inputs: ["vae", "image", "resolution", "mask", "references"], widgets: [["number", "resolution", 1024]] };
    const ref1 = await make("QI21Reference", refSpec);
    const ref2 = await make("QI21Reference", refSpec);
    widget(ref2, "resolution").value = 512;
    const reroute = await make("Reroute", { inputs: [""] });
    graph.connect(load1, ref1, "image");
    graph.connect(decoded, ref2, "image"); // size unknown in the front end: a square at resolution is assumed
    graph.connect(ref1, reroute, "");
    graph.connect(reroute, ref2, "references");
    const teSpec = { inputs: ["text_encoder", "prompt", "references"], widgets: [["customtext", "prompt", ""]] };
    const positive = await make("QI21TextEncode", teSpec);
    widget(positive, "prompt").value = "x".repeat(40);
    graph.connect(ref2, positive, "references");
    const negative = await make("QI21TextEncode", teSpec);
    widget(negative, "prompt").value = "blurry";

    const sampler = await make("QI21Sampler", { inputs: SAMPLER_INPUTS, widgets: SAMPLER_WIDGETS });
    const turbo = await make("QI21TurboSampler", { inputs: TURBO_INPUTS, widgets: TURBO_WIDGETS });
    out.created = { sampler: snapshot(sampler), turbo: snapshot(turbo) };

    await ext.setup?.(app);
    out.timers = timers.map((t) => t.ms);
    const poll = () => timers.forEach((t) => t.fn());
    const estimate = () => widget(sampler, "qi21_prefix_estimate").value;
    poll();
    out.unconnected = estimate();
    graph.connect(positive, sampler, "positive"); // onConnectionsChange refreshes at once
    out.positive = estimate();
    out.tooltip = widget(sampler, "qi21_prefix_estimate").tooltip ?? null;
    graph.connect(negative, sampler, "negative");
    poll();
    out.negativeCfg1 = estimate();
    widget(sampler, "cfg").value = 4;
    widget(sampler, "cfg").callback(4);
    out.negativeCfg4 = estimate();
    widget(sampler, "prefix_cache").value = "off";
    widget(sampler, "prefix_cache").callback("off");
    out.cacheOff = estimate();
    widget(sampler, "prefix_cache").value = "on";
    widget(sampler, "cfg").value = 1;
    ref1.mode = 4; // bypassed: ComfyUI passes its `references` input through, so it adds nothing
    poll();
    out.bypassed = estimate();
    ref1.mode = 0;
    widget(positive, "prompt").value = "";
    poll();
    out.emptyPrompt = estimate();
    graph.connect(positive, turbo, "positive");
    out.turbo = widget(turbo, "qi21_prefix_estimate").value;
    const edited = widget(sampler, "qi21_prefix_estimate");
    edited.value = "typed by hand";
    edited.callback("typed by hand");
    out.afterHandEdit = edited.value;

    const preset = widget(sampler, "qi21_aspect_preset");
    const width = widget(sampler, "width");
    const height = widget(sampler, "height");
    out.presetInitial = preset.value;
    const choose = (label) => { preset.value = label; preset.callback(label); return [preset.value, width.value, height.value]; };
    const edit = (w, v) => { w.value = v; w.callback(v); return [preset.value, width.value, height.value]; };
    out.presetSteps = [
      choose(preset.options.values.find((v) => v.startsWith("16:9"))),
      edit(width, 1000),
      edit(height, 1000),
      edit(width, 1024),
      edit(height, 1024),
      choose("custom"),
      choose(preset.options.values.find((v) => v.startsWith("follow"))),
      choose(preset.options.values.find((v) => v.startsWith("2:3"))),
    ];
    out.afterPresets = snapshot(sampler);
    // A saved workflow comes back: configure restores the widgets, then onConfigure runs.
    width.value = 1376;
    height.value = 768;
    preset.value = "custom";
    sampler.onConfigure?.({});
    out.afterConfigure = preset.value;
  } else if (scenario === "no-register") {
    await load({});
    out.loaded = true;
  } else if (scenario === "odd-node") {
    const app = fakeApp();
    await load(app);
    const ext = app.extensions[0];
    await ext.beforeRegisterNodeDef?.(function () {}, { name: "QI21Sampler" }, app); // no prototype
    await ext.nodeCreated?.({ comfyClass: "QI21Sampler" }, app); // no widgets, no addWidget
    await ext.nodeCreated?.({ comfyClass: "QI21TurboSampler", widgets: [] }, app);
    await ext.setup?.(app);
    timers.forEach((t) => t.fn());
    out.loaded = true;
  } else {
    throw new Error(`unknown scenario ${scenario}`);
  }
  process.stdout.write(JSON.stringify(out));
}

await main();
