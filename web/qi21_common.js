// Shared by the sampler widgets (qi21_*_widget.js): the node ids and widget names, the guard that turns a
// feature off (one console warning) when the front end's API differs, and the graph helpers.

export const SAMPLERS = new Set(["QI21Sampler", "QI21TurboSampler"]);
export const TEXT_ENCODE = "QI21TextEncode";
export const REFERENCE = "QI21Reference";
export const PRESET_WIDGET = "qi21_aspect_preset";
export const ESTIMATE_WIDGET = "qi21_prefix_estimate";
export const REPORT_WIDGET = "qi21_run_report";
export const TURBO_STEPS = 8; // the Turbo sampler's stored schedule
export const POLL_MS = 1000; // upstream edits (prompt text, resolution, images) are picked up by a cheap poll
export const BYPASS_MODE = 4; // LiteGraph mode of a bypassed node: ComfyUI passes its same-typed input through
export const MAX_HOPS = 64; // bound on any walk through the graph (chains, reroutes), also against cycles

export const disabled = { preset: false, estimate: false, report: false, live: false };
let warned = false;

export function fail(feature, error) {
  disabled[feature] = true;
  if (!warned) {
    warned = true;
    console.warn(`[Qwen-Image 2.1] front-end helpers turned off (${feature}): unexpected ComfyUI front-end API.`, error);
  }
}

/** `fn` that does nothing once `feature` failed, and turns `feature` off (one warning) when it throws. */
export function guarded(feature, fn) {
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

export function classOf(node) {
  return node?.comfyClass ?? node?.type;
}

export function findWidget(node, name) {
  return Array.isArray(node?.widgets) ? node.widgets.find((w) => w && w.name === name) : undefined;
}

export function numberOf(value, fallback) {
  const n = Number(value);
  return Number.isFinite(n) ? n : fallback;
}

export function markDirty(node) {
  if (typeof node?.setDirtyCanvas === "function") node.setDirtyCanvas(true, true);
}

export function inputSlot(node, name) {
  if (!Array.isArray(node?.inputs)) return -1;
  if (typeof node.findInputSlot === "function") {
    const slot = node.findInputSlot(name);
    if (typeof slot === "number") return slot;
  }
  return node.inputs.findIndex((input) => input?.name === name);
}

export function linkById(graph, id) {
  const links = graph?._links ?? graph?.links;
  if (!links) return null;
  return typeof links.get === "function" ? links.get(id) : links[id];
}

/** The node feeding `node`'s input `name` (slot index for Reroute), through frontend Reroute nodes; or null. */
export function sourceNode(node, name) {
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
export function widgetValue(node, name) {
  const widget = findWidget(node, name);
  const source = sourceNode(node, name);
  if (source) {
    const upstream = findWidget(source, "value") ?? findWidget(source, name) ?? source.widgets?.[0];
    return upstream?.value;
  }
  return widget?.value;
}

// ------------------------------------------------------------------------------------------------ widgets

/** Keep a front-end-only widget out of the saved workflow and out of the API prompt. */
export function frontEndOnly(widget) {
  widget.serialize = false; // workflow JSON (widgets_values): LGraphNode.serialize/configure skip it
  widget.options = widget.options ?? {};
  widget.options.serialize = false; // API prompt: graphToPrompt skips it
}

/** Run `after(node)` after the widget's own callback (both renderers call widget.callback on user edits). */
export function afterCallback(widget, node, after) {
  const original = widget.callback;
  widget.callback = function (...args) {
    const result = typeof original === "function" ? original.apply(this, args) : undefined;
    after(node);
    return result;
  };
}
