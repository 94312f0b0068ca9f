// Qwen-Image 2.1 front-end extension for the two samplers (QI21Sampler, QI21TurboSampler):
//   (a) an aspect-ratio preset combo that fills `width` and `height` (and shows "custom" after a hand edit);
//   (b) a live, read-only estimate of the prefix the sampler caches: tokens and bytes (bf16, full model).
// The arithmetic lives in qi21_estimate.js (pure, unit-tested under Node).
//
// Both widgets are front-end only. They are appended AFTER the schema's widgets and marked
// `widget.serialize = false` (kept out of the workflow's `widgets_values` / `widgets_values_named`) and
// `widget.options.serialize = false` (kept out of the API prompt), so saved workflows and the Python schema only
// ever see the real inputs. Appending matters: LGraphNode.serialize() writes each value at its widget's index
// (a skipped widget in the middle would leave a hole) while configure() restores the non-skipped widgets in
// order; after the last real widget the two agree.
//
// Everything is defensive: if the front end's API differs from what this expects, one console warning is
// logged and the feature turns itself off; the node works as if this file did not exist.

import { app } from "../../scripts/app.js";
import {
  CUSTOM_PRESET,
  estimatePrefix,
  formatBytes,
  formatCount,
  formatEstimate,
  presetFor,
  presetSizes,
} from "./qi21_estimate.js";

const EXTENSION_NAME = "QwenImage21.SamplerWidgets";
const SAMPLERS = new Set(["QI21Sampler", "QI21TurboSampler"]);
const TEXT_ENCODE = "QI21TextEncode";
const REFERENCE = "QI21Reference";
const PRESET_WIDGET = "qi21_aspect_preset";
const ESTIMATE_WIDGET = "qi21_prefix_estimate";
const POLL_MS = 1000; // upstream edits (prompt text, resolution, images) are picked up by a cheap poll
const BYPASS_MODE = 4; // LiteGraph mode of a bypassed node: ComfyUI passes its same-typed input through
const MAX_HOPS = 64; // bound on any walk through the graph (chains, reroutes), also against cycles

const disabled = { preset: false, estimate: false };
let warned = false;

function fail(feature, error) {
  disabled[feature] = true;
  if (!warned) {
    warned = true;
    console.warn(`[Qwen-Image 2.1] front-end helpers turned off (${feature}): unexpected ComfyUI front-end API.`, error);
  }
}

/** `fn` that does nothing once `feature` failed, and turns `feature` off (one warning) when it throws. */
function guarded(feature, fn) {
  return function (...args) {
    if (disabled[feature]) return undefined;
    try {
      return fn.apply(this, args);
    } catch (error) {
      fail(feature, error);
      return undefined;
    }
  };
}

// ---------------------------------------------------------------------------------------------- graph helpers

function classOf(node) {
  return node?.comfyClass ?? node?.type;
}

function findWidget(node, name) {
  return Array.isArray(node?.widgets) ? node.widgets.find((w) => w && w.name === name) : undefined;
}

function numberOf(value, fallback) {
  const n = Number(value);
  return Number.isFinite(n) ? n : fallback;
}

function markDirty(node) {
  if (typeof node?.setDirtyCanvas === "function") node.setDirtyCanvas(true, true);
}

function inputSlot(node, name) {
  if (!Array.isArray(node?.inputs)) return -1;
  if (typeof node.findInputSlot === "function") {
    const slot = node.findInputSlot(name);
    if (typeof slot === "number") return slot;
  }
  return node.inputs.findIndex((input) => input?.name === name);
}

function linkById(graph, id) {
  const links = graph?._links ?? graph?.links;
  if (!links) return null;
  return typeof links.get === "function" ? links.get(id) : links[id];
}

/** The node feeding `node`'s input `name` (slot index for Reroute), through frontend Reroute nodes; or null. */
function sourceNode(node, name) {
  let current = node;
  let slot = typeof name === "number" ? name : inputSlot(node, name);
  for (let hop = 0; hop < MAX_HOPS; hop++) {
    if (slot < 0 || current?.inputs?.[slot]?.link == null) return null;
    let source = null;
    if (typeof current.getInputNode === "function") {
      source = current.getInputNode(slot);
    } else {
      const link = linkById(current.graph, current.inputs[slot].link);
      source = link ? current.graph?.getNodeById?.(link.origin_id) ?? null : null;
    }
    if (!source || classOf(source) !== "Reroute") return source ?? null;
    current = source;
    slot = 0;
  }
  return null;
}

/** A widget's value, or the value of the widget of the node linked into that widget's converted input. */
function widgetValue(node, name) {
  const widget = findWidget(node, name);
  const source = sourceNode(node, name);
  if (source) {
    const upstream = findWidget(source, "value") ?? findWidget(source, name) ?? source.widgets?.[0];
    return upstream?.value;
  }
  return widget?.value;
}

/** Pixel size of the image an IMAGE input receives, when the front end knows it: a preview/loaded image, or a
 * node with width/height widgets (e.g. an empty image or a resize node). Null otherwise. */
function imageSize(node) {
  if (!node) return null;
  const imgs = Array.isArray(node.imgs) ? node.imgs : [];
  const img = imgs[numberOf(node.imageIndex, 0)] ?? imgs[0];
  if (img && img.naturalWidth > 0 && img.naturalHeight > 0) return { width: img.naturalWidth, height: img.naturalHeight };
  const width = numberOf(findWidget(node, "width")?.value, 0);
  const height = numberOf(findWidget(node, "height")?.value, 0);
  return width > 0 && height > 0 ? { width, height } : null;
}

/** The QI21Reference chain ending at `node` (first reference first); `unknown` when the chain leaves our nodes. */
function referenceChain(node) {
  const references = [];
  const seen = new Set();
  let unknown = false;
  let current = node;
  while (current && !seen.has(current) && seen.size < MAX_HOPS) {
    seen.add(current);
    if (classOf(current) !== REFERENCE) {
      unknown = true;
      break;
    }
    if (current.mode !== BYPASS_MODE) {
      const size = imageSize(sourceNode(current, "image"));
      references.unshift({
        resolution: numberOf(widgetValue(current, "resolution"), 1024),
        width: size?.width ?? null,
        height: size?.height ?? null,
      });
    }
    current = sourceNode(current, "references");
  }
  return { references, unknown };
}

/** What a sampler's conditioning input receives: null when unconnected, else {promptChars, references, unknown}. */
function conditioning(sampler, name) {
  const encoder = sourceNode(sampler, name);
  if (!encoder) return null;
  if (classOf(encoder) !== TEXT_ENCODE) return { promptChars: 0, references: [], unknown: true };
  const prompt = widgetValue(encoder, "prompt");
  const chain = referenceChain(sourceNode(encoder, "references"));
  return { promptChars: typeof prompt === "string" ? prompt.length : 0, ...chain };
}

// ------------------------------------------------------------------------------------------------- estimate

function describe(sampler) {
  const positive = conditioning(sampler, "positive");
  if (!positive) return { text: "connect positive", tooltip: "Connect a Qwen-Image 2.1 Text Encode to positive." };
  const prompts = [{ name: "positive", ...positive }];
  if (classOf(sampler) === "QI21Sampler" && numberOf(findWidget(sampler, "cfg")?.value, 1) > 1) {
    const negative = conditioning(sampler, "negative");
    if (negative) prompts.push({ name: "negative", ...negative });
  }
  const estimate = estimatePrefix(prompts);
  const cacheOn = findWidget(sampler, "prefix_cache")?.value !== "off";
  const unknown = prompts.some((p) => p.unknown);
  let text = formatEstimate(estimate, { cacheOn });
  if (unknown) text = text.replace(/^~/, "≥ ");

  const lines = prompts.map((p, i) => `${p.name}: ~${formatCount(estimate.perPrompt[i])} tokens (prompt ${p.promptChars} chars, `
    + `${p.references.length} reference${p.references.length === 1 ? "" : "s"})${p.unknown ? ", partly unknown source" : ""}`);
  lines.push(`cache: 0.5 MiB per prefix token in bf16 (32 layers x 32 heads x 128, keys and values); `
    + `~${formatBytes(estimate.bytes)} in all; a batch shares it.`);
  if (estimate.assumed) lines.push(`${estimate.assumed} reference image size(s) unknown until loaded: assumed square at their resolution.`);
  if (unknown) lines.push("Some conditioning does not come straight from Qwen-Image 2.1 nodes: lower bound.");
  return { text, tooltip: `Estimated prefix (text + references) the sampler caches.\n${lines.join("\n")}` };
}

const refreshEstimate = guarded("estimate", (node) => {
  const widget = findWidget(node, ESTIMATE_WIDGET);
  if (!widget || !node.graph) return;
  const { text, tooltip } = describe(node);
  if (widget.value !== text) {
    widget.value = text;
    markDirty(node);
  }
  widget.tooltip = tooltip;
});

const pollEstimates = guarded("estimate", () => {
  if (typeof document !== "undefined" && document.hidden) return;
  const graph = app.canvas?.graph ?? app.graph; // the graph on screen (a subgraph when one is open)
  const nodes = graph?._nodes ?? graph?.nodes ?? [];
  for (const node of nodes) if (SAMPLERS.has(classOf(node))) refreshEstimate(node);
});

// ------------------------------------------------------------------------------------------------ widgets

/** Keep a front-end-only widget out of the saved workflow and out of the API prompt. */
function frontEndOnly(widget) {
  widget.serialize = false; // workflow JSON (widgets_values): LGraphNode.serialize/configure skip it
  widget.options = widget.options ?? {};
  widget.options.serialize = false; // API prompt: graphToPrompt skips it
}

/** Run `after(node)` after the widget's own callback (both renderers call widget.callback on user edits). */
function afterCallback(widget, node, after) {
  const original = widget.callback;
  widget.callback = function (...args) {
    const result = typeof original === "function" ? original.apply(this, args) : undefined;
    after(node);
    return result;
  };
}

const syncPreset = guarded("preset", (node) => {
  const preset = findWidget(node, PRESET_WIDGET);
  const width = findWidget(node, "width");
  const height = findWidget(node, "height");
  if (!preset || !width || !height) return;
  const label = presetFor(numberOf(width.value, -1), numberOf(height.value, -1));
  if (preset.value !== label) {
    preset.value = label;
    markDirty(node);
  }
});

const applyPreset = guarded("preset", (node, label) => {
  const preset = presetSizes().find((p) => p.label === label);
  const width = findWidget(node, "width");
  const height = findWidget(node, "height");
  if (!preset || preset.width === null || !width || !height) return; // "custom": leave the sizes alone
  width.value = preset.width;
  height.value = preset.height;
  markDirty(node);
  node.graph?.setDirtyCanvas?.(true, true);
});

const addPresetWidget = guarded("preset", (node) => {
  const width = findWidget(node, "width");
  const height = findWidget(node, "height");
  if (!width || !height || typeof node.addWidget !== "function") {
    throw new Error(`${classOf(node)}: no width/height widgets or no addWidget()`);
  }
  if (findWidget(node, PRESET_WIDGET)) return;
  const labels = presetSizes().map((p) => p.label);
  const initial = presetFor(numberOf(width.value, -1), numberOf(height.value, -1));
  const preset = node.addWidget("combo", PRESET_WIDGET, initial, (value) => applyPreset(node, value),
    { values: labels, serialize: false });
  frontEndOnly(preset);
  preset.label = "aspect preset";
  preset.tooltip = "Fills width and height: area ~1024x1024, sides multiples of 32. 'follow reference' sets 0x0 "
    + "(the last reference's size, or 1024 without one). Front-end only, not saved: after a reload it shows the "
    + "preset that matches width and height, else custom.";
  afterCallback(width, node, syncPreset);
  afterCallback(height, node, syncPreset);
});

const addEstimateWidget = guarded("estimate", (node) => {
  if (typeof node.addWidget !== "function") throw new Error(`${classOf(node)}: no addWidget()`);
  if (findWidget(node, ESTIMATE_WIDGET)) return;
  // Read-only text: edits are put back by the callback; a canvas click does nothing; Vue nodes honour read_only.
  const widget = node.addWidget("text", ESTIMATE_WIDGET, "", () => refreshEstimate(node),
    { serialize: false, read_only: true });
  frontEndOnly(widget);
  widget.label = "prefix cache";
  if (typeof widget.onClick === "function") widget.onClick = () => {};
  for (const name of ["cfg", "prefix_cache"]) {
    const input = findWidget(node, name);
    if (input) afterCallback(input, node, refreshEstimate);
  }
});

// ---------------------------------------------------------------------------------------------- extension

function chainPrototype(prototype, method, after) {
  const original = prototype[method];
  prototype[method] = function (...args) {
    const result = typeof original === "function" ? original.apply(this, args) : undefined;
    after(this);
    return result;
  };
}

const extension = {
  name: EXTENSION_NAME,

  async setup() {
    if (typeof setInterval !== "function") return;
    const timer = setInterval(() => {
      if (disabled.estimate) clearInterval(timer);
      else pollEstimates();
    }, POLL_MS);
  },

  async beforeRegisterNodeDef(nodeType, nodeData) {
    try {
      if (!SAMPLERS.has(nodeData?.name)) return;
      const prototype = nodeType?.prototype;
      if (!prototype) throw new Error(`no prototype for ${nodeData.name}`);
      // After a workflow is loaded the widgets hold the saved sizes: show the matching preset, refresh.
      chainPrototype(prototype, "onConfigure", (node) => {
        syncPreset(node);
        refreshEstimate(node);
      });
      chainPrototype(prototype, "onConnectionsChange", (node) => refreshEstimate(node));
      chainPrototype(prototype, "onAdded", (node) => refreshEstimate(node));
    } catch (error) {
      fail("preset", error);
      fail("estimate", error);
    }
  },

  async nodeCreated(node) {
    if (!SAMPLERS.has(classOf(node))) return;
    addPresetWidget(node);
    addEstimateWidget(node);
  },
};

try {
  if (typeof app?.registerExtension !== "function") throw new Error("app.registerExtension is missing");
  app.registerExtension(extension);
} catch (error) {
  fail("preset", error);
  fail("estimate", error);
}
