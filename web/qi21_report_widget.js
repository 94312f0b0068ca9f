// The sampler's "last run" widget: the run report (`qi21_report`) after each run and, while the sampler runs,
// its phase (prefill or cached steps) from ComfyUI's websocket events. The texts are qi21_report.js.

import { api } from "../../scripts/api.js";
import { app } from "../../scripts/app.js";
import {
  REPORT_WIDGET,
  TURBO_STEPS,
  guarded,
  classOf,
  findWidget,
  numberOf,
  markDirty,
  inputSlot,
  sourceNode,
  frontEndOnly,
} from "./qi21_common.js";
import { describePhase, describeStop, reportLine, reportsFrom, reportView } from "./qi21_report.js";

// --------------------------------------------------------------------------------------------- run report

/** Per sampler node: the reports received since the graph was last queued, and the live phase. Kept here, not
 * on the node, so nothing of it can reach a saved workflow. */
const reportStates = new WeakMap();
/** The sampler nodes that have a report widget (to clear them all when the graph is queued). */
export const reportNodes = new Set();
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
export const fitPending = guarded("report", (node) => {
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

export const receiveReport = guarded("report", (node, output) => {
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

export const addReportWidget = guarded("report", (node) => {
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

export function listenLive() {
  if (typeof api?.addEventListener !== "function") throw new Error("scripts/api.js has no addEventListener");
  for (const [type, handler] of Object.entries(LIVE_EVENTS)) {
    api.addEventListener(type, guarded("live", (event) => handler(event?.detail)));
  }
}

/** Canvas renderer: the phase in the title bar's right end, beside ComfyUI's progress bar, while the node runs. */
export const drawPhase = guarded("live", (node, ctx) => {
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
