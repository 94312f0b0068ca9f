"""The subgraph blueprints in subgraphs/ (workflows/build_blueprints.py writes them), without ComfyUI.

ComfyUI serves `custom_nodes/<pack>/subgraphs/*.json` at /global_subgraphs (app/subgraph_manager.py, 2026-08) and the
front end (1.49) parses each with its workflow schema (validateComfyWorkflow: a 0.4 workflow whose
`definitions.subgraphs` entries are version-1 graphs with uuid ids, an input node -10, an output node -20, inputs and
outputs with uuid ids and link ids), then registers `nodes[0]` as a node whose type must be a subgraph's id. The
checks below read the files: that shape; the inner graph against the node schemas (test_workflows.py's validator, on
the inner graph with a Load Image in place of the image/mask inputs and a Save Image in place of the output); every
link recorded on both ends, the -10/-20 ones included; and the inner nodes equal to the shipped workflow they wrap.
The validator is itself run on broken copies. The real server and front end: tests/test_comfyui_blueprints.py.
"""

import copy
import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

from test_workflows import SIGS, ui_problems

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "subgraphs"
FILES = sorted(FOLDER.glob("*.json"))
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[1-8][0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
INPUT_NODE, OUTPUT_NODE = -10, -20
#: The graphs issue 66 asked for (text to image Base and Turbo, one-reference and pixel-aligned edits, inpainting).
WRAPPED = {"text_to_image_base", "text_to_image_turbo", "edit_one_reference", "edit_pixel_aligned",
           "inpaint_with_a_mask"}


def _load_builder():
    spec = importlib.util.spec_from_file_location("qi21_build_blueprints", ROOT / "workflows" / "build_blueprints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


builder = _load_builder()
WORKFLOW_OF = {f"{b.title}.json": b.workflow for b in builder.BLUEPRINTS}


def read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


# -- the validator ------------------------------------------------------------------------------------------------

def _missing(where: str, data: dict, keys) -> list[str]:
    return [f"{where}: no {key!r}" for key in keys if key not in data]


def shape_problems(blueprint: dict) -> list[str]:
    """What the front end's schema and its blueprint loader require of the file."""
    problems = _missing("file", blueprint, ("last_node_id", "last_link_id", "nodes", "links", "version",
                                            "definitions"))
    if problems:
        return problems
    if blueprint["version"] != 0.4 or blueprint["links"] != [] or len(blueprint["nodes"]) != 1:
        problems.append("file: a 0.4 workflow with one node and no links expected")
    subgraphs = blueprint["definitions"].get("subgraphs") or []
    if len(subgraphs) != 1:
        return problems + [f"file: {len(subgraphs)} subgraph definitions, expected 1"]
    (subgraph,) = subgraphs
    problems += _missing("subgraph", subgraph, ("id", "version", "state", "revision", "name", "inputNode",
                                                "outputNode", "inputs", "outputs", "nodes", "links"))
    if problems:
        return problems
    if not UUID.fullmatch(str(subgraph["id"])) or subgraph["version"] != 1:
        problems.append("subgraph: id must be a uuid and version 1")
    problems += _missing("subgraph state", subgraph["state"], ("lastGroupId", "lastNodeId", "lastLinkId",
                                                               "lastRerouteId"))
    for key, node_id in (("inputNode", INPUT_NODE), ("outputNode", OUTPUT_NODE)):
        box = subgraph[key]
        if box.get("id") != node_id or len(box.get("bounding", ())) != 4:
            problems.append(f"subgraph {key}: id {node_id} and a 4-number bounding expected, got {box}")
    for kind in ("inputs", "outputs"):
        names = [slot.get("name") for slot in subgraph[kind]]
        if len(set(names)) != len(names):
            problems.append(f"subgraph {kind}: duplicate names {names}")
        for slot in subgraph[kind]:
            if not UUID.fullmatch(str(slot.get("id"))) or not slot.get("type") or \
                    not isinstance(slot.get("linkIds"), list):
                problems.append(f"subgraph {kind[:-1]} {slot.get('name')}: needs a uuid id, a type and linkIds")
    outer = blueprint["nodes"][0]
    problems += _missing("node", outer, ("id", "type", "pos", "size", "flags", "order", "mode", "properties"))
    if outer.get("type") != subgraph["id"]:
        problems.append(f"node: type {outer.get('type')!r} is not the subgraph's id (the loader looks it up)")
    if blueprint["last_node_id"] < outer.get("id", 0) or subgraph["state"].get("lastLinkId", 0) < \
            max((link.get("id", 0) for link in subgraph["links"]), default=0):
        problems.append("file: last_node_id / lastLinkId below an id in use")
    return problems


def _widget_target(nodes: dict, link: dict) -> dict | None:
    """The inner input a link ends at (None for the output node or a missing node)."""
    node = nodes.get(link["target_id"])
    if node is None or not 0 <= link["target_slot"] < len(node["inputs"]):
        return None
    return node["inputs"][link["target_slot"]]


def boundary_problems(subgraph: dict, outer: dict) -> list[str]:
    """The subgraph's inputs and output: their links, the inner sockets they feed, the node's mirror of them."""
    problems = []
    nodes = {n["id"]: n for n in subgraph["nodes"]}
    links = {link["id"]: link for link in subgraph["links"]}
    for end, kind, side in ((INPUT_NODE, "inputs", "origin"), (OUTPUT_NODE, "outputs", "target")):
        for index, slot in enumerate(subgraph[kind]):
            expected = sorted(i for i, link in links.items()
                              if link[f"{side}_id"] == end and link[f"{side}_slot"] == index)
            if sorted(slot["linkIds"]) != expected or not expected:
                problems.append(f"subgraph {kind[:-1]} {slot['name']}: linkIds {slot['linkIds']}, links {expected}")
        if stray := [i for i, link in links.items() if link[f"{side}_id"] == end
                     and not 0 <= link[f"{side}_slot"] < len(subgraph[kind])]:
            problems.append(f"subgraph: links {stray} use a {kind[:-1]} slot that does not exist")
    widgets = set()
    for slot in subgraph["inputs"]:
        for link_id in slot["linkIds"]:
            target = links.get(link_id) and _widget_target(nodes, links[link_id])
            if target is None or target.get("type") != slot["type"] or links[link_id]["type"] != slot["type"]:
                problems.append(f"subgraph input {slot['name']}: link {link_id} does not end at a {slot['type']} input")
            elif "widget" in target:
                widgets.add(slot["name"])
    for slot in subgraph["outputs"]:
        for link_id in slot["linkIds"]:
            link = links[link_id]
            origin = nodes.get(link["origin_id"])
            if origin is None or origin["outputs"][link["origin_slot"]]["type"] != slot["type"]:
                problems.append(f"subgraph output {slot['name']}: link {link_id} does not start at a {slot['type']}")

    mirrored = [(i.get("name"), i.get("type"), "widget" in i) for i in outer.get("inputs", [])]
    expected = [(s["name"], s["type"], s["name"] in widgets) for s in subgraph["inputs"]]
    if mirrored != expected:
        problems.append(f"node inputs {mirrored}, the subgraph's are {expected}")
    if [(o.get("name"), o.get("type")) for o in outer.get("outputs", [])] != \
            [(s["name"], s["type"]) for s in subgraph["outputs"]]:
        problems.append("node outputs differ from the subgraph's")
    proxies = outer["properties"].get("proxyWidgets", [])
    if sorted(tuple(p) for p in proxies) != sorted(("-1", w) for w in widgets):
        problems.append(f"node proxyWidgets {proxies}: expected each widget input once, as ['-1', name]")
    elif len(outer.get("widgets_values", [])) != len(proxies):
        problems.append("node widgets_values: one value per proxied widget expected")
    return problems


def as_plain_workflow(subgraph: dict) -> dict:
    """The inner graph as a UI workflow test_workflows.py can check: a Load Image (id 10000) feeds what the image and
    mask inputs fed, a Save Image (10001) takes the output; inputs fed by a widget input keep their own value."""
    nodes = copy.deepcopy(subgraph["nodes"])
    by_id = {n["id"]: n for n in nodes}
    load = {"id": 10000, "type": "LoadImage", "pos": [0, 0], "size": [320, 360], "flags": {}, "order": 0, "mode": 0,
            "inputs": [{"name": "image", "type": "COMBO", "widget": {"name": "image"}, "link": None},
                       {"name": "upload", "type": "IMAGEUPLOAD", "widget": {"name": "upload"}, "link": None}],
            "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": []}, {"name": "MASK", "type": "MASK", "links": []}],
            "properties": {"Node name for S&R": "LoadImage"}, "widgets_values": ["example.png", "image"]}
    save = {"id": 10001, "type": "SaveImage", "pos": [0, 0], "size": [320, 360], "flags": {}, "order": 0, "mode": 0,
            "inputs": [{"name": "images", "type": "IMAGE", "link": None},
                       {"name": "filename_prefix", "type": "STRING", "widget": {"name": "filename_prefix"},
                        "link": None}],
            "outputs": [{"name": "images", "type": "IMAGE", "links": None}],
            "properties": {"Node name for S&R": "SaveImage"}, "widgets_values": ["blueprint"]}
    slots = {slot_index: slot for slot_index, slot in enumerate(subgraph["inputs"])}
    links = []
    for link in subgraph["links"]:
        origin, origin_slot, target, target_slot = (link["origin_id"], link["origin_slot"], link["target_id"],
                                                     link["target_slot"])
        if origin == INPUT_NODE:
            slot = slots.get(origin_slot)
            if slot is None or slot["type"] not in ("IMAGE", "MASK"):
                if target in by_id and 0 <= target_slot < len(by_id[target]["inputs"]):
                    by_id[target]["inputs"][target_slot]["link"] = None  # a widget: its value stays inside
                continue
            origin, origin_slot = load["id"], 0 if slot["type"] == "IMAGE" else 1
            load["outputs"][origin_slot]["links"].append(link["id"])
        if target == OUTPUT_NODE:
            target, target_slot = save["id"], 0
            save["inputs"][0]["link"] = link["id"]
        links.append([link["id"], origin, origin_slot, target, target_slot, link["type"]])
    extra = [n for n in (load, save) if any(link[1] == n["id"] or link[3] == n["id"] for link in links)]
    return {"last_node_id": max([*by_id, *(n["id"] for n in extra)]), "last_link_id": max(link[0] for link in links),
            "nodes": nodes + extra, "links": links, "groups": [], "extra": {}, "version": 0.4}


def sync_problems(subgraph: dict, workflow: dict) -> list[str]:
    """The inner graph is the shipped workflow less its note, Load Image and Save Image: same nodes (ids, types,
    widget values, download entries, places), same links between them, the image links from the same sockets."""
    problems = []
    shipped = {n["id"]: n for n in workflow["nodes"]}
    kept = {n_id for n_id, n in shipped.items() if n["type"] not in builder.DROPPED}
    inner = {n["id"]: n for n in subgraph["nodes"]}
    if set(inner) != kept:
        return [f"inner node ids {sorted(inner)}, the workflow's (less note/load/save) {sorted(kept)}"]
    from_widget_inputs = {link["id"] for link in subgraph["links"] if link["origin_id"] == INPUT_NODE
                          and subgraph["inputs"][link["origin_slot"]]["type"] not in ("IMAGE", "MASK")}
    for node_id, node in inner.items():
        mine = copy.deepcopy(node)
        for entry in mine["inputs"]:
            if entry.get("link") in from_widget_inputs:
                entry["link"] = None
        if mine != shipped[node_id]:
            problems.append(f"node {node_id} {node['type']}: differs from the shipped workflow's")
    ours = {(link["id"], link["origin_id"], link["origin_slot"], link["target_id"], link["target_slot"])
            for link in subgraph["links"] if link["id"] not in from_widget_inputs and link["target_id"] != OUTPUT_NODE
            and link["origin_id"] != INPUT_NODE}
    theirs = {tuple(link[:5]) for link in workflow["links"] if link[1] in kept and link[3] in kept}
    if ours != theirs:
        problems.append(f"links differ: only in the blueprint {sorted(ours - theirs)}, only shipped "
                        f"{sorted(theirs - ours)}")
    loads = {link[0]: link for link in workflow["links"] if shipped[link[1]]["type"] == "LoadImage"}
    for link in subgraph["links"]:
        if link["origin_id"] == INPUT_NODE and link["id"] not in from_widget_inputs:
            original = loads.get(link["id"])
            if original is None or original[3:5] != [link["target_id"], link["target_slot"]]:
                problems.append(f"link {link['id']}: the image/mask input feeds another socket than Load Image did")
    return problems


def blueprint_problems(blueprint: dict, workflow: dict) -> list[str]:
    problems = shape_problems(blueprint)
    if problems:
        return problems
    (subgraph,) = blueprint["definitions"]["subgraphs"]
    unknown = sorted({n["type"] for n in subgraph["nodes"]} - set(SIGS))
    if unknown:
        return [f"inner node types neither the pack's nor core's: {unknown}"]
    problems += [f"inner graph: {p}" for p in ui_problems(as_plain_workflow(subgraph))]
    problems += boundary_problems(subgraph, blueprint["nodes"][0])
    return problems + sync_problems(subgraph, workflow)


# -- the shipped blueprints ---------------------------------------------------------------------------------------

def test_the_pack_ships_the_five_main_graphs_as_blueprints():
    assert {p.name for p in FILES} == set(WORKFLOW_OF) and set(WORKFLOW_OF.values()) == WRAPPED
    for path in FILES:
        blueprint = read(path)
        # the front end names the node after the file; the subgraph's own name says the same
        assert blueprint["definitions"]["subgraphs"][0]["name"] == path.stem
        assert blueprint["definitions"]["subgraphs"][0]["category"].startswith("Image generation and editing/")


#: The front end's node search (Fuse.js, extended search, threshold 0.3, location 0, distance 100) ANDs the typed
#: words and scores each by how far into the name it matches: a word starting past character 30 of the name scores
#: above 0.3 and the whole name, typed in full, finds nothing (seen with "Pixel-Aligned Edit (Qwen-Image 2.1)").
SEARCH_REACH = 30


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_the_name_typed_in_full_finds_the_blueprint(path):
    starts = [m.start() for m in re.finditer(r"\S+", path.stem)]
    assert max(starts) <= SEARCH_REACH, f"{path.stem!r}: a word starts at {max(starts)}; the search cannot find it"


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_blueprint_is_valid_and_is_the_shipped_workflow(path):
    workflow = read(ROOT / "workflows" / f"{WORKFLOW_OF[path.name]}.json")
    assert blueprint_problems(read(path), workflow) == []


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_blueprint_shows_the_prompt_seed_and_model_files_and_outputs_an_image(path):
    (subgraph,) = read(path)["definitions"]["subgraphs"]
    names = [slot["name"] for slot in subgraph["inputs"]]
    assert {"prompt", "seed", "model_name", "text_encoder_name", "vae_name"} <= set(names)
    assert [(s["name"], s["type"]) for s in subgraph["outputs"]] == [("IMAGE", "IMAGE")]
    takes_an_image = not WORKFLOW_OF[path.name].startswith("text_to_image")
    assert (names[:2] == ["image", "mask"]) == takes_an_image and ("image" in names) == takes_an_image


def test_the_files_are_what_the_builder_writes():
    assert builder.stale() == [], "run: python workflows/build_blueprints.py"
    assert builder.main(["--check"]) == 0


def test_check_reports_edited_missing_and_unknown_files(tmp_path):
    copy_of = tmp_path / "subgraphs"
    shutil.copytree(FOLDER, copy_of)
    first, second = FILES[0].name, FILES[1].name
    (copy_of / first).write_text((copy_of / first).read_text().replace('"steps"', '"step"', 1))
    (copy_of / second).unlink()
    (copy_of / "stray.json").write_text("{}")
    assert sorted(builder.stale(copy_of)) == sorted([f"{first}: differs from the builder's output",
                                                     f"{second}: missing", "stray.json: not written by the builder"])


# -- the validator catches broken copies --------------------------------------------------------------------------

def _subgraph(b):
    return b["definitions"]["subgraphs"][0]


def _inner(b, node_type):
    return next(n for n in _subgraph(b)["nodes"] if n["type"] == node_type)


def _link_to(b, node_type, input_name):
    node = _inner(b, node_type)
    link_id = next(i["link"] for i in node["inputs"] if i["name"] == input_name)
    return next(link for link in _subgraph(b)["links"] if link["id"] == link_id)


BREAKAGES = {
    "node type is not the subgraph id": lambda b: b["nodes"][0].update(type="QI21Sampler"),
    "subgraph id not a uuid": lambda b: _subgraph(b).update(id="qi21-edit"),
    "no input node": lambda b: _subgraph(b).pop("inputNode"),
    "input linkIds stale": lambda b: _subgraph(b)["inputs"][0]["linkIds"].append(999),
    "widget input into the wrong slot": lambda b: _link_to(b, "QI21TextEncode", "prompt").update(target_slot=0),
    "output from the latent": lambda b: next(link for link in _subgraph(b)["links"] if link["target_id"] == -20)
    .update(origin_id=_inner(b, "QI21Sampler")["id"]),
    "node type unknown": lambda b: _inner(b, "QI21VAEDecode").update(type="QI21NoSuchDecode"),
    "inner widget value shifted": lambda b: _inner(b, "QI21Sampler")["widgets_values"].insert(2, 7),
    "inner widget value changed": lambda b: _inner(b, "QI21Sampler")["widgets_values"].__setitem__(0, 43),
    "model link cut": lambda b: _subgraph(b)["links"].remove(_link_to(b, "QI21Sampler", "model")),
    "node misses a widget input": lambda b: b["nodes"][0]["inputs"].pop(),
    "a promoted widget with no input": lambda b: b["nodes"][0]["properties"]["proxyWidgets"].append(["5", "cfg"]),
}


@pytest.mark.parametrize("name", BREAKAGES)
def test_the_validator_catches(name):
    path = FOLDER / "Image Edit (Qwen-Image 2.1).json"
    workflow = read(ROOT / "workflows" / f"{WORKFLOW_OF[path.name]}.json")
    broken = read(path)
    BREAKAGES[name](broken)
    assert blueprint_problems(broken, workflow), f"{name}: not caught"
