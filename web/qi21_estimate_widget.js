// The sampler's "prefix cache" widget: a live, read-only estimate of the prefix it caches (tokens and bf16 bytes),
// from the graph upstream of `positive` (and `negative` with cfg > 1). The arithmetic is qi21_estimate.js.

import { app } from "../../scripts/app.js";
import {
  SAMPLERS,
  TEXT_ENCODE,
  REFERENCE,
  ESTIMATE_WIDGET,
  BYPASS_MODE,
  MAX_HOPS,
  guarded,
  classOf,
  findWidget,
  numberOf,
  markDirty,
  sourceNode,
  widgetValue,
  frontEndOnly,
  afterCallback,
} from "./qi21_common.js";
import { estimatePrefix, formatBytes, formatCount, formatEstimate } from "./qi21_estimate.js";

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
        fit: widgetValue(current, "fit") ?? "resize",
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

/** Nodes that pass the model on (a copy with their own change) and the Prefix Cache node (nodes/cache.py). */
const MODEL_PASSING = new Set(["QI21LoraLoader", "QI21ControlNetApply"]);
const CACHE_OPTIONS = "QI21CacheOptions";

/** The cache options the sampler's model carries: the nearest Prefix Cache node up the model chain (through LoRA and
 * ControlNet nodes; a bypassed one passes the model through), else the defaults. */
function cacheOptions(sampler) {
  let current = sourceNode(sampler, "model");
  for (let hop = 0; current && hop < MAX_HOPS; hop++) {
    const kind = classOf(current);
    if (kind === CACHE_OPTIONS && current.mode !== BYPASS_MODE) {
      return { device: String(widgetValue(current, "device") ?? "auto"), dtype: String(widgetValue(current, "dtype") ?? "default") };
    }
    if (kind !== CACHE_OPTIONS && !MODEL_PASSING.has(kind)) break;
    current = sourceNode(current, "model");
  }
  return { device: "auto", dtype: "default" };
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
  const options = cacheOptions(sampler);
  const estimate = estimatePrefix(prompts, undefined, options.dtype);
  const cacheOn = findWidget(sampler, "prefix_cache")?.value !== "off" && options.device !== "off";
  const unknown = prompts.some((p) => p.unknown);
  let text = formatEstimate(estimate, { cacheOn });
  if (unknown) text = text.replace(/^~/, "≥ ");

  const lines = prompts.map((p, i) => `${p.name}: ~${formatCount(estimate.perPrompt[i])} tokens (prompt ${p.promptChars} chars, `
    + `${p.references.length} reference${p.references.length === 1 ? "" : "s"})${p.unknown ? ", partly unknown source" : ""}`);
  const perToken = options.dtype === "default" ? "0.5 MiB per prefix token in bf16"
    : `${formatBytes(estimate.tokens ? estimate.bytes / estimate.tokens : 0)} per prefix token in ${options.dtype}, scales included`;
  lines.push(`cache: ${perToken} (32 layers x 32 heads x 128, keys and values); `
    + `~${formatBytes(estimate.bytes)} in all; a batch shares it.`);
  if (options.dtype !== "default" || options.device !== "auto") {
    lines.push(`Prefix Cache node: device ${options.device}, dtype ${options.dtype}.`);
  }
  if (estimate.assumed) lines.push(`${estimate.assumed} reference image size(s) unknown until loaded: assumed square at their resolution.`);
  if (unknown) lines.push("Some conditioning does not come straight from Qwen-Image 2.1 nodes: lower bound.");
  return { text, tooltip: `Estimated prefix (text + references) the sampler caches.\n${lines.join("\n")}` };
}

export const refreshEstimate = guarded("estimate", (node) => {
  const widget = findWidget(node, ESTIMATE_WIDGET);
  if (!widget || !node.graph) return;
  const { text, tooltip } = describe(node);
  if (widget.value !== text) {
    widget.value = text;
    markDirty(node);
  }
  widget.tooltip = tooltip;
});

export const pollEstimates = guarded("estimate", () => {
  if (typeof document !== "undefined" && document.hidden) return;
  const graph = app.canvas?.graph ?? app.graph; // the graph on screen (a subgraph when one is open)
  const nodes = graph?._nodes ?? graph?.nodes ?? [];
  for (const node of nodes) if (SAMPLERS.has(classOf(node))) refreshEstimate(node);
});

export const addEstimateWidget = guarded("estimate", (node) => {
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
