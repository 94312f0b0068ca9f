// Settings of the pack in ComfyUI's settings panel (registered by qi21.js through the extension's `settings`).
// The front end saves them in the user's comfy.settings.json under ComfyUI's user folder; the server side reads
// that file (nodes/bridge.py, `user_setting`) before each sampler run, so a change applies to the next run.

export const KEPT_CACHE_BUDGET_SETTING = "QI21.KeptCacheBudgetGiB";

export const SETTINGS = [
  {
    id: KEPT_CACHE_BUDGET_SETTING,
    category: ["Qwen-Image 2.1", "Prefix cache", "Kept caches ceiling"],
    name: "Kept prefix caches: ceiling (GiB, 0 = none)",
    tooltip:
      "The most memory the prefix caches kept between runs (the samplers' keep_cache) may hold together. When a " +
      "new kept cache would go over it, the least recently used ones are evicted and the sampler's report says " +
      "so. 0 (default): no ceiling of its own; the memory plan still bounds them by what is free beside each run.",
    type: "number",
    defaultValue: 0,
    attrs: { min: 0, max: 1024, step: 0.25 },
  },
];
