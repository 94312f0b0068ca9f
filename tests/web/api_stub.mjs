// Stand-in for ComfyUI's `scripts/api.js` shim (which re-exports window.comfyAPI.api.api, the websocket client).
// The test copies it to <sandbox>/scripts/api.js; the driver puts a fake api (an EventTarget) on globalThis.
export const api = globalThis.__QI21_TEST_API__;
