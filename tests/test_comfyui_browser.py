"""The example UI workflows in ComfyUI's real front end, in headless Chromium driven by Playwright.

Uses the ComfyUI server of tests/test_comfyui_server.py (same settings, same fixture; see its docstring for the
set-up). For each workflow in workflows/ (and example_workflows/): it loads into the app with no missing node,
every node type is registered, the front-end extension (web/qi21.js) adds its "aspect preset", "prefix cache" and
"last run" widgets to the samplers without touching what is saved (widgets_values) or queued (the API prompt equals
workflows/api/<same name>.json), the preset fills width/height, and a screenshot of the graph and of each sampler
is saved; the same widgets in the Vue node renderer ("Modern node design"), the estimate read-only. A shipped
workflow is queued from the page: the sampler shows its phase while it runs and its run report (the `qi21_report`
of /history, formatted by web/qi21_report.js) on the node afterwards, never saved nor queued; a batch shows the
last of its runs, a re-queue that ComfyUI serves from its cache says so; the pixel-aligned edit (fit = pad)
queued from the page saves an image of its input's own size. Skipped when no ComfyUI is configured,
when the `playwright` package is missing, or when no Chromium is installed (the test never downloads a browser).

Test settings besides the server's:
    QI21_CHROMIUM         the Chromium/Chrome executable (default: chromium, chromium-browser, google-chrome on PATH)
    QI21_SCREENSHOT_DIR   also copy the screenshots there (they are always written under pytest's tmp_path)
"""

import io
import json
import os
import re
import shutil
from pathlib import Path

import pytest

import qi21_comfy_harness as harness  # tests/comfyui/ is on pytest's pythonpath (pyproject.toml)

try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
except ImportError:  # no playwright: the browser tests skip (see browser_page)
    PlaywrightTimeout = TimeoutError

UI_FILES = harness.ui_workflows()
PRESET_WIDGET, ESTIMATE_WIDGET, REPORT_WIDGET = "qi21_aspect_preset", "qi21_prefix_estimate", "qi21_run_report"
PRESET_LABEL, ESTIMATE_LABEL, REPORT_LABEL = "aspect preset", "prefix cache", "last run"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1920, "height": 1200}
APP_TIMEOUT_MS = 120_000


@pytest.fixture(scope="session")
def comfyui_server(request) -> harness.ComfyServer:
    """The ComfyUI server shared by tests/test_comfyui_server.py and tests/test_comfyui_browser.py."""
    return harness.server_for(request)

#: Registers a probe extension that records what loadGraphData reports missing (its afterConfigureGraph hook
#: receives the same list the missing-nodes dialog shows).
PROBE = """() => {
  window.__qi21 = { missing: null };
  app.registerExtension({
    name: "qi21.tests.probe",
    async afterConfigureGraph(missing) {
      window.__qi21.missing = (missing || []).map((m) => (typeof m === "string" ? m : m.type));
    },
  });
}"""

LOAD = """async ([workflow, name]) => {
  window.__qi21.missing = null;
  await app.loadGraphData(workflow, true, true, name);
  return window.__qi21.missing;
}"""

#: What the tests read back from the loaded graph.
STATE = """() => {
  const graph = app.rootGraph ?? app.graph;
  return graph._nodes.map((n) => ({
    id: String(n.id), type: n.type, comfyClass: n.comfyClass ?? null,
    widgets: (n.widgets || []).map((w) => ({
      name: w.name, label: w.label ?? null, type: w.type, value: w.value,
      serialize: w.serialize ?? null, optionsSerialize: w.options?.serialize ?? null,
      values: Array.isArray(w.options?.values) ? w.options.values : null,
    })),
  }));
}"""

SET_WIDGET = """([nodeId, name, value]) => {
  const graph = app.rootGraph ?? app.graph;
  const node = graph.getNodeById(Number(nodeId)) ?? graph.getNodeById(nodeId);
  const widget = node.widgets.find((w) => w.name === name);
  if (typeof widget.setValue === "function") widget.setValue(value, { e: undefined, node, canvas: app.canvas });
  else { widget.value = value; widget.callback?.(value, app.canvas, node); }
  return Object.fromEntries(node.widgets.map((w) => [w.name, w.value]));
}"""

FIT_VIEW = """async () => {
  try { await app.extensionManager.command.execute("Comfy.Canvas.FitView"); }
  catch (e) { app.canvas.ds.reset?.(); }
  app.canvas.setDirty(true, true);
  app.canvas.draw?.(true, true);
}"""

#: Centre the canvas on one node at scale 1.2; returns its screen rectangle (title bar included).
FOCUS_NODE = """(nodeId) => {
  const graph = app.rootGraph ?? app.graph;
  const node = graph.getNodeById(Number(nodeId)) ?? graph.getNodeById(nodeId);
  const ds = app.canvas.ds, scale = 1.2, title = LiteGraph.NODE_TITLE_HEIGHT ?? 30;
  const canvasRect = app.canvas.canvas.getBoundingClientRect();
  ds.scale = scale;
  ds.offset[0] = (canvasRect.width / 2) / scale - node.pos[0] - node.size[0] / 2;
  ds.offset[1] = (canvasRect.height / 2) / scale - node.pos[1] - node.size[1] / 2;
  app.canvas.setDirty(true, true);
  app.canvas.draw?.(true, true);
  const x = canvasRect.left + (node.pos[0] + ds.offset[0]) * scale;
  const y = canvasRect.top + (node.pos[1] - title + ds.offset[1]) * scale;
  return { x: x - 12, y: y - 12, width: node.size[0] * scale + 24, height: (node.size[1] + title) * scale + 24 };
}"""


def chromium_executable() -> str:
    wanted = os.environ.get("QI21_CHROMIUM", "").strip()
    candidates = [wanted] if wanted else ["chromium", "chromium-browser", "google-chrome", "google-chrome-stable"]
    for candidate in candidates:
        found = shutil.which(candidate) or (candidate if Path(candidate).is_file() else None)
        if found:
            return found
    pytest.skip(f"no browser: install Debian's chromium (apt-get install chromium) or set QI21_CHROMIUM "
                f"(looked for {', '.join(candidates)})")


@pytest.fixture(scope="module")
def screenshot_dirs(tmp_path_factory) -> list[Path]:
    dirs = [tmp_path_factory.mktemp("qi21_screens")]
    extra = os.environ.get("QI21_SCREENSHOT_DIR", "").strip()
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        dirs.append(Path(extra))
    return dirs


@pytest.fixture(scope="module")
def browser_page(request, tmp_path_factory):
    """The ComfyUI app, ready, in headless Chromium; yields (page, messages the page logged). The server is
    started only once a browser is known to be there."""
    harness.configured_comfyui()
    sync_api = pytest.importorskip("playwright.sync_api", reason="the `playwright` package is not installed "
                                   "(pip install playwright; its browsers are not needed)")
    executable = chromium_executable()
    comfyui_server = request.getfixturevalue("comfyui_server")
    profile = tmp_path_factory.mktemp("chromium_profile")
    messages = []
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=executable, headless=True, args=CHROMIUM_FLAGS, viewport=VIEWPORT)
        try:
            page = context.pages[0] if context.pages else context.new_page()
            page.on("console", lambda m: messages.append(f"console.{m.type}: {m.text}"))
            page.on("pageerror", lambda e: messages.append(f"pageerror: {e}"))
            page.on("response", lambda r: messages.append(f"http {r.status}: {r.url}") if r.status >= 400 else None)
            page.goto(comfyui_server.url, wait_until="domcontentloaded")
            try:
                # ready = nodes registered and the start-up workflow loaded (it would otherwise replace ours)
                page.wait_for_function("() => window.app?.graph && window.LiteGraph?.registered_node_types?.SaveImage "
                                       "&& window.app.extensionManager?.workflow?.activeWorkflow",
                                       timeout=APP_TIMEOUT_MS)
            except PlaywrightTimeout:
                pytest.fail("the ComfyUI front end did not become ready:\n" + "\n".join(messages[-40:]))
            page.evaluate(PROBE)
            yield page, messages
        finally:
            context.close()


def test_the_front_end_registers_our_nodes_and_extension(browser_page):
    page, messages = browser_page
    pack = f"/extensions/{harness.pack_dir_name()}/"
    types = page.evaluate("() => Object.keys(LiteGraph.registered_node_types)")
    for node_id in ("QI21ModelLoader", "QI21TextEncoderLoader", "QI21VAELoader", "QI21Reference", "QI21TextEncode",
                    "QI21Sampler", "QI21TurboSampler", "QI21VAEDecode"):
        assert node_id in types
    names = page.evaluate("() => (app.extensions || []).map((e) => e.name)")
    assert "QwenImage21.SamplerWidgets" in names, "web/qi21.js was not loaded as an extension"
    bad = [m for m in messages if pack in m and m.startswith("http ")]
    assert not bad, bad


def _by_name(node: dict) -> dict:
    return {w["name"]: w for w in node["widgets"]}


#: TextGenerate's `mtp` widget, which ComfyUI added in 0.37 (the prompt enhancer's release) and the official templates
#: set: a front end older than that drops it (its last widget) when it loads the official_* workflows, and keeps
#: everything else as in the files (the `system_prompt` link too).
NEWER_TEXT_GENERATE_WIDGET = "mtp"


def _older_front_end_view(page, workflow: dict, prompt: dict | None) -> tuple[dict, dict | None]:
    """(widget values by node id, API prompt) as this front end keeps them: without TextGenerate's `mtp` where the
    server's TextGenerate has no such input."""
    values = {str(n["id"]): n.get("widgets_values") or [] for n in workflow["nodes"]}
    if not any(n["type"] == "TextGenerate" for n in workflow["nodes"]):
        return values, prompt
    known = page.evaluate("""async () => { const d = (await (await fetch('/object_info/TextGenerate')).json())
        .TextGenerate.input; return [...Object.keys(d.required || {}), ...Object.keys(d.optional || {})]; }""")
    if NEWER_TEXT_GENERATE_WIDGET in known:
        return values, prompt
    prompt = json.loads(json.dumps(prompt)) if prompt is not None else None
    for node in workflow["nodes"]:
        if node["type"] == "TextGenerate":
            values[str(node["id"])] = values[str(node["id"])][:-1]
            if prompt is not None:
                prompt[str(node["id"])]["inputs"].pop(NEWER_TEXT_GENERATE_WIDGET, None)
    return values, prompt


def _api_twin(path: Path) -> Path | None:
    twin = harness.API_WORKFLOW_FOLDER / path.name
    return twin if twin.is_file() else None


@pytest.mark.parametrize("path", UI_FILES or [None], ids=[p.stem for p in UI_FILES] or ["none"])
def test_ui_workflow_loads_with_the_extension_widgets(browser_page, screenshot_dirs, path):
    if path is None:
        pytest.skip("workflows/ holds no UI workflow yet")
    page, messages = browser_page
    first_message = len(messages)
    workflow = json.loads(path.read_text())

    registered = set(page.evaluate("() => Object.keys(LiteGraph.registered_node_types)"))
    unknown = sorted({n["type"] for n in workflow["nodes"]} - registered)
    assert not unknown, f"{path.name}: node types the front end does not know: {unknown}"
    missing = page.evaluate(LOAD, [workflow, path.name])
    assert missing == [], f"{path.name}: the front end reports missing nodes {missing}"
    page.wait_for_timeout(1500)  # the extension refreshes its estimate on a 1 s poll

    nodes = {n["id"]: n for n in page.evaluate(STATE)}
    assert {i: n["type"] for i, n in nodes.items()} == {str(n["id"]): n["type"] for n in workflow["nodes"]}, \
        f"the graph on the canvas is not {path.name}"
    samplers = [n for n in nodes.values() if n["type"] in harness.SAMPLERS]
    assert samplers or not any(n["type"] in harness.SAMPLERS for n in workflow["nodes"])
    for sampler in samplers:
        widgets = _by_name(sampler)
        assert PRESET_WIDGET in widgets and ESTIMATE_WIDGET in widgets and REPORT_WIDGET in widgets, \
            f"{path.name}: node {sampler['id']} lacks the extension's widgets: {list(widgets)}"
        preset, estimate, report = widgets[PRESET_WIDGET], widgets[ESTIMATE_WIDGET], widgets[REPORT_WIDGET]
        assert (preset["label"], preset["type"], estimate["label"], estimate["type"], report["label"]) == \
            (PRESET_LABEL, "combo", ESTIMATE_LABEL, "text", REPORT_LABEL)
        assert [w["name"] for w in sampler["widgets"]][-3:] == [PRESET_WIDGET, ESTIMATE_WIDGET, REPORT_WIDGET], \
            "appended last"
        for widget in (preset, estimate, report):
            assert widget["serialize"] is False and widget["optionsSerialize"] is False, "front-end only"
        assert preset["value"] in preset["values"]
        width, height = widgets["width"]["value"], widgets["height"]["value"]
        assert preset["value"] != "custom" or (width, height) not in _preset_sizes(preset["values"]).values()
        assert "token" in str(estimate["value"]), f"{path.name}: prefix estimate {estimate['value']!r}"

    # what is saved and what is queued are the files' own: the extension adds nothing to either
    saved = page.evaluate("() => (app.rootGraph ?? app.graph).serialize()")
    saved_values = {str(n["id"]): n.get("widgets_values") for n in saved["nodes"]}
    twin = _api_twin(path)
    file_values, expected = _older_front_end_view(page, workflow, json.loads(twin.read_text()) if twin else None)
    for node in workflow["nodes"]:
        assert (saved_values[str(node["id"])] or []) == file_values[str(node["id"])], \
            f"{path.name}: node {node['id']} ({node['type']}) saves other widget values after loading"
    if twin is not None:
        queued = page.evaluate("async () => (await app.graphToPrompt()).output")
        assert {k: (v["class_type"], v["inputs"]) for k, v in queued.items()} == \
            {k: (v["class_type"], v["inputs"]) for k, v in expected.items()}, \
            f"the front end queues {path.name} differently from {twin.relative_to(harness.REPO)}"

    _screenshots(page, screenshot_dirs, path.stem, [s["id"] for s in samplers])

    for sampler in samplers:  # the preset fills width/height; a hand edit shows "custom"
        sizes = _preset_sizes(_by_name(sampler)[PRESET_WIDGET]["values"])
        label, (width, height) = next((k, v) for k, v in sizes.items() if v[0] != v[1])
        values = page.evaluate(SET_WIDGET, [sampler["id"], PRESET_WIDGET, label])
        assert (values["width"], values["height"]) == (width, height), f"preset {label!r} -> {values}"
        values = page.evaluate(SET_WIDGET, [sampler["id"], "width", width + 32])
        page.wait_for_timeout(100)
        assert _by_name(_node(page, sampler["id"]))[PRESET_WIDGET]["value"] == "custom", values

    ours = [m for m in messages[first_message:] if "Qwen-Image 2.1" in m or "qi21" in m.lower()]
    assert not ours, f"{path.name}: the extension logged\n" + "\n".join(ours)
    errors = [m for m in messages[first_message:] if m.startswith("pageerror")]
    assert not errors, "\n".join(errors)


def _node(page, node_id: str) -> dict:
    return next(n for n in page.evaluate(STATE) if n["id"] == node_id)


def _preset_sizes(labels) -> dict:
    """{label: (width, height)} for the labels that name a size, e.g. "16:9 (1376x768)"."""
    sizes = {}
    for label in labels:
        found = re.search(r"(\d+)\s*[x×]\s*(\d+)", str(label))
        if found:
            sizes[label] = (int(found.group(1)), int(found.group(2)))
    return sizes


def _screenshots(page, dirs, stem: str, sampler_ids) -> None:
    page.evaluate(FIT_VIEW)
    page.wait_for_timeout(500)
    shots = [(f"{stem}.png", None)]
    for sampler_id in sampler_ids:
        shots.append((f"{stem}_sampler_{sampler_id}.png", sampler_id))
    for name, sampler_id in shots:
        clip = None
        if sampler_id is not None:
            clip = page.evaluate(FOCUS_NODE, sampler_id)
            page.wait_for_timeout(300)
            clip = {k: max(0, v) for k, v in clip.items()}
        target = dirs[0] / name
        page.screenshot(path=str(target), clip=clip)
        assert target.stat().st_size > 10_000, f"{target}: suspiciously small screenshot"
        for extra in dirs[1:]:
            shutil.copyfile(target, extra / name)


#: Records, after each of ComfyUI's websocket events, what the sampler's report widget shows (the extension's own
#: listeners were registered first, so they have already updated it). Uses the public scripts/api.js.
RECORD_REPORT = """async (nodeId) => {
  const { api } = await import("/scripts/api.js");
  window.__qi21.seen = [];
  window.__qi21.nodeId = nodeId;
  if (window.__qi21.recording) return;
  window.__qi21.recording = true;
  const types = ["promptQueueing", "execution_start", "execution_cached", "executing", "progress", "executed",
                 "execution_success", "execution_error", "execution_interrupted"];
  for (const type of types) {
    api.addEventListener(type, ({ detail }) => {
      const current = (app.rootGraph ?? app.graph).getNodeById(Number(window.__qi21.nodeId));
      const widget = current?.widgets?.find((w) => w.name === "qi21_run_report");
      window.__qi21.seen.push({ type, detail: detail ?? null, shown: widget ? String(widget.value) : null });
    });
  }
}"""

#: What the report widget of a node shows on the page: its text, lines (class, colour), tooltip, box.
REPORT_ON_PAGE = """(nodeId) => {
  const node = (app.rootGraph ?? app.graph).getNodeById(Number(nodeId));
  const widget = node.widgets.find((w) => w.name === "qi21_run_report");
  const el = widget?.element;
  if (!el) return null;
  const box = el.getBoundingClientRect();
  return {
    value: String(widget.value), text: el.innerText, tooltip: el.title, connected: el.isConnected,
    visible: box.width > 0 && box.height > 0 && getComputedStyle(el).visibility !== "hidden",
    lines: [...el.children].map((c) => ({ kind: c.className, text: c.innerText, color: getComputedStyle(c).color })),
  };
}"""

#: The summary web/qi21_report.js makes of the report /history holds for this prompt and node.
HISTORY_SUMMARY = """async ([promptId, nodeId, pack]) => {
  const { reportLine, reportView } = await import(`/extensions/${pack}/qi21_report.js`);
  const history = await (await fetch(`/history/${promptId}`)).json();
  const reports = history[promptId].outputs[nodeId].qi21_report;
  const view = reportView(reports);
  return { reports, view, line: reportLine(view) };
}"""

QUEUE = "async (count) => { await app.queuePrompt(0, count); }"

#: Base sampler, shrunk to run in seconds on a CPU; cfg 2 without a negative prompt makes the sampler add a note.
RUN_WIDGETS = {"steps": 4, "width": 256, "height": 256, "cfg": 2.0}


def _wait_for_report(page, node_id: str, pattern: str, runs: int = 1,
                     timeout_ms: int = harness.PROMPT_TIMEOUT_S * 1000) -> None:
    """Wait until `runs` queued prompts have ended, then check that the node's report widget matches `pattern`."""
    try:
        page.wait_for_function(
            """(runs) => window.__qi21.seen.filter((e) => ["execution_success", "execution_error",
              "execution_interrupted"].includes(e.type)).length >= runs""", arg=runs, timeout=timeout_ms)
    except PlaywrightTimeout:
        seen = page.evaluate("() => window.__qi21.seen")
        pytest.fail(f"{runs} prompt(s) did not end in time; events and what the node showed: {seen[-20:]}")
    shown = page.evaluate(REPORT_ON_PAGE, node_id)
    if not (shown and re.search(pattern, shown["value"])):
        seen = page.evaluate("() => window.__qi21.seen")
        pytest.fail(f"the sampler's report {shown and shown['value']!r} does not match {pattern!r}; events and what "
                    f"it showed: {seen[-20:]}")


def test_run_report_on_the_sampler_node(browser_page, screenshot_dirs):
    """Queue workflows/text_to_image_base.json from the page: phases while it runs, the report after it."""
    page, messages = browser_page
    first_message = len(messages)
    path = harness.REPO / "workflows" / "text_to_image_base.json"
    workflow = json.loads(path.read_text())
    setting = "Comfy.VueNodes.Enabled"
    vue_before = page.evaluate(f"() => app.extensionManager.setting.get('{setting}')")
    page.evaluate(f"async () => app.extensionManager.setting.set('{setting}', false)")  # the canvas renderer
    try:
        assert page.evaluate(LOAD, [workflow, f"run_{path.name}"]) == []
        sampler_id = next(str(n["id"]) for n in workflow["nodes"] if n["type"] == "QI21Sampler")
        before = page.evaluate(REPORT_ON_PAGE, sampler_id)
        assert before and before["text"] == "no run yet: the run report shows here", before
        for name, value in RUN_WIDGETS.items():
            assert page.evaluate(SET_WIDGET, [sampler_id, name, value])[name] == value
        page.evaluate(RECORD_REPORT, sampler_id)

        page.evaluate(QUEUE, 1)
        _wait_for_report(page, sampler_id, "prefix tokens")
        seen = page.evaluate("() => window.__qi21.seen")
        # Queueing cleared the node; while the sampler ran it showed its phase, step 1 the prefill.
        assert seen[0]["type"] == "promptQueueing" and seen[0]["shown"].startswith("queued"), seen[:3]
        starts = [e for e in seen if e["type"] == "executing" and e["detail"] == sampler_id]
        assert starts and starts[0]["shown"] == "step 1/4 · prefill: prompt and references into the cache", starts
        progress = {e["detail"]["value"]: e["shown"] for e in seen
                    if e["type"] == "progress" and str(e["detail"].get("node")) == sampler_id}
        assert progress.get(1) == "step 2/4 · cached step: image rows only", progress
        assert progress.get(4) == "4 steps done: finishing", progress
        prompt_id = next(e["detail"]["prompt_id"] for e in seen if e["type"] == "execution_start")

        # The report on the node is /history's qi21_report, formatted; the note is marked; nothing is saved.
        history = page.evaluate(HISTORY_SUMMARY, [prompt_id, sampler_id, harness.pack_dir_name()])
        (report,) = history["reports"]
        assert report["cache"] == "miss" and report["steps"] == 4
        shown = page.evaluate(REPORT_ON_PAGE, sampler_id)
        assert shown["connected"] and shown["visible"], shown
        summary = history["view"]["summary"]
        assert re.fullmatch(r"cache miss · \d[\d,]* prefix tokens · [\d.]+ KiB on cpu · prefill [\d.]+ m?s · "
                            r"step [\d.]+ m?s", summary), summary
        assert shown["value"] == history["line"] == f"{summary} · ⚠ 1 note"  # the widget's one-line value
        note = "⚠ cfg 2.0 ignored: true CFG needs a negative prompt"
        assert [line["text"] for line in shown["lines"]] == [summary, note]
        assert shown["lines"][1]["kind"] == "qi21-report-warning"
        assert shown["lines"][1]["color"] != shown["lines"][0]["color"], "the note is not marked"
        assert shown["tooltip"] == history["view"]["tooltip"] and "prefix cache: miss" in shown["tooltip"]
        page.wait_for_timeout(300)
        clip = {k: max(0, v) for k, v in page.evaluate(FOCUS_NODE, sampler_id).items()}
        page.wait_for_timeout(300)
        target = screenshot_dirs[0] / "report_on_node.png"
        page.screenshot(path=str(target), clip=clip)
        for extra in screenshot_dirs[1:]:
            shutil.copyfile(target, extra / target.name)
        assert page.evaluate(REPORT_ON_PAGE, sampler_id)["text"] == shown["text"], "a redraw lost the report"

        saved = json.dumps(page.evaluate("() => (app.rootGraph ?? app.graph).serialize()"))
        queued = json.dumps(page.evaluate("async () => (await app.graphToPrompt())"))
        for text in ("prefix tokens", "qi21_run_report", "qi21_report", "cache miss"):
            assert text not in saved and text not in queued, f"{text!r} reached the saved workflow or the prompt"

        # A batch of two with new seeds (the seed widget counts up after each queued prompt): both run, the node
        # shows the last and how many ran.
        seed = 1000
        page.evaluate(SET_WIDGET, [sampler_id, "seed", seed])
        page.evaluate(SET_WIDGET, [sampler_id, "control_after_generate", "increment"])
        page.evaluate(RECORD_REPORT, sampler_id)
        page.evaluate(QUEUE, 2)
        _wait_for_report(page, sampler_id, "^last of 2 runs: cache miss · ", runs=2)
        seen = page.evaluate("() => window.__qi21.seen")
        assert [e["shown"] for e in seen if e["type"] == "promptQueueing"] == \
            ["queued: the run report shows here after the run"]
        # The last prompt again: ComfyUI serves it from its cache (no run, no report), and the node says so.
        page.evaluate(SET_WIDGET, [sampler_id, "control_after_generate", "fixed"])
        page.evaluate(SET_WIDGET, [sampler_id, "seed", seed + 1])
        page.evaluate(RECORD_REPORT, sampler_id)
        page.evaluate(QUEUE, 1)
        _wait_for_report(page, sampler_id, r"^not re-run \(ComfyUI cache\) · cache miss · ")
        seen = page.evaluate("() => window.__qi21.seen")
        cached = next(e for e in seen if e["type"] == "execution_cached")
        assert sampler_id in cached["detail"]["nodes"] and "the sampler did not run" in \
            page.evaluate(REPORT_ON_PAGE, sampler_id)["tooltip"]
    finally:
        page.evaluate(f"async (value) => app.extensionManager.setting.set('{setting}', value)", vue_before)
    ours = [m for m in messages[first_message:] if "Qwen-Image 2.1" in m or m.startswith("pageerror")]
    assert not ours, "\n".join(ours)


def test_the_pixel_aligned_edit_queued_from_the_page_keeps_the_input_s_size(browser_page, comfyui_server):
    """workflows/edit_pixel_aligned.json (Reference fit = pad, sampler width/height 0) queued from the page on a
    270x262 picture: the report has the crop box and the saved image is 270x262 (the API run of the same workflow is
    in tests/test_comfyui_server.py)."""
    import numpy as np
    from PIL import Image

    page, _ = browser_page
    workflow = json.loads((harness.REPO / "workflows" / "edit_pixel_aligned.json").read_text())
    ids = {n["type"]: str(n["id"]) for n in workflow["nodes"]}
    picture = "qi21_pad_270x262_from_the_page.png"
    pixels = np.random.default_rng(5959).integers(0, 256, (262, 270, 3), dtype=np.uint8)
    Image.fromarray(pixels, "RGB").save(comfyui_server.base / "input" / picture)
    assert page.evaluate(LOAD, [workflow, "run_edit_pixel_aligned.json"]) == []
    assert page.evaluate(SET_WIDGET, [ids["LoadImage"], "image", picture])["image"] == picture
    steps = RUN_WIDGETS["steps"]  # only the steps: width/height stay 0, the size the Reference pads to
    assert page.evaluate(SET_WIDGET, [ids["QI21Sampler"], "steps", steps])["steps"] == steps
    page.evaluate(RECORD_REPORT, ids["QI21Sampler"])

    page.evaluate(QUEUE, 1)
    _wait_for_report(page, ids["QI21Sampler"], "prefix tokens")
    prompt_id = next(e["detail"]["prompt_id"] for e in page.evaluate("() => window.__qi21.seen")
                     if e["type"] == "execution_start")
    entry = comfyui_server.get_json(f"/history/{prompt_id}")[prompt_id]
    assert entry["status"]["status_str"] == "success", entry["status"]
    (report,) = page.evaluate(HISTORY_SUMMARY, [prompt_id, ids["QI21Sampler"], harness.pack_dir_name()])["reports"]
    assert report.get("crop") == {"box": [0, 0, 270, 262], "canvas": [288, 288]} and report["steps"] == steps, report
    (image,) = entry["outputs"][ids["SaveImage"]]["images"]
    assert Image.open(io.BytesIO(comfyui_server.view(image))).size == (270, 262)


#: The sampler nodes' widgets as the Vue renderer draws them: {node id: {"preset": aria label found,
#: "estimate": [value, readOnly] or null}}.
VUE_WIDGETS = """(ids) => Object.fromEntries(ids.map((id) => {
  const el = document.querySelector(`[data-node-id="${id}"]`);
  const preset = el?.querySelector('[role="combobox"][aria-label="aspect preset"]');
  const estimate = el?.querySelector('input[aria-label="qi21_prefix_estimate"]');
  const report = el?.querySelector('.qi21-run-report');
  return [id, { found: !!el, preset: !!preset, estimate: estimate ? [estimate.value, estimate.readOnly] : null,
                report: report ? report.innerText : null }];
}))"""


@pytest.fixture(scope="module")
def vue_nodes(browser_page):
    page, _ = browser_page
    setting = "Comfy.VueNodes.Enabled"
    before = page.evaluate(f"() => app.extensionManager.setting.get('{setting}')")
    page.evaluate(f"async () => app.extensionManager.setting.set('{setting}', true)")
    yield page
    page.evaluate(f"async (value) => app.extensionManager.setting.set('{setting}', value)", before)


@pytest.mark.parametrize("path", UI_FILES or [None], ids=[p.stem for p in UI_FILES] or ["none"])
def test_ui_workflow_widgets_in_the_vue_node_renderer(vue_nodes, browser_page, screenshot_dirs, path):
    if path is None:
        pytest.skip("workflows/ holds no UI workflow yet")
    page, messages = browser_page
    first_message = len(messages)
    workflow = json.loads(path.read_text())
    assert page.evaluate(LOAD, [workflow, f"vue_{path.name}"]) == []
    samplers = [str(n["id"]) for n in workflow["nodes"] if n["type"] in harness.SAMPLERS]
    try:
        page.wait_for_function("(ids) => ids.every((id) => document.querySelector(`[data-node-id='${id}'] "
                               "input[aria-label='qi21_prefix_estimate']`)?.value)", arg=samplers, timeout=10_000)
    except PlaywrightTimeout:
        pass  # what was found is reported below
    found = page.evaluate(VUE_WIDGETS, samplers)
    for node_id, widgets in found.items():
        assert widgets["found"], f"{path.name}: sampler {node_id} is not drawn as a Vue node"
        assert widgets["preset"], f"{path.name}: sampler {node_id} shows no 'aspect preset' combo: {widgets}"
        assert widgets["estimate"] and "token" in widgets["estimate"][0], f"{path.name}: {widgets}"
        assert widgets["estimate"][1] is True, f"{path.name}: the prefix estimate is editable in the Vue renderer"
        assert widgets["report"] and "run report" in widgets["report"], f"{path.name}: no run report box: {widgets}"
    page.evaluate(FIT_VIEW)
    page.wait_for_timeout(500)
    target = screenshot_dirs[0] / f"{path.stem}_vue.png"
    page.screenshot(path=str(target))
    for extra in screenshot_dirs[1:]:
        shutil.copyfile(target, extra / target.name)
    errors = [m for m in messages[first_message:] if m.startswith("pageerror") or "Qwen-Image 2.1" in m]
    assert not errors, "\n".join(errors)


def test_the_missing_node_probe_catches_an_unknown_node(browser_page):
    """The check above can fail: a node type nobody registered is reported by the same hook."""
    if not UI_FILES:
        pytest.skip("workflows/ holds no UI workflow yet")
    page, _ = browser_page
    workflow = json.loads(UI_FILES[0].read_text())
    workflow["nodes"][0]["type"] = "QI21NoSuchNode"
    missing = page.evaluate(LOAD, [workflow, "probe_check.json"])
    page.keyboard.press("Escape")
    assert missing == ["QI21NoSuchNode"]
