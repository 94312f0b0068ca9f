// The sampler's "aspect preset" combo: fills width and height, and shows "custom" after a hand edit.

import {
  PRESET_WIDGET,
  guarded,
  classOf,
  findWidget,
  numberOf,
  markDirty,
  frontEndOnly,
  afterCallback,
} from "./qi21_common.js";
import { presetFor, presetSizes } from "./qi21_estimate.js";

export const syncPreset = guarded("preset", (node) => {
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

export const addPresetWidget = guarded("preset", (node) => {
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
