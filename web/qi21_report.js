// Qwen-Image 2.1 front-end text for the samplers' run report and their live phase.
//
// Pure functions only (no DOM, no ComfyUI), so Node can unit-test them (tests/test_web_extension.py).
// ComfyUI also loads this file as an extension because it sits in WEB_DIRECTORY; it has no side effects.
//
// The report is the `qi21_report` UI entry every sampler returns (nodes/samplers.py, model/sampling/loop.py):
// a list with one dict per run, keys `prefix_tokens`, `target_tokens`, `batch`, `steps`, `cache` ("off", "miss",
// "partial" or "hit"), `cache_bytes`, `cache_device`, `prefill_seconds`, `step_seconds` (mean cached step),
// `prefix_rows_reused` / `prefix_rows_computed` (rows taken from a kept cache or shared by the run's prompts, and
// rows the prefill computed), `cache_dtype` ("default", or "int8" / "int4" from the Prefix Cache node: how the cache
// stored its rows; `cache_bytes` are the stored bytes, scales included), `prefix_key` (content hash of the rows through the last reference),
// `step_cache` (with the Step Cache node: `mode`, `threshold`, `run` / `skipped` calls, `per` "step" or "model call",
// `blocks_skipped_share`, per call its `indicator` (null where there was no full pass to compare with) and `pattern`,
// "F" full / "S" skipped, `control` "reuse" / "recompute" with a Fun ControlNet, model/sampling/step_cache.py) and, when there is something to say, `notes` (strings). Keys may be missing or null (e.g. no prefill on a cache hit, no cache
// device when the cache is off); keys this file does not know are still shown in the detail text.
//
// The phase comes from ComfyUI's `progress` event (value = steps done, max = steps): with the prefix cache on,
// step 1 computes the prefix (prompt + references) and caches it (the prefill), steps 2..N run only the image
// rows against the cache. With `keep_cache` a kept cache may make step 1 a cached step as well; only the report
// tells afterwards.

import { formatBytes, formatCount } from "./qi21_estimate.js";

/** Separator of the compact summary. */
export const SEP = " · ";
/** Marks a note: every note says the run did something other than asked (ignored input, floored size, ...). */
export const WARNING_MARK = "⚠";

const CACHED_NOTE = "ComfyUI reused this node's earlier output (same inputs): the sampler did not run.";

const CACHE_WORDS = {
  hit: "the prefix came from a kept cache: no prefill this run",
  miss: "step 1 computed the prefix and cached it; later steps reused it",
  partial: "a kept cache held the prefix's leading rows (the references): step 1 computed only the rest",
  off: "no prefix cache: every step ran the whole sequence",
};

/** Keys the detail text describes itself; others are listed after them, as they come. */
const KNOWN_KEYS = new Set(["cache", "prefix_tokens", "target_tokens", "batch", "steps", "cache_bytes", "cache_device",
  "prefill_seconds", "step_seconds", "peak_bytes", "loras", "plan", "notes", "prefix_rows_reused",
  "prefix_rows_computed", "prefix_key", "cache_dtype", "step_cache"]);

function isRecord(value) {
  return value !== null && typeof value === "object" && !Array.isArray(value);
}

/** A finite number, or null (missing keys, nulls, strings, NaN all give null). */
function num(value) {
  return typeof value === "number" && Number.isFinite(value) ? value : null;
}

function plural(n, word) {
  return `${formatCount(n)} ${word}${n === 1 ? "" : "s"}`;
}

/** "skipped 11 of 40 steps", or null when the report has no step cache. */
export function summarizeStepCache(stepCache) {
  if (!isRecord(stepCache)) return null;
  const run = num(stepCache.run);
  const skipped = num(stepCache.skipped);
  if (run === null || skipped === null) return null;
  const unit = stepCache.per === "model call" ? "calls" : "steps";
  return `skipped ${formatCount(skipped)} of ${formatCount(run + skipped)} ${unit}`;
}

/** The step cache's lines of the detail text: the rule and what it skipped, then each call's indicator and
 * decision ("0.0412 S": skipped; "-" where there was no full pass to compare with). */
function describeStepCache(stepCache) {
  if (!isRecord(stepCache)) return [describeValue(stepCache)];
  const lines = [];
  const head = summarizeStepCache(stepCache) ?? "no calls";
  const share = num(stepCache.blocks_skipped_share);
  const rule = [typeof stepCache.mode === "string" ? stepCache.mode : null,
    num(stepCache.threshold) !== null ? `threshold ${stepCache.threshold}` : null,
    Array.isArray(stepCache.window) ? `window ${stepCache.window.join("-")}` : null,
    num(stepCache.max_skips) !== null ? `at most ${stepCache.max_skips} in a row` : null,
    typeof stepCache.control === "string" ? `Fun ControlNet ${stepCache.control}d on skipped steps` : null,
  ].filter(Boolean).join(", ");
  lines.push(`${head}${share !== null ? ` (${Math.round(share * 100)}% of the block work)` : ""}${rule ? `; ${rule}` : ""}`);
  const indicator = Array.isArray(stepCache.indicator) ? stepCache.indicator : [];
  const pattern = typeof stepCache.pattern === "string" ? stepCache.pattern : "";
  if (indicator.length || pattern) {
    const count = Math.max(indicator.length, pattern.length);
    const calls = [];
    for (let i = 0; i < count; i++) {
      const value = num(indicator[i]);
      calls.push(`${i + 1}: ${value === null ? "-" : value.toFixed(4)}${pattern[i] === "S" ? " S" : ""}`);
    }
    lines.push(`indicator per ${stepCache.per === "model call" ? "model call" : "step"} (S = skipped): ${calls.join(", ")}`);
  }
  return lines;
}

/** The report dicts in a node's UI output `{qi21_report: [...]}`, or in a bare list of reports, or one report
 * dict (a dict with at least one report key). Anything else (another UI entry, non-dicts) gives none. */
export function reportsFrom(output) {
  let list = output;
  if (isRecord(output)) {
    if ("qi21_report" in output) list = output.qi21_report;
    else return Object.keys(output).some((key) => KNOWN_KEYS.has(key)) ? [output] : [];
  }
  if (isRecord(list)) list = [list];
  return Array.isArray(list) ? list.filter(isRecord) : [];
}

/** Seconds for people: "4.3 ms", "0.16 s", "1.23 s", "12.3 s", "123 s". */
export function formatSeconds(seconds) {
  const s = num(seconds);
  if (s === null) return "?";
  if (s < 0.1) return `${(s * 1000).toFixed(1)} ms`;
  if (s < 10) return `${s.toFixed(2)} s`;
  if (s < 100) return `${s.toFixed(1)} s`;
  return `${Math.round(s)} s`;
}

/** The notes of a report, as strings (a lone string counts as one note). */
export function reportNotes(report) {
  if (!isRecord(report)) return [];
  const notes = report.notes;
  const list = Array.isArray(notes) ? notes : notes === undefined || notes === null ? [] : [notes];
  return list.filter((n) => n !== null && n !== undefined && n !== "")
    .map((n) => (typeof n === "string" ? n : JSON.stringify(n)));
}

/**
 * The compact summary of one run, e.g. "cache hit · 4,171 prefix tokens · 2.0 GiB on cuda:0 · step 0.16 s";
 * a miss adds the prefill time before the step time; a partial reuse leads with "partial: 4,131 of 4,160 prefix
 * rows reused". Missing keys leave their part out.
 */
export function summarizeReport(report) {
  if (!isRecord(report)) return "no report";
  const parts = [];
  const reused = num(report.prefix_rows_reused);
  const computed = num(report.prefix_rows_computed);
  if (report.cache === "partial" && reused !== null && computed !== null) {
    parts.push(`partial: ${formatCount(reused)} of ${formatCount(reused + computed)} prefix rows reused`);
  } else if (typeof report.cache === "string" && report.cache) parts.push(`cache ${report.cache}`);
  const prefix = num(report.prefix_tokens);
  if (prefix !== null) parts.push(`${formatCount(prefix)} prefix tokens`);
  const bytes = num(report.cache_bytes);
  if (bytes !== null && bytes > 0) {
    const device = typeof report.cache_device === "string" && report.cache_device ? ` on ${report.cache_device}` : "";
    const stored = report.cache_dtype === "int8" || report.cache_dtype === "int4" ? ` ${report.cache_dtype}` : "";
    parts.push(`${formatBytes(bytes)}${stored}${device}`);
  }
  if (num(report.prefill_seconds) !== null) parts.push(`prefill ${formatSeconds(report.prefill_seconds)}`);
  if (num(report.step_seconds) !== null) parts.push(`step ${formatSeconds(report.step_seconds)}`);
  const skipped = summarizeStepCache(report.step_cache);
  if (skipped !== null) parts.push(skipped);
  return parts.length ? parts.join(SEP) : "no details reported";
}

function describeValue(value) {
  if (typeof value === "string") return value;
  if (typeof value === "number") return Number.isInteger(value) ? formatCount(value) : String(value);
  return JSON.stringify(value);
}

function describeLoras(loras) {
  if (!Array.isArray(loras)) return describeValue(loras);
  if (!loras.length) return "none";
  return loras.map((lora) => {
    if (!isRecord(lora)) return describeValue(lora);
    const strength = num(lora.strength);
    return strength === null ? String(lora.name ?? "?") : `${lora.name ?? "?"} (${strength})`;
  }).join(", ");
}

function describePlan(plan) {
  if (!isRecord(plan)) return describeValue(plan);
  return Object.entries(plan).map(([key, value]) => `${key} ${describeValue(value)}`).join(", ");
}

/**
 * The whole report of one run as lines of text (the tooltip): every key with its meaning, then the notes.
 * `index`/`count` (1-based) say which of several runs it is.
 */
export function reportDetail(report, { index = 1, count = 1 } = {}) {
  if (!isRecord(report)) return "Qwen-Image 2.1 sampler: no report.";
  const lines = [count > 1 ? `Qwen-Image 2.1 sampler: run ${index} of ${count} (the last is shown)`
    : "Qwen-Image 2.1 sampler: last run"];
  const add = (label, value) => lines.push(`${label}: ${value}`);
  if (typeof report.cache === "string") add("prefix cache", `${report.cache}${CACHE_WORDS[report.cache] ? ` (${CACHE_WORDS[report.cache]})` : ""}`);
  const reusedRows = num(report.prefix_rows_reused);
  const computedRows = num(report.prefix_rows_computed);
  if (num(report.prefix_tokens) !== null) add("prefix tokens", `${formatCount(report.prefix_tokens)} (prompt and references, all prompts)`);
  if (num(report.target_tokens) !== null) add("target tokens", `${formatCount(report.target_tokens)} per image`);
  if (num(report.batch) !== null) add("batch", report.batch === 1 ? "1 image" : `${plural(report.batch, "image")} sharing one cache`);
  if (num(report.steps) !== null) add("steps", formatCount(report.steps));
  if (num(report.cache_bytes) !== null) {
    add("cache size", report.cache_bytes > 0 ? `${formatBytes(report.cache_bytes)} (${formatCount(report.cache_bytes)} bytes)` : "none");
  }
  if ("cache_device" in report) add("cache device", report.cache_device ? String(report.cache_device) : "none");
  if (typeof report.cache_dtype === "string") {
    add("cache dtype", report.cache_dtype === "default" ? "default (the model's dtype)"
      : `${report.cache_dtype} (quantized per token; the size includes the scales)`);
  }
  if (reusedRows !== null && computedRows !== null && (reusedRows > 0 || report.cache === "partial")) {
    add("prefix rows", `${formatCount(reusedRows)} reused, ${formatCount(computedRows)} computed in step 1`);
  }
  if (typeof report.prefix_key === "string") add("prefix key", report.prefix_key);
  if (num(report.prefill_seconds) !== null) add("prefill (step 1)", formatSeconds(report.prefill_seconds));
  if (num(report.step_seconds) !== null) add("mean step after the prefill", formatSeconds(report.step_seconds));
  if (num(report.peak_bytes) !== null) add("peak device memory", formatBytes(report.peak_bytes));
  if ("loras" in report) add("LoRAs", describeLoras(report.loras));
  if ("plan" in report) add("plan", describePlan(report.plan));
  if ("step_cache" in report) {
    const [first, ...rest] = describeStepCache(report.step_cache);
    add("step cache", first);
    lines.push(...rest);
  }
  for (const [key, value] of Object.entries(report)) {
    if (!KNOWN_KEYS.has(key)) add(key, describeValue(value));
  }
  for (const note of reportNotes(report)) lines.push(`${WARNING_MARK} ${note}`);
  return lines.join("\n");
}

/**
 * What the node shows for the reports received since the graph was queued (oldest first; the last is shown):
 * `{empty, summary, runs, notes: [{text, warning}], tooltip}`. `runs` says how many when there are several;
 * `cached` marks a result ComfyUI took from its cache (the sampler did not run, the report is the old run's).
 */
export function reportView(reports, { cached = false } = {}) {
  const list = reportsFrom(reports);
  if (!list.length) {
    if (!cached) return { empty: true, summary: "", runs: null, notes: [], tooltip: "" };
    return { empty: false, summary: "not re-run (ComfyUI cache): no report in this page yet", runs: null, notes: [],
      tooltip: CACHED_NOTE };
  }
  const last = list[list.length - 1];
  const count = list.length;
  let summary = summarizeReport(last);
  const runs = count > 1 ? `last of ${formatCount(count)} runs` : null;
  if (runs) summary = `${runs}: ${summary}`;
  if (cached) summary = `not re-run (ComfyUI cache)${SEP}${summary}`;
  const notes = reportNotes(last).map((text) => ({ text: `${WARNING_MARK} ${text}`, warning: true }));
  let tooltip = reportDetail(last, { index: count, count });
  if (cached) tooltip += `\n${CACHED_NOTE} Shown: the last report this page received for it.`;
  return { empty: false, summary, runs, notes, tooltip };
}

/** One line for text-only renderers: the summary, and how many notes there are. */
export function reportLine(view) {
  if (!view || view.empty) return "";
  const warnings = view.notes.length;
  return warnings ? `${view.summary}${SEP}${WARNING_MARK} ${plural(warnings, "note")}` : view.summary;
}

/**
 * The phase of a running sampler from ComfyUI's progress (`value` steps done of `max`; value 0 / max null before
 * the first progress event, i.e. while step 1 runs): `{short, text}` or null when it is not running.
 * `prefixCache` "on"/"off" and `keepCache` are the node's widget values (null when unknown, e.g. linked inputs).
 */
export function describePhase({ running = false, value = 0, max = null, prefixCache = "on", keepCache = false } = {}) {
  if (!running) return null;
  const total = num(max) !== null && max > 0 ? Math.round(max) : null;
  const done = Math.max(0, Math.round(num(value) ?? 0));
  const of = total ? `/${total}` : "";
  if (total && done >= total) return { short: `done ${total}${of}`, text: `${plural(total, "step")} done: finishing` };
  const step = done + 1;
  if (prefixCache === "off") {
    return { short: `step ${step}${of}`, text: `step ${step}${of} · full sequence (prefix cache off)` };
  }
  if (done === 0) {
    if (keepCache) return { short: `prefill? 1${of}`, text: `step 1${of} · prefill, or a kept cache (keep_cache)` };
    return { short: `prefill 1${of}`, text: `step 1${of} · prefill: prompt and references into the cache` };
  }
  return { short: `cached ${step}${of}`, text: `step ${step}${of} · cached step: image rows only` };
}

/** What a run that ended early leaves on the node: "interrupted at step 3/8" (null when nothing ran). */
export function describeStop(kind, { value = 0, max = null } = {}) {
  const total = num(max) !== null && max > 0 ? Math.round(max) : null;
  const step = Math.max(0, Math.round(num(value) ?? 0)) + 1;
  const where = total ? `step ${Math.min(step, total)}/${total}` : `step ${step}`;
  return kind === "error" ? `${WARNING_MARK} failed at ${where}` : `${WARNING_MARK} interrupted at ${where}`;
}
