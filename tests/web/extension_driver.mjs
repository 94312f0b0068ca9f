// Loads web/qi21.js (copied into a sandbox next to a stub scripts/app.js) with a fake app and fake graph, plays a
// scenario and prints what it observed as JSON for tests/test_web_extension.py to check.
// Usage: node extension_driver.mjs <sandbox>/extensions/<pack>/qi21.js <scenario>
import { pathToFileURL } from "node:url";

import { FakeGraph, fakeDocument, nodeClass } from "./fake_graph.mjs";

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

/** What a sampler's report widget shows: the DOM widget's lines and title, or the text widget's value/tooltip. */
function domView(node) {
  const w = widget(node, "qi21_run_report");
  if (!w) return null;
  if (w.element) {
    return {
      kind: "dom", value: w.value, tooltip: w.element.title,
      lines: w.element.children.map((c) => ({ kind: c.className.replace(/^qi21-report-/, ""), text: c.textContent,
        color: c.style.color ?? null })),
    };
  }
  return { kind: "text", value: w.value, tooltip: w.tooltip ?? null, lines: null };
}

/** A 2D context that records fillText calls (the title-bar phase). */
function recordingContext() {
  const texts = [];
  return {
    texts, save() {}, restore() {}, fillText(text, x, y) { texts.push({ text, x, y }); },
  };
}

const REPORT_HIT = { prefix_tokens: 4171, target_tokens: 4096, batch: 1, steps: 8, cache: "hit",
  cache_bytes: 4171 * 524288, cache_device: "cuda:0", prefill_seconds: null, step_seconds: 0.1612 };
const REPORT_MISS_NOTES = { prefix_tokens: 31, target_tokens: 256, batch: 2, steps: 3, cache: "miss", cache_bytes: 63488,
  cache_device: "cpu", prefill_seconds: 0.4321, step_seconds: 0.0523,
  notes: ["size 1000x1000 floored to 992x992 (multiples of 32)", "negative prompt ignored: true CFG needs cfg > 1"] };

async function reportScenario() {
  const out = {};
  globalThis.document = fakeDocument;
  const api = new EventTarget();
  globalThis.__QI21_TEST_API__ = api;
  const send = (type, detail) => api.dispatchEvent(new CustomEvent(type, { detail }));
  const app = fakeApp();
  const graph = new FakeGraph();
  app.graph = graph;
  app.rootGraph = graph;
  await load(app);
  const ext = app.extensions[0];
  // The Base sampler with the front end's DOM widgets, the Turbo sampler without (the text-widget fallback).
  const C = {
    QI21Sampler: nodeClass("QI21Sampler", { domWidgets: true }),
    QI21TurboSampler: nodeClass("QI21TurboSampler"),
  };
  for (const [name, cls] of Object.entries(C)) await ext.beforeRegisterNodeDef?.(cls, { name }, app);
  await ext.setup?.(app);
  const make = async (name, spec, into = graph) => {
    const node = new C[name](spec);
    await ext.nodeCreated?.(node, app);
    return into.add(node);
  };
  const base = await make("QI21Sampler", { inputs: SAMPLER_INPUTS, widgets: SAMPLER_WIDGETS });
  const turbo = await make("QI21TurboSampler", { inputs: TURBO_INPUTS, widgets: TURBO_WIDGETS });
  const id = (node) => String(node.id);
  out.created = { base: snapshot(base), turbo: snapshot(turbo) };
  out.initial = { base: domView(base), turbo: domView(turbo) };
  const sizeBefore = [...base.size];

  // Queue: both are cleared ("queued"); the Base sampler runs: step 1 (prefill), then cached steps.
  send("promptQueueing", { requestId: 1, batchCount: 1 });
  out.queued = domView(base);
  send("execution_start", { prompt_id: "p1" });
  send("executing", id(base));
  out.step1 = domView(base);
  const ctx = recordingContext();
  base.onDrawForeground?.(ctx);
  out.title1 = ctx.texts;
  send("progress", { value: 1, max: 3, node: id(base), prompt_id: "p1" });
  out.step2 = domView(base);
  send("progress", { value: 3, max: 3, node: id(base), prompt_id: "p1" });
  out.finishing = domView(base);
  base.onExecuted({ qi21_report: [REPORT_HIT] });
  out.afterBase = domView(base);
  const idle = recordingContext();
  base.onDrawForeground?.(idle);
  out.titleIdle = idle.texts;
  // The Turbo sampler in the same prompt: a miss with notes.
  send("executing", id(turbo));
  out.turboStep1 = domView(turbo);
  turbo.onExecuted({ qi21_report: [REPORT_MISS_NOTES] });
  send("executing", null);
  send("execution_success", { prompt_id: "p1" });
  out.afterRun = { base: domView(base), turbo: domView(turbo) };
  out.redrawn = (() => { base.onDrawForeground?.(recordingContext()); return domView(base); })();
  out.sizes = { before: sizeBefore, after: [...base.size], needed: base.computeSize() };
  out.saved = { base: snapshot(base), turbo: snapshot(turbo) };

  // Queue with batch count 3: cleared once, then one report per prompt; the last shows, with the count.
  send("promptQueueing", { requestId: 2, batchCount: 3 });
  for (let i = 0; i < 3; i++) {
    send("execution_start", { prompt_id: `b${i}` });
    send("executing", id(base));
    base.onExecuted({ qi21_report: [{ ...REPORT_HIT, prefix_tokens: 100 + i }] });
    send("execution_success", { prompt_id: `b${i}` });
  }
  out.batch = domView(base);
  out.turboAfterBatch = domView(turbo); // not in these prompts: cleared, waiting
  // One output holding two runs (ComfyUI ran the node over a list): the last, and how many.
  send("promptQueueing", { requestId: 3, batchCount: 1 });
  base.onExecuted({ qi21_report: [{ ...REPORT_HIT, cache: "miss" }, { ...REPORT_HIT, prefix_tokens: 7 }] });
  out.twoInOne = domView(base);
  // ComfyUI's cache: execution_cached names the node, then `executed` repeats the old output.
  send("promptQueueing", { requestId: 4, batchCount: 1 });
  send("execution_start", { prompt_id: "c1" });
  send("execution_cached", { nodes: [id(base)], prompt_id: "c1" });
  out.cachedAnnounced = domView(base); // ComfyUI sends no report for a cached node that is no output node
  base.onExecuted({ qi21_report: [REPORT_HIT] }); // ... unless it does (an output node's cached UI)
  out.cached = domView(base);
  send("promptQueueing", { requestId: 41, batchCount: 1 });
  send("execution_start", { prompt_id: "c2" });
  send("execution_cached", { nodes: [id(base)], prompt_id: "c2" });
  send("execution_success", { prompt_id: "c2" });
  out.cachedNoUi = domView(base);
  // Cache off / keep_cache: other phase texts. Then an interrupt at step 3 of 8.
  widget(base, "prefix_cache").value = "off";
  send("promptQueueing", { requestId: 5, batchCount: 1 });
  send("execution_start", { prompt_id: "i1" });
  send("executing", id(base));
  send("progress", { value: 2, max: 8, node: id(base), prompt_id: "i1" });
  out.cacheOff = domView(base);
  widget(base, "prefix_cache").value = "on";
  widget(base, "keep_cache").value = true;
  send("progress", { value: 0, max: 8, node: id(base), prompt_id: "i1" });
  out.keepCache = domView(base);
  widget(base, "keep_cache").value = false;
  send("progress", { value: 2, max: 8, node: id(base), prompt_id: "i1" });
  send("execution_interrupted", { prompt_id: "i1", node_id: id(base), node_type: "QI21Sampler", executed: [] });
  out.interrupted = domView(base);
  send("promptQueueing", { requestId: 6, batchCount: 1 });
  out.requeued = domView(base);
  // Missing keys and odd values: only what is there is shown; unknown keys reach the tooltip.
  base.onExecuted({ qi21_report: [{ cache: "off", prefix_tokens: "many", future_key: 3 }] });
  out.sparse = domView(base);
  base.onExecuted({ other_ui: ["x"] });
  out.notAReport = domView(base);

  // A sampler inside a subgraph: execution id "<subgraph node>:<node>".
  const sub = new FakeGraph();
  const holder = graph.add({ type: "Subgraph", subgraph: sub, widgets: [], inputs: [] });
  const inner = await make("QI21Sampler", { inputs: SAMPLER_INPUTS, widgets: SAMPLER_WIDGETS }, sub);
  send("promptQueueing", { requestId: 7, batchCount: 1 });
  send("executing", `${holder.id}:${inner.id}`);
  send("progress", { value: 1, max: 8, node: `${holder.id}:${inner.id}` });
  out.subgraph = domView(inner);
  send("execution_start", { prompt_id: "s2" });
  send("execution_cached", { nodes: [`${holder.id}:${inner.id}`] }); // never ran in this page
  out.cachedNever = domView(inner);
  out.rootWhileSubgraph = domView(base);
  graph.remove(turbo);
  send("promptQueueing", { requestId: 8, batchCount: 1 });
  out.warnings = warnings;
  return out;
}

async function main() {
  const out = { warnings };
  if (scenario === "full") {
    globalThis.__QI21_TEST_API__ = new EventTarget();
    const app = fakeApp();
    const graph = new FakeGraph();
    app.graph = graph;
    await load(app);
    out.extensions = app.extensions.map((e) => ({ name: e.name, hooks: Object.keys(e).filter((k) => typeof e[k] === "function") }));
    const ext = app.extensions[0];
    const C = await registerTypes(ext, ["QI21Sampler", "QI21TurboSampler", "QI21TextEncode", "QI21Reference", "LoadImage", "VAEDecode", "Reroute",
      "QI21CacheOptions", "QI21LoraLoader"]);
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
    // the Prefix Cache node up the model chain (through a LoRA node): its dtype sets the bytes, device off the cache
    const options = await make("QI21CacheOptions", { inputs: ["model", "device", "dtype"],
      widgets: [["combo", "device", "auto", { values: ["auto", "gpu", "cpu", "off"] }],
        ["combo", "dtype", "default", { values: ["default", "int8", "int4"] }]] });
    const lora = await make("QI21LoraLoader", { inputs: ["model", "lora_name", "strength"] });
    graph.connect(options, lora, "model");
    graph.connect(lora, sampler, "model");
    widget(options, "dtype").value = "int8";
    poll();
    out.int8 = estimate();
    out.int8Tooltip = widget(sampler, "qi21_prefix_estimate").tooltip ?? null;
    widget(options, "dtype").value = "int4";
    poll();
    out.int4 = estimate();
    widget(options, "device").value = "off";
    poll();
    out.optionsOff = estimate();
    options.mode = 4; // bypassed: the model passes through unchanged
    poll();
    out.optionsBypassed = estimate();

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
  } else if (scenario === "report") {
    Object.assign(out, await reportScenario());
  } else if (scenario === "no-api") {
    // A front end whose scripts/api.js exports nothing usable: reports still arrive through onExecuted.
    globalThis.document = fakeDocument;
    const app = fakeApp();
    const graph = new FakeGraph();
    app.graph = graph;
    await load(app);
    const ext = app.extensions[0];
    const Sampler = nodeClass("QI21Sampler", { domWidgets: true });
    await ext.beforeRegisterNodeDef?.(Sampler, { name: "QI21Sampler" }, app);
    const node = new Sampler({ inputs: SAMPLER_INPUTS, widgets: SAMPLER_WIDGETS });
    await ext.nodeCreated?.(node, app);
    graph.add(node);
    await ext.setup?.(app);
    node.onExecuted({ qi21_report: [{ cache: "miss", prefix_tokens: 12 }] });
    out.view = domView(node);
    out.loaded = true;
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
