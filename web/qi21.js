// Qwen-Image 2.1 front-end extension for the two samplers (QI21Sampler, QI21TurboSampler):
//   (a) an aspect-ratio preset combo that fills `width` and `height` (and shows "custom" after a hand edit);
//   (b) a live, read-only estimate of the prefix the sampler caches: tokens and bytes (bf16, full model);
//   (c) the last run's report (the `qi21_report` UI entry the sampler returns: cache hit/miss, tokens, bytes,
//       timings, notes), and while the sampler runs, its phase (prefill or cached steps) from ComfyUI's progress.
// Each widget is its own module (qi21_preset_widget.js, qi21_estimate_widget.js, qi21_report_widget.js, sharing
// qi21_common.js); the arithmetic and the texts live in qi21_estimate.js and qi21_report.js (pure, unit-tested
// under Node). This file only registers the extension and wires the widgets to the node's lifecycle.
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

import { app } from "../../scripts/app.js";
import { SAMPLERS, POLL_MS, disabled, fail, classOf } from "./qi21_common.js";
import { refreshEstimate, pollEstimates, addEstimateWidget } from "./qi21_estimate_widget.js";
import { syncPreset, addPresetWidget } from "./qi21_preset_widget.js";
import { SETTINGS } from "./qi21_settings.js";
import { reportNodes, receiveReport, fitPending, addReportWidget, listenLive, drawPhase } from "./qi21_report_widget.js";

const EXTENSION_NAME = "QwenImage21.SamplerWidgets";

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
  settings: SETTINGS, // the settings panel's entries (the kept caches' ceiling); the server reads the saved values

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
