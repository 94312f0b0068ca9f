// Qwen-Image 2.1 front-end arithmetic: aspect-ratio presets and the prefix-cache size estimate.
//
// Pure functions only (no DOM, no ComfyUI), so Node can unit-test them (tests/test_web_extension.py).
// ComfyUI also loads this file as an extension because it sits in WEB_DIRECTORY; it has no side effects.
//
// Numbers (the DiT's config in docs/checkpoints.md, model/encoders/references.py, model/sampling/loop.py):
// - a reference of W x H pixels is resized once to area ~ resolution^2, aspect kept, each side rounded to a
//   multiple of 32 with Python's round (ties to even); resolution 0 keeps its own size floored to x32;
// - each resized reference becomes (H/16) * (W/16) latent tokens in the prefix;
// - text: ~10 template tokens + the prompt (~ 1 token per 4 characters) + ~8 tag tokens per reference
//   (`<imageN><|vision_start|>...<|vision_end|>`; the image-pad slots themselves become the latent tokens);
// - cache bytes = 2 (K and V) * layers * heads * head_dim * prefix tokens * bytes per element:
//   32 * 32 * 128 in bf16 = 0.5 MiB per prefix token. One cache per distinct prefix (true CFG adds the
//   negative prompt's); the samples of a batch share it.
// - a quantized cache (the Prefix Cache node's dtype int8 / int4, model/prefix_cache/storage_formats.py) stores each
//   token's keys (or values) of one layer, all heads, as heads * head_dim bytes (int8) or half that (int4) plus one
//   fp32 scale: 0.5005x / 0.2505x of bf16 for the released model.

/** Pixels per side of one VLM image token: sides of a resized reference are multiples of this. */
export const SIZE_STEP = 32;
/** Pixels per side of one latent token (the VAE's 16x compression). */
export const LATENT_TOKEN_PIXELS = 16;
/** Template tokens kept around the prompt (user/assistant turn markers), rounded up a little. */
export const TEMPLATE_TOKENS = 10;
/** Text tokens per reference for its `<imageN><|vision_start|>` ... `<|vision_end|>` tags. */
export const REFERENCE_TAG_TOKENS = 8;
/** Prompt characters per token, a rough average for English BPE text. */
export const CHARS_PER_TOKEN = 4;
/** The full-size DiT: num_layers 32, num_attention_heads 32, attention_head_dim 128 (its transformer config, see
 * docs/checkpoints.md); the cache is kept in bf16. */
export const FULL_MODEL = Object.freeze({ layers: 32, heads: 32, headDim: 128, bytesPerElement: 2 });
/** The default output/reference size: area ~ 1024^2. */
export const DEFAULT_RESOLUTION = 1024;
/** The released model's limit on references per prompt. */
export const MAX_REFERENCES = 10;

/** Python's `round()` for non-negative floats: halves go to the even neighbour (banker's rounding). */
export function roundHalfEven(x) {
  const floor = Math.floor(x);
  const fraction = x - floor; // exact for doubles of this size
  if (fraction > 0.5) return floor + 1;
  if (fraction < 0.5) return floor;
  return floor % 2 === 0 ? floor : floor + 1;
}

/**
 * [width, height] a `w x h` image is resized to: area ~ resolution^2, aspect kept, sides rounded to x32.
 * Same floating-point operations, in the same order, as `reference_size` in model/encoders/references.py (diffusers'
 * `calculate_dimensions`), so the results agree exactly. `resolution` 0 keeps the size, floored to x32.
 */
export function referenceSize(w, h, resolution) {
  if (!(resolution >= 0)) throw new RangeError(`resolution must be 0 or positive, got ${resolution}`);
  if (!(w > 0 && h > 0)) throw new RangeError(`a reference image needs a positive size, got ${w}x${h}`);
  if (resolution === 0) {
    return [Math.floor(w / SIZE_STEP) * SIZE_STEP, Math.floor(h / SIZE_STEP) * SIZE_STEP];
  }
  const ratio = w / h;
  const newWidth = Math.sqrt(resolution * resolution * ratio);
  const newHeight = newWidth / ratio;
  return [roundHalfEven(newWidth / SIZE_STEP) * SIZE_STEP, roundHalfEven(newHeight / SIZE_STEP) * SIZE_STEP];
}

/** The vision processor's minimum pixels: a padded reference's canvas is grown to at least this. */
export const MIN_VLM_PIXELS = 65536;

/**
 * [width, height] of the canvas a `w x h` image is padded to with the Reference's fit = pad: scaled down (aspect
 * kept, sides floored) only above resolution^2 pixels (0: never), then each side rounded up to x32 and the shorter
 * side grown by 32 until the area reaches MIN_VLM_PIXELS. The same operations as `_padded_reference` in
 * model/encoders/references.py (`canvas.fit_inside`, `canvas.padded_size`).
 */
export function paddedReferenceSize(w, h, resolution) {
  if (!(resolution >= 0)) throw new RangeError(`resolution must be 0 or positive, got ${resolution}`);
  if (!(w > 0 && h > 0)) throw new RangeError(`a reference image needs a positive size, got ${w}x${h}`);
  if (resolution > 0 && w * h > resolution * resolution) {
    const scale = Math.sqrt((resolution * resolution) / (w * h));
    [w, h] = [Math.max(1, Math.floor(w * scale)), Math.max(1, Math.floor(h * scale))];
  }
  let width = Math.ceil(w / SIZE_STEP) * SIZE_STEP;
  let height = Math.ceil(h / SIZE_STEP) * SIZE_STEP;
  while (width * height < MIN_VLM_PIXELS) {
    if (width <= height) width += SIZE_STEP;
    else height += SIZE_STEP;
  }
  return [width, height];
}

/** Latent tokens of an already resized (x32) reference: one per 16 x 16 pixels. */
export function latentTokens(width, height) {
  return Math.floor(height / LATENT_TOKEN_PIXELS) * Math.floor(width / LATENT_TOKEN_PIXELS);
}

/** Estimated prompt tokens for a prompt of `chars` characters (an empty prompt is encoded as one space). */
export function promptTokens(chars) {
  return Math.max(1, Math.ceil(Math.max(0, chars || 0) / CHARS_PER_TOKEN));
}

/**
 * Estimated prefix tokens of one prompt: text (template + prompt + tags per reference) + the latent tokens of
 * each reference. `references` are the RESIZED sizes, `[width, height]` pairs or `{width, height}` objects.
 */
export function prefixTokens(promptChars, references = []) {
  let tokens = TEMPLATE_TOKENS + promptTokens(promptChars);
  for (const ref of references) {
    const [width, height] = Array.isArray(ref) ? ref : [ref.width, ref.height];
    tokens += REFERENCE_TAG_TOKENS + latentTokens(width, height);
  }
  return tokens;
}

/** Bytes per quantized value of the Prefix Cache node's dtypes, and the fp32 scale each stored row carries. */
export const QUANTIZED_BITS = Object.freeze({ int8: 8, int4: 4 });
export const SCALE_BYTES = 4;

/** Cache bytes for `tokens` prefix tokens: 2 * layers * heads * head_dim * tokens * bytes (0.5 MiB/token bf16);
 * `dtype` "int8" / "int4": 2 * layers * tokens * (heads * head_dim * bits / 8 + 4), scales included. */
export function cacheBytes(tokens, model = FULL_MODEL, dtype = "default") {
  const { layers, heads, headDim, bytesPerElement } = { ...FULL_MODEL, ...model };
  const bits = QUANTIZED_BITS[dtype];
  if (bits) return 2 * layers * tokens * ((heads * headDim * bits) / 8 + SCALE_BYTES);
  return 2 * layers * heads * headDim * tokens * bytesPerElement;
}

/**
 * The aspect-ratio presets. One rule for all of them: the size a 1024 x 1024 target would be resized to in that
 * aspect by the reference pipeline's own arithmetic, i.e. `referenceSize(a, b, 1024)` (area ~ 1024^2, sides
 * rounded to multiples of 32). Portrait presets are the landscape ones transposed, as that rule gives.
 */
export const PRESET_RATIOS = Object.freeze([
  [1, 1], [5, 4], [4, 5], [4, 3], [3, 4], [3, 2], [2, 3], [16, 9], [9, 16], [21, 9], [9, 21],
]);
export const CUSTOM_PRESET = "custom";
export const FOLLOW_REFERENCE_PRESET = "follow reference (0x0)";

/** [{label, ratio: [a, b] | null, width, height}] in menu order; "custom" first (width/height untouched). */
export function presetSizes() {
  const presets = [
    { label: CUSTOM_PRESET, ratio: null, width: null, height: null },
    { label: FOLLOW_REFERENCE_PRESET, ratio: null, width: 0, height: 0 },
  ];
  for (const [a, b] of PRESET_RATIOS) {
    const [width, height] = referenceSize(a, b, DEFAULT_RESOLUTION);
    presets.push({ label: `${a}:${b} (${width}x${height})`, ratio: [a, b], width, height });
  }
  return presets;
}

/** The label of the preset that matches width x height exactly, else "custom". */
export function presetFor(width, height) {
  for (const preset of presetSizes()) {
    if (preset.width !== null && preset.width === width && preset.height === height) return preset.label;
  }
  return CUSTOM_PRESET;
}

/** 1234567 -> "1,234,567" (no locale dependence). */
export function formatCount(n) {
  return String(Math.round(n)).replace(/\B(?=(\d{3})+(?!\d))/g, ",");
}

/** Bytes in binary units, one decimal: "512.0 MiB", "4.1 GiB". */
export function formatBytes(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return unit === 0 ? `${value} B` : `${value.toFixed(1)} ${units[unit]}`;
}

/**
 * The whole estimate for one sampler.
 * `prompts`: one entry per prefix the sampler builds (positive, plus negative under true CFG), each
 * `{ promptChars, references: [{ width, height, resolution, fit }] }` where width/height are the SOURCE image size
 * (null when unknown: a square at `resolution`, or 1024 for resolution 0, is assumed).
 * Returns { tokens, bytes, perPrompt: [tokens...], assumed: number of references of unknown size }.
 */
export function estimatePrefix(prompts, model = FULL_MODEL, dtype = "default") {
  let tokens = 0;
  let assumed = 0;
  const perPrompt = [];
  for (const prompt of prompts) {
    const sizes = [];
    for (const ref of (prompt.references || []).slice(0, MAX_REFERENCES)) {
      const resolution = Number.isFinite(ref.resolution) && ref.resolution >= 0 ? ref.resolution : DEFAULT_RESOLUTION;
      let { width, height } = ref;
      if (!(width > 0 && height > 0)) {
        assumed += 1;
        width = height = resolution || DEFAULT_RESOLUTION;
      }
      sizes.push(ref.fit === "pad" ? paddedReferenceSize(width, height, resolution)
        : referenceSize(width, height, resolution));
    }
    const count = prefixTokens(prompt.promptChars || 0, sizes);
    perPrompt.push(count);
    tokens += count;
  }
  return { tokens, bytes: cacheBytes(tokens, model, dtype), perPrompt, assumed, dtype };
}

/** "~8,300 tokens · ~4.1 GiB (bf16)" (or "(int8)" / "(int4)" for a quantized cache); with prefix caching off the
 * cache part says so. */
export function formatEstimate(estimate, { cacheOn = true } = {}) {
  const prefixes = estimate.perPrompt && estimate.perPrompt.length > 1 ? ` (${estimate.perPrompt.length} prompts)` : "";
  const tokens = `~${formatCount(estimate.tokens)} tokens${prefixes}`;
  const stored = QUANTIZED_BITS[estimate.dtype] ? estimate.dtype : "bf16";
  return cacheOn ? `${tokens} · ~${formatBytes(estimate.bytes)} (${stored})` : `${tokens} · cache off`;
}
