"""The pack in the real front end beyond its widgets: the shipped workflows' layout as the front end draws it (sizes
the front end computes, no node over another), and the nodes in Chinese (Comfy.Locale = zh: ComfyUI serves
locales/zh/main.json at /i18n and the front end titles our nodes with it).

Same server, browser and settings as tests/test_comfyui_browser.py (see its docstring); skipped the same way without
ComfyUI, playwright or Chromium. Screenshots go under pytest's tmp_path and QI21_SCREENSHOT_DIR: layout_<workflow>.png
for each workflow, zh_<workflow>.png and zh_sampler.png for the Chinese front end (for readable Chinese the machine
needs a CJK font, e.g. Debian's fonts-wqy-microhei; the DOM checks do not).
"""

import json
import os
import shutil
from pathlib import Path

import pytest

import qi21_comfy_harness as harness  # tests/comfyui/ is on pytest's pythonpath (pyproject.toml)
from test_comfyui_browser import APP_TIMEOUT_MS, CHROMIUM_FLAGS, FIT_VIEW, VIEWPORT, chromium_executable
from test_workflow_layout import UI_FILES, layout, saved_layout

ROOT = Path(__file__).resolve().parents[1]
LOCALE, VUE_NODES = "Comfy.Locale", "Comfy.VueNodes.Enabled"
DEFAULTS = {LOCALE: "en", VUE_NODES: False}  # what an unset setting means
READY = ("() => window.app?.graph && window.LiteGraph?.registered_node_types?.SaveImage "
         "&& window.app.extensionManager?.workflow?.activeWorkflow")
LOAD = "async ([workflow, name]) => { await app.loadGraphData(workflow, true, true, name); }"
SERIALIZED = "() => (app.rootGraph ?? app.graph).serialize()"
#: The title the Vue renderer shows for a node (the DOM, not the canvas), and its widget labels.
VUE_NODE_TEXT = """(id) => {
  const el = document.querySelector(`[data-node-id="${id}"]`);
  return el ? { title: el.querySelector('[data-testid="node-title"]')?.innerText ?? null, text: el.innerText } : null;
}"""


class FrontEnd:
    """One Chromium page on the test server, reopened in a given locale (the setting is the server's, per user)."""

    def __init__(self, page, server, shots: list[Path]):
        self.page, self.server, self.shots = page, server, shots

    def open(self, locale: str) -> None:
        self.server.post_json(f"/settings/{LOCALE}", locale)
        self.page.goto(self.server.url, wait_until="domcontentloaded")
        self.page.wait_for_function(READY, timeout=APP_TIMEOUT_MS)

    def load(self, path: Path) -> None:
        self.page.evaluate(LOAD, [json.loads(path.read_text()), path.name])
        self.page.wait_for_timeout(500)

    def screenshot(self, name: str, clip=None) -> Path:
        target = self.shots[0] / name
        self.page.screenshot(path=str(target), clip=clip)
        for extra in self.shots[1:]:
            shutil.copyfile(target, extra / name)
        return target


@pytest.fixture(scope="module")
def front_end(request, tmp_path_factory):
    harness.configured_comfyui()
    sync_api = pytest.importorskip("playwright.sync_api", reason="the `playwright` package is not installed")
    executable = chromium_executable()
    server = harness.server_for(request)
    shots = [tmp_path_factory.mktemp("qi21_locale_screens")]
    extra_dir = os.environ.get("QI21_SCREENSHOT_DIR", "").strip()
    if extra_dir:
        Path(extra_dir).mkdir(parents=True, exist_ok=True)
        shots.append(Path(extra_dir))
    before = {key: server.get_json(f"/settings/{key}") for key in (LOCALE, VUE_NODES)}
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium_locale_profile")), executable_path=executable, headless=True,
            args=CHROMIUM_FLAGS, viewport=VIEWPORT)
        try:
            yield FrontEnd(context.pages[0] if context.pages else context.new_page(), server, shots)
        finally:
            context.close()
            for key, value in before.items():  # the other browser tests run in English, on the canvas
                server.post_json(f"/settings/{key}", DEFAULTS[key] if value is None else value)


@pytest.mark.parametrize("path", UI_FILES, ids=[p.stem for p in UI_FILES])
def test_the_front_end_draws_the_workflow_as_saved_with_no_overlap(front_end, path):
    if path == UI_FILES[0]:
        front_end.open("en")
    front_end.load(path)
    drawn = front_end.page.evaluate(SERIALIZED)
    saved = {n["id"]: n["size"] for n in json.loads(path.read_text())["nodes"]}
    grown = {n["id"]: (saved[n["id"]], [round(v) for v in n["size"]]) for n in drawn["nodes"]
             if any(round(d) > s for d, s in zip(n["size"], saved[n["id"]]))}
    assert grown == {}, f"{path.name}: the front end drew these nodes larger than saved (saved, drawn): {grown}"
    assert layout.overlaps(*saved_layout(drawn)) == []
    front_end.page.evaluate(FIT_VIEW)
    front_end.page.wait_for_timeout(300)
    front_end.screenshot(f"layout_{path.stem}.png")


def test_a_node_shows_its_chinese_name_in_the_chinese_front_end(front_end):
    zh = json.loads((ROOT / "locales" / "zh" / "main.json").read_text(encoding="utf-8"))["nodeDefs"]
    front_end.open("zh")
    page = front_end.page
    served = page.evaluate("async () => (await (await fetch('/i18n')).json()).zh?.nodeDefs?.QI21Sampler")
    assert served == zh["QI21Sampler"], "ComfyUI does not serve locales/zh/main.json at /i18n"
    path = ROOT / "workflows" / "text_to_image_base.json"
    sampler = next(n["id"] for n in json.loads(path.read_text())["nodes"] if n["type"] == "QI21Sampler")
    page.evaluate(f"async () => app.extensionManager.setting.set('{VUE_NODES}', true)")
    front_end.load(path)
    page.wait_for_function("(id) => document.querySelector(`[data-node-id=\"${id}\"]`)", arg=sampler, timeout=10_000)
    shown = page.evaluate(VUE_NODE_TEXT, sampler)
    assert shown["title"] == zh["QI21Sampler"]["display_name"] == "Qwen-Image 2.1 采样器", shown
    for widget in ("steps", "prefix_cache"):
        assert zh["QI21Sampler"]["inputs"][widget]["name"] in shown["text"], (widget, shown["text"])
    titles = page.evaluate("() => Object.fromEntries((app.rootGraph ?? app.graph)._nodes"
                           ".map((n) => [n.type, n.title]))")
    for node_type in ("QI21ModelLoader", "QI21TextEncode", "QI21VAEDecode"):
        assert titles[node_type] == zh[node_type]["display_name"], titles
    page.evaluate(FIT_VIEW)
    page.wait_for_timeout(500)
    front_end.screenshot("zh_text_to_image_base.png")
    box = page.locator(f'[data-node-id="{sampler}"]').bounding_box()
    pad = 16
    front_end.screenshot("zh_sampler.png", clip={"x": max(0, box["x"] - pad), "y": max(0, box["y"] - pad),
                                                  "width": box["width"] + 2 * pad, "height": box["height"] + 2 * pad})
