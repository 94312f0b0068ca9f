"""The subgraph blueprints (subgraphs/*.json) in a real ComfyUI and its front end.

The server lists each at /global_subgraphs as this pack's (app/subgraph_manager.py) and serves the file at
/global_subgraphs/<id>. In headless Chromium (the page of tests/test_comfyui_browser.py): each is in the front end's
node library (category, description, inputs, the file's name) and in the node search; picked there, it lands on an
empty canvas as one subgraph node with the file's widget values; a Load Image (for the edits and inpainting) and a
Save Image are wired to it; what the page queues is the shipped API workflow the blueprint wraps (node for node, the
inner ids prefixed with the subgraph node's); then shrunk to seconds on a CPU (256 x 256 or the input's size, 3
steps) it runs from the page and saves an image of the expected size. Screenshots: blueprint_search.png and
blueprint_<name>.png under pytest's tmp_path and QI21_SCREENSHOT_DIR.

Same server, browser and settings as tests/test_comfyui_browser.py (see its docstring); skipped the same way without
ComfyUI, playwright or Chromium.
"""

import importlib.util
import io
import json
import shutil
from pathlib import Path

import pytest

import qi21_comfy_harness as harness  # tests/comfyui/ is on pytest's pythonpath (pyproject.toml)
from test_comfyui_browser import (  # noqa: F401  (its fixtures: the tests ask for them through `request`)
    FIT_VIEW,
    LOAD,
    PlaywrightTimeout,
    browser_page,
    comfyui_server,
    screenshot_dirs,
)

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted((ROOT / "subgraphs").glob("*.json"))
NODE_LIBRARY = "Subgraph Blueprints"
EMPTY = {"last_node_id": 0, "last_link_id": 0, "nodes": [], "links": [], "groups": [], "config": {}, "extra": {},
         "version": 0.4}
#: The picture the edits and the inpainting load, written into input/ before this module's page opens (so the front
#: end lists it): 320x256 RGBA with a transparent square (Load Image's MASK is 1 there: inpainting has something to
#: repaint).
PICTURE, PICTURE_SIZE = "qi21_blueprint_input.png", (320, 256)
#: Widget values that make each run take seconds on a CPU (only those the blueprint has).
SMALL = {"width": harness.SMALL_SIDE, "height": harness.SMALL_SIDE, "steps": harness.SMALL_STEPS,
         "resolution": harness.SMALL_REFERENCE_RESOLUTION}


def _blueprints_builder():
    spec = importlib.util.spec_from_file_location("qi21_build_blueprints", ROOT / "workflows" / "build_blueprints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: blueprint file name -> the shipped workflow it wraps
WORKFLOW_OF = {f"{b.title}.json": b.workflow for b in _blueprints_builder().BLUEPRINTS}


# -- the server ------------------------------------------------------------------------------------------------

def _ours(server) -> dict:
    return {k: v for k, v in server.get_json("/global_subgraphs").items() if v.get("source") == "custom_node"
            and v.get("info", {}).get("node_pack") == f"custom_nodes.{harness.pack_dir_name()}"}


def test_the_server_lists_the_pack_s_blueprints(request):
    server = request.getfixturevalue("comfyui_server")
    listed = _ours(server)
    assert sorted(entry["name"] for entry in listed.values()) == sorted(p.stem for p in FILES), listed
    assert all("data" not in entry and "path" not in entry for entry in listed.values()), "the list is names only"
    for entry_id, entry in listed.items():
        served = server.get_json(f"/global_subgraphs/{entry_id}")
        assert served["data"] == (ROOT / "subgraphs" / f"{entry['name']}.json").read_text(encoding="utf-8")


# -- the front end ---------------------------------------------------------------------------------------------

#: The front end's node definitions of the global blueprints (its subgraph store, through the app's Pinia).
LIBRARY = """() => {
  const pinia = document.querySelector('#vue-app').__vue_app__.config.globalProperties.$pinia;
  return pinia._s.get('subgraph').subgraphBlueprints.map((d) => ({
    name: d.name, display_name: d.display_name, category: d.category, description: d.description,
    inputs: Object.keys(d.inputs || {}), outputs: (d.outputs || []).map((o) => o.type), isGlobal: d.isGlobal ?? null,
  }));
}"""

#: The node the search put on the canvas: its type, title, widgets, inputs and outputs.
ADDED = """() => (app.rootGraph ?? app.graph)._nodes.map((n) => ({
  id: String(n.id), type: n.type, title: n.title, subgraph: !!n.subgraph,
  inner: n.subgraph ? n.subgraph._nodes.map((m) => [String(m.id), m.type]).sort() : null,
  widgets: Object.fromEntries((n.widgets || []).map((w) => [w.name, w.value])),
  inputs: n.inputs.map((i) => i.name), outputs: n.outputs.map((o) => o.type),
}))"""

#: Save Image on the blueprint's output, and a Load Image on its image and mask inputs when it has them.
WIRE = """(picture) => {
  const graph = app.rootGraph ?? app.graph;
  const node = graph._nodes[0];
  const save = LiteGraph.createNode("SaveImage");
  save.pos = [node.pos[0] + node.size[0] + 80, node.pos[1]];
  graph.add(save);
  node.connect(0, save, 0);
  let load = null;
  if (node.inputs.some((i) => i.name === "image")) {
    load = LiteGraph.createNode("LoadImage");
    load.pos = [node.pos[0] - 400, node.pos[1]];
    graph.add(load);
    load.widgets.find((w) => w.name === "image").value = picture;
    load.connect(0, node, node.inputs.findIndex((i) => i.name === "image"));
    load.connect(1, node, node.inputs.findIndex((i) => i.name === "mask"));
  }
  app.canvas.setDirty(true, true);
  return { node: String(node.id), save: String(save.id), load: load && String(load.id) };
}"""

SET_WIDGETS = """([nodeId, values]) => {
  const node = (app.rootGraph ?? app.graph).getNodeById(Number(nodeId));
  for (const [name, value] of Object.entries(values)) node.widgets.find((w) => w.name === name).value = value;
}"""

RECORD = """async () => {
  const { api } = await import("/scripts/api.js");
  window.__qi21bp = [];
  if (window.__qi21bpListening) return;
  window.__qi21bpListening = true;
  for (const type of ["execution_start", "execution_success", "execution_error", "execution_interrupted"])
    api.addEventListener(type, ({ detail }) => window.__qi21bp.push({ type, prompt_id: detail?.prompt_id }));
}"""


@pytest.fixture(scope="module", autouse=True)
def blueprint_picture(request) -> None:
    """Runs before the module's page opens (autouse fixtures come first)."""
    import numpy as np
    from PIL import Image

    server = request.getfixturevalue("comfyui_server")
    width, height = PICTURE_SIZE
    pixels = np.zeros((height, width, 4), np.uint8)
    pixels[..., 0], pixels[..., 1], pixels[..., 3] = 200, np.linspace(0, 255, width, dtype=np.uint8), 255
    pixels[64:192, 96:224, 3] = 0
    Image.fromarray(pixels, "RGBA").save(server.base / "input" / PICTURE)


def _screenshot(page, dirs: list[Path], name: str) -> None:
    page.screenshot(path=str(dirs[0] / name))
    for extra in dirs[1:]:
        shutil.copyfile(dirs[0] / name, extra / name)


def _library(page) -> dict:
    return {d["display_name"]: d for d in page.evaluate(LIBRARY) if d["isGlobal"]}


def test_the_node_library_lists_each_blueprint(request):
    page, _ = request.getfixturevalue("browser_page")
    library = _library(page)
    for path in FILES:
        (subgraph,) = json.loads(path.read_text())["definitions"]["subgraphs"]
        entry = library.get(path.stem)
        assert entry, f"{path.name} is not in the front end's node library: {sorted(library)}"
        assert entry["category"] == f"{NODE_LIBRARY}/{subgraph['category']}"
        assert entry["description"] == subgraph["description"]
        assert entry["inputs"] == [slot["name"] for slot in subgraph["inputs"]]
        assert entry["outputs"] == [slot["type"] for slot in subgraph["outputs"]]


def _add_from_the_search(page, title: str, shots: list[Path] | None = None) -> None:
    """Double-click the empty canvas, type the blueprint's name into the node search, take the first result."""
    page.evaluate(LOAD, [EMPTY, f"blueprint {title}"])
    page.keyboard.press("Escape")
    page.wait_for_timeout(500)
    box = page.locator("canvas#graph-canvas").bounding_box()
    page.mouse.dblclick(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    try:
        page.wait_for_function("() => document.activeElement?.tagName === 'INPUT' "
                               "&& document.activeElement.closest('[role=dialog]')", timeout=10_000)
    except PlaywrightTimeout:
        pytest.fail("double-clicking the canvas did not open the node search")
    page.keyboard.insert_text(title)
    first = page.locator("[role=dialog] [data-testid=result-item]").first
    try:
        first.wait_for(timeout=10_000)
        page.wait_for_function("(title) => document.querySelector('[role=dialog] [data-testid=result-item]')"
                               "?.innerText.split('\\n')[0] === title", arg=title, timeout=10_000)
    except PlaywrightTimeout:
        pytest.fail(f"the node search does not offer {title!r} first: "
                    f"{page.locator('[role=dialog] [data-testid=result-item]').all_inner_texts()[:3]}")
    if shots:
        _screenshot(page, shots, "blueprint_search.png")
    page.keyboard.press("Enter")
    page.wait_for_function("() => (app.rootGraph ?? app.graph)._nodes.length === 1", timeout=10_000)


def _api_twin_as_queued(twin: dict, outer: str, ids: dict, picture: str) -> dict:
    """The shipped API workflow as the page queues its blueprint: the inner nodes as "<outer>:<id>", Load Image and
    Save Image as the nodes the test added."""
    renamed = {}
    for node_id, node in twin.items():
        if node["class_type"] == "LoadImage":
            renamed[ids["load"]] = {"class_type": "LoadImage", "inputs": {**node["inputs"], "image": picture}}
            continue
        if node["class_type"] == "SaveImage":
            renamed[ids["save"]] = {"class_type": "SaveImage",
                                    "inputs": {**node["inputs"], "filename_prefix": "ComfyUI"}}
            continue
        renamed[f"{outer}:{node_id}"] = {"class_type": node["class_type"], "inputs": dict(node["inputs"])}
    load_ids = {k for k, v in twin.items() if v["class_type"] == "LoadImage"}
    for node in renamed.values():
        for name, value in node["inputs"].items():
            if isinstance(value, list) and len(value) == 2:
                node["inputs"][name] = [ids["load"] if value[0] in load_ids else f"{outer}:{value[0]}", value[1]]
    return renamed


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_blueprint_from_the_node_search_queues_the_shipped_graph_and_runs(request, path):
    import numpy as np
    from PIL import Image

    page, messages = request.getfixturevalue("browser_page")
    server = request.getfixturevalue("comfyui_server")
    shots = request.getfixturevalue("screenshot_dirs")
    first_message = len(messages)
    blueprint = json.loads(path.read_text())
    (subgraph,) = blueprint["definitions"]["subgraphs"]

    _add_from_the_search(page, path.stem, shots if path == FILES[0] else None)
    (added,) = page.evaluate(ADDED)
    # an instance of the blueprint's graph (the front end gives each copy a subgraph id of its own)
    assert added["subgraph"] and added["title"] == path.stem, added
    assert added["inner"] == sorted([str(n["id"]), n["type"]] for n in subgraph["nodes"]), added["inner"]
    assert added["outputs"] == ["IMAGE"]
    widget_inputs = [name for _, name in blueprint["nodes"][0]["properties"]["proxyWidgets"]]
    assert added["widgets"] == dict(zip(widget_inputs, blueprint["nodes"][0]["widgets_values"])), \
        "the node on the canvas does not show the blueprint's widget values"

    ids = page.evaluate(WIRE, PICTURE)
    twin = json.loads((harness.API_WORKFLOW_FOLDER / f"{WORKFLOW_OF[path.name]}.json").read_text())
    queued = page.evaluate("async () => (await app.graphToPrompt()).output")
    assert {k: (v["class_type"], v["inputs"]) for k, v in queued.items()} == \
        {k: (v["class_type"], v["inputs"]) for k, v in _api_twin_as_queued(twin, ids["node"], ids, PICTURE).items()}, \
        f"the page queues {path.name} differently from workflows/api/{WORKFLOW_OF[path.name]}.json"

    small = {name: value for name, value in SMALL.items() if name in added["widgets"]}
    page.evaluate(SET_WIDGETS, [ids["node"], small])
    page.evaluate(RECORD)
    page.evaluate("async () => { await app.queuePrompt(0, 1); }")
    try:
        page.wait_for_function("() => window.__qi21bp.some((e) => e.type !== 'execution_start')",
                               timeout=harness.PROMPT_TIMEOUT_S * 1000)
    except PlaywrightTimeout:
        pytest.fail(f"{path.name}: the prompt did not end in time.\n{server.log_tail()}")
    events = page.evaluate("() => window.__qi21bp")
    prompt_id = next(e["prompt_id"] for e in events if e["type"] == "execution_start")
    entry = server.get_json(f"/history/{prompt_id}")[prompt_id]
    assert entry["status"]["status_str"] == "success", f"{path.name}: {entry['status']}\n{server.log_tail()}"
    (image,) = entry["outputs"][ids["save"]]["images"]
    saved = Image.open(io.BytesIO(server.view(image)))
    expected = PICTURE_SIZE if "image" in added["inputs"] else (SMALL["width"], SMALL["height"])
    assert saved.size == expected, f"{path.name}: saved {saved.size}, expected {expected}"
    assert np.asarray(saved.convert("RGB")).std() > 0, f"{path.name}: a flat image"

    page.evaluate(FIT_VIEW)
    page.wait_for_timeout(300)
    _screenshot(page, shots, f"blueprint_{WORKFLOW_OF[path.name]}.png")
    errors = [m for m in messages[first_message:] if m.startswith("pageerror") or "Qwen-Image 2.1" in m]
    assert not errors, "\n".join(errors)
