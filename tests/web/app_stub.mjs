// Stand-in for ComfyUI's `scripts/app.js` shim (which re-exports window.comfyAPI.app.app).
// The test copies it to <sandbox>/scripts/app.js so `import { app } from "../../scripts/app.js"` resolves
// from <sandbox>/extensions/<pack>/qi21.js. The driver puts the fake app on globalThis before importing.
export const app = globalThis.__QI21_TEST_APP__;
