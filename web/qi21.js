// Qwen-Image 2.1 front-end extension for the two samplers (QI21Sampler, QI21TurboSampler):
//   (a) an aspect-ratio preset combo that fills `width` and `height` (and shows "custom" after a hand edit);
//   (b) a live, read-only estimate of the prefix the sampler caches: tokens and bytes (bf16, full model);
//   (c) the last run's report (the `qi21_report` UI entry the sampler returns: cache hit/miss, tokens, bytes,
//       timings, notes), and while the sampler runs, its phase (prefill or cached steps) from ComfyUI's progress.
// The arithmetic and the texts live in qi21_estimate.js and qi21_report.js (pure, unit-tested under Node).
//
// The three widgets are front-end only. They are appended AFTER the schema's widgets and marked
// `widget.serialize = false` (kept out of the workflow's `widgets_values` / `widgets_values_named`) and
// `widget.options.serialize = false` (kept out of the API prompt), so saved workflows and the Python schema only
// ever see the real inputs. Appending matters: LGraphNode.serialize() writes each value at its widget's index
// (a skipped widget in the middle would leave a hole) while configure() restores the non-skipped widgets in
// order; after the last real widget the two agree. The report lives in this module (a WeakMap per node), never in
// the node's properties, so it is neither saved nor sent; it is cleared when the graph is queued again.
//
// Everything is defensive: if the front end's API differs from what this expects, one console warning is
// logged and the feature turns itself off; the node works as if this file did not exist.

import { api } from "../../scripts/api.js";
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
import { describePhase, describeStop, reportLine, reportsFrom, reportView } from "./qi21_report.js";

const EXTENSION_NAME = "QwenImage21.SamplerWidgets";
const SAMPLERS = new Set(["QI21Sampler", "QI21TurboSampler"]);
const TEXT_ENCODE = "QI21TextEncode";
const REFERENCE = "QI21Reference";
const PRESET_WIDGET = "qi21_aspect_preset";
const ESTIMATE_WIDGET = "qi21_prefix_estimate";
const REPORT_WIDGET = "qi21_run_report";
const TURBO_STEPS = 8; // the Turbo sampler's stored schedule
const POLL_MS = 1000; // upstream edits (prompt text, resolution, images) are picked up by a cheap poll
const BYPASS_MODE = 4; // LiteGraph mode of a bypassed node: ComfyUI passes its same-typed input through
const MAX_HOPS = 64; // bound on any walk through the graph (chains, reroutes), also against cycles

const disabled = { preset: false, estimate: false, report: false, live: false };
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

// --------------------------------------------------------------------------------------------- run report

/** Per sampler node: the reports received since the graph was last queued, and the live phase. Kept here, not
 * on the node, so nothing of it can reach a saved workflow. */
const reportStates = new WeakMap();
/** The sampler nodes that have a report widget (to clear them all when the graph is queued). */
const reportNodes = new Set();
let sawQueueing = false; // front ends with `promptQueueing` clear at the start of queueing, others after it

function reportState(node) {
  let state = reportStates.get(node);
  if (!state) {
    state = { reports: [], last: [], fromCache: false, cachedNext: false, queued: false, running: false, value: 0,
      max: null, stopped: null };
    reportStates.set(node, state);
  }
  return state;
}

/** The sampler's step count as far as the front end knows it before the first progress event (null: unknown). */
function expectedSteps(node) {
  const sigmas = inputSlot(node, "sigmas");
  if (sigmas >= 0 && node.inputs[sigmas]?.link != null) return null; // a custom schedule decides
  if (classOf(node) === "QI21TurboSampler") {
    return numberOf(findWidget(node, "denoise")?.value, 1) >= 1 ? TURBO_STEPS : null; // denoise < 1: fewer
  }
  if (sourceNode(node, "steps")) return null;
  const steps = numberOf(findWidget(node, "steps")?.value, NaN);
  return steps > 0 ? steps : null;
}

function phaseOf(node, state) {
  const cache = sourceNode(node, "prefix_cache") ? null : findWidget(node, "prefix_cache")?.value ?? "on";
  const keep = sourceNode(node, "keep_cache") ? true : Boolean(findWidget(node, "keep_cache")?.value);
  return describePhase({ running: state.running, value: state.value, max: state.max ?? expectedSteps(node),
    prefixCache: cache, keepCache: keep });
}

const REPORT_STYLE = {
  boxSizing: "border-box", width: "100%", height: "100%", overflowY: "auto", padding: "3px 6px",
  font: "11px/1.35 system-ui, sans-serif", color: "var(--input-text, #ddd)", whiteSpace: "normal",
  overflowWrap: "anywhere", background: "var(--comfy-input-bg, #222)", borderRadius: "6px", pointerEvents: "auto",
};
const LINE_STYLES = {
  phase: { color: "#7ec8ff" },
  summary: {},
  placeholder: { opacity: "0.6", fontStyle: "italic" },
  warning: { color: "#ffb347" },
};
const LINE_HEIGHT_PX = 15; // 11px text, line height 1.35
const AVERAGE_CHAR_PX = 6.5;
const REPORT_PADDING_PX = 28; // 3px above and below inside, the front end's margins around a DOM widget (10px each)
const FIT_FRAMES = 3; // canvas frames after a change in which the node is grown to fit the laid-out report

function reportLines(node, state) {
  const view = reportView(state.reports, { cached: state.fromCache });
  const phase = phaseOf(node, state);
  const lines = [];
  if (phase) lines.push({ kind: "phase", text: phase.text });
  if (state.stopped) lines.push({ kind: "warning", text: state.stopped });
  if (!view.empty) {
    lines.push({ kind: "summary", text: view.summary });
    for (const note of view.notes) lines.push({ kind: note.warning ? "warning" : "summary", text: note.text });
  } else if (!phase && !state.stopped) {
    lines.push({ kind: "placeholder", text: state.queued ? "queued: the run report shows here after the run"
      : "no run yet: the run report shows here" });
  }
  const tooltip = view.empty ? "The sampler's report on its last run (cache hit or miss, prefix tokens, cache size "
    + "and device, prefill and step times, notes) shows here after a run. Front-end only, not saved." : view.tooltip;
  return { lines, tooltip, text: phase ? phase.text : reportLine(view) || lines[0]?.text || "" };
}

/** Height the DOM widget asks for: its lines as laid out on the page (when it is), else estimated from their length
 * wrapped at the node's width. */
function reportHeight(node) {
  const widget = findWidget(node, REPORT_WIDGET);
  const element = widget?.element;
  let content = 0;
  if (element?.isConnected) {
    for (const child of element.children ?? []) content += numberOf(child.offsetHeight, 0);
  }
  if (!(content > 0)) {
    const lines = widget?.qi21Lines ?? [];
    const perLine = Math.max(16, Math.floor((numberOf(node.size?.[0], 300) - 40) / AVERAGE_CHAR_PX));
    content = lines.reduce((sum, line) => sum + Math.max(1, Math.ceil(line.text.length / perLine)), 0) * LINE_HEIGHT_PX;
  }
  return Math.ceil(Math.max(2 * LINE_HEIGHT_PX, content)) + REPORT_PADDING_PX;
}

/** Grow (never shrink) the node when the report needs more room than it has, as image previews do. */
const growToFit = guarded("report", (node) => {
  if (typeof node.computeSize !== "function" || typeof node.setSize !== "function" || !Array.isArray(node.size)) return;
  const needed = node.computeSize();
  if (Array.isArray(needed) && needed[1] > node.size[1]) {
    node.setSize([node.size[0], needed[1]]);
    markDirty(node);
  }
});

/** Canvas renderer, each frame: for a few frames after a change, fit the node to the report as laid out. */
const fitPending = guarded("report", (node) => {
  const state = reportStates.get(node);
  if (!(state?.fitFrames > 0)) return;
  state.fitFrames -= 1;
  growToFit(node);
});

function fillElement(element, lines, tooltip) {
  const children = lines.map((line) => {
    const div = document.createElement("div");
    div.className = `qi21-report-${line.kind}`;
    div.textContent = line.text;
    Object.assign(div.style, LINE_STYLES[line.kind] ?? {});
    return div;
  });
  element.replaceChildren(...children);
  element.title = tooltip;
}

const renderReport = guarded("report", (node) => {
  const widget = findWidget(node, REPORT_WIDGET);
  if (!widget) return;
  const { lines, tooltip, text } = reportLines(node, reportState(node));
  widget.qi21Lines = lines;
  widget.qi21Text = text;
  widget.tooltip = tooltip;
  if (widget.element) {
    fillElement(widget.element, lines, tooltip);
    growToFit(node);
    reportState(node).fitFrames = FIT_FRAMES; // measured again once the front end has laid the lines out
  } else {
    widget.value = text;
  }
  markDirty(node);
});

const receiveReport = guarded("report", (node, output) => {
  const state = reportState(node);
  const reports = reportsFrom(output);
  if (!reports.length) return;
  if (state.cachedNext) {
    // ComfyUI reused the node's output and sent its UI entry again: the sampler did not run. Keep what this
    // queueing already showed; show that old report (marked) only when there is nothing else.
    state.cachedNext = false;
    if (!state.reports.length || state.fromCache) {
      state.reports = reports.slice(-1);
      state.fromCache = true;
    }
  } else {
    if (state.fromCache) state.reports = [];
    state.reports.push(...reports);
    state.fromCache = false;
  }
  state.last = state.reports.slice();
  state.running = false;
  state.stopped = null;
  renderReport(node);
});

/** ComfyUI will reuse the node's cached output (`execution_cached`): the sampler does not run. ComfyUI usually
 * sends no report for it then, so the node shows the last report this page received, marked as not re-run. */
const markCached = guarded("report", (node) => {
  const state = reportState(node);
  state.cachedNext = true;
  if (state.reports.length) return; // this queueing already ran it (a batch): keep those
  state.reports = state.last.slice(-1);
  state.fromCache = true;
  state.queued = false;
  renderReport(node);
});

function resetReport(node, queued) {
  const state = reportState(node);
  Object.assign(state, { reports: [], fromCache: false, cachedNext: false, queued, running: false, value: 0, max: null,
    stopped: null });
  renderReport(node);
}

const addReportWidget = guarded("report", (node) => {
  if (findWidget(node, REPORT_WIDGET)) return;
  let widget;
  if (typeof node.addDOMWidget === "function" && typeof document !== "undefined") {
    const element = document.createElement("div");
    element.className = "qi21-run-report";
    element.setAttribute?.("aria-label", "Qwen-Image 2.1 run report");
    Object.assign(element.style, REPORT_STYLE);
    widget = node.addDOMWidget(REPORT_WIDGET, "qi21_report", element, {
      serialize: false,
      hideOnZoom: true,
      getValue: () => findWidget(node, REPORT_WIDGET)?.qi21Text ?? "",
      setValue: () => {}, // read-only: a saved workflow never carries a value for it
      getMinHeight: () => reportHeight(node),
    });
  } else {
    // Without DOM widgets: a read-only text widget with the one-line summary; the tooltip has the rest.
    widget = node.addWidget("text", REPORT_WIDGET, "", () => renderReport(node), { serialize: false, read_only: true });
    if (typeof widget.onClick === "function") widget.onClick = () => {};
  }
  if (!widget) throw new Error(`${classOf(node)}: the report widget was not created`);
  frontEndOnly(widget);
  widget.label = "last run";
  reportNodes.add(node);
  renderReport(node);
});

/** The node a server execution id names: "12" in the root graph, "7:12" node 12 inside subgraph node 7. */
function nodeByExecutionId(id) {
  if (id === null || id === undefined) return null;
  let graph = app.rootGraph ?? app.graph;
  let node = null;
  for (const part of String(id).split(":")) {
    if (!graph || typeof graph.getNodeById !== "function") return null;
    node = (/^\d+$/.test(part) ? graph.getNodeById(Number(part)) : null) ?? graph.getNodeById(part) ?? null;
    graph = node?.subgraph ?? null;
  }
  return node && reportNodes.has(node) ? node : null;
}

function setRunning(node, running) {
  const state = reportState(node);
  if (state.running === running) return;
  state.running = running;
  if (running) Object.assign(state, { value: 0, max: null, stopped: null });
  renderReport(node);
}

function stopAll(kind, detail) {
  for (const node of reportNodes) {
    const state = reportState(node);
    if (!state.running) continue;
    const failedHere = kind !== "error" || detail?.node_id == null || nodeByExecutionId(detail.node_id) === node;
    if (kind !== "success" && failedHere) state.stopped = describeStop(kind, state);
    setRunning(node, false);
  }
}

/** ComfyUI's websocket events (scripts/api.js): queueing clears, progress drives the phase. */
const LIVE_EVENTS = {
  promptQueueing() {
    sawQueueing = true;
    for (const node of reportNodes) {
      if (node.graph) resetReport(node, true);
      else reportNodes.delete(node); // left with a closed workflow
    }
  },
  promptQueued() {
    if (sawQueueing) return;
    for (const node of reportNodes) resetReport(node, true);
  },
  execution_start() {
    for (const node of reportNodes) Object.assign(reportState(node), { cachedNext: false });
    stopAll("success");
  },
  execution_cached(detail) {
    for (const id of Array.isArray(detail?.nodes) ? detail.nodes : []) {
      const node = nodeByExecutionId(id);
      if (node) markCached(node);
    }
  },
  executing(detail) {
    const id = detail !== null && typeof detail === "object" ? detail.display_node ?? detail.node : detail;
    const current = nodeByExecutionId(id);
    for (const node of reportNodes) if (node !== current) setRunning(node, false);
    if (current) setRunning(current, true);
  },
  progress(detail) {
    const node = nodeByExecutionId(detail?.display_node ?? detail?.node);
    if (!node) return;
    const state = reportState(node);
    setRunning(node, true);
    state.value = numberOf(detail.value, 0);
    state.max = numberOf(detail.max, null);
    renderReport(node);
  },
  execution_success() {
    stopAll("success");
  },
  execution_interrupted(detail) {
    stopAll("interrupted", detail);
  },
  execution_error(detail) {
    stopAll("error", detail);
  },
};

function listenLive() {
  if (typeof api?.addEventListener !== "function") throw new Error("scripts/api.js has no addEventListener");
  for (const [type, handler] of Object.entries(LIVE_EVENTS)) {
    api.addEventListener(type, guarded("live", (event) => handler(event?.detail)));
  }
}

/** Canvas renderer: the phase in the title bar's right end, beside ComfyUI's progress bar, while the node runs. */
const drawPhase = guarded("live", (node, ctx) => {
  const state = reportStates.get(node);
  if (!state?.running || node.flags?.collapsed || !ctx || typeof ctx.fillText !== "function") return;
  const phase = phaseOf(node, state);
  if (!phase) return;
  const title = numberOf(globalThis.LiteGraph?.NODE_TITLE_HEIGHT, 30);
  ctx.save();
  ctx.font = "bold 11px system-ui, sans-serif";
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  ctx.fillStyle = "#7ec8ff";
  ctx.fillText(phase.short, numberOf(node.size?.[0], 200) - 10, -title / 2);
  ctx.restore();
});

// ---------------------------------------------------------------------------------------------- extension

function chainPrototype(prototype, method, after) {
  const original = prototype[method];
  prototype[method] = function (...args) {
    const result = typeof original === "function" ? original.apply(this, args) : undefined;
    after(this, ...args);
    return result;
  };
}

const extension = {
  name: EXTENSION_NAME,

  async setup() {
    try {
      listenLive();
    } catch (error) {
      fail("live", error);
    }
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
      // The run report: ComfyUI calls onExecuted with the node's UI output (`qi21_report`) after each run.
      chainPrototype(prototype, "onExecuted", (node, output) => receiveReport(node, output));
      chainPrototype(prototype, "onRemoved", (node) => reportNodes.delete(node));
      chainPrototype(prototype, "onDrawForeground", (node, ctx) => {
        fitPending(node);
        drawPhase(node, ctx);
      });
    } catch (error) {
      fail("preset", error);
      fail("estimate", error);
      fail("report", error);
    }
  },

  async nodeCreated(node) {
    if (!SAMPLERS.has(classOf(node))) return;
    addPresetWidget(node);
    addEstimateWidget(node);
    addReportWidget(node);
  },
};

try {
  if (typeof app?.registerExtension !== "function") throw new Error("app.registerExtension is missing");
  app.registerExtension(extension);
} catch (error) {
  fail("preset", error);
  fail("estimate", error);
  fail("report", error);
}
