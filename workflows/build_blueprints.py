"""Writes the subgraph blueprints in `subgraphs/`: five of the shipped workflows, each wrapped as one node.

    python workflows/build_blueprints.py           write every file
    python workflows/build_blueprints.py --check   exit 1 when a file on disk differs from what this script writes

ComfyUI lists every `custom_nodes/<pack>/subgraphs/*.json` at `/global_subgraphs` (app/subgraph_manager.py) and
its front end shows each in the node library under "Subgraph Blueprints", named after the file. A blueprint is a
UI workflow whose one node is an instance of the subgraph in `definitions.subgraphs`.

Each blueprint is built from the UI workflow in `workflows/` (itself written by build_workflows.py), not from a
second description of the graph: the nodes keep their ids, widget values and download entries; the note, Save
Image and Load Image go; Load Image's IMAGE and MASK become the subgraph's `image` and `mask` inputs, the decoded
IMAGE its output; the prompt, a few sampler settings, the seed and the model files become widgets on the node
(subgraph inputs linked to the inner widgets). Output is deterministic: same workflows, same bytes.
"""

import argparse
import json
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT_FOLDER = ROOT / "subgraphs"

#: Front-end-only nodes and the nodes the blueprint's own inputs and output replace.
DROPPED = {"MarkdownNote", "Note", "SaveImage", "LoadImage"}
#: The model files, always on the node (as core's blueprints show theirs): (node type, widget).
MODEL_FILES = (("QI21ModelLoader", "model_name"), ("QI21TextEncoderLoader", "text_encoder_name"),
               ("QI21VAELoader", "vae_name"))
SAMPLERS = ("QI21Sampler", "QI21TurboSampler")
INPUT_SLOT_HEIGHT = 20  # the front end's spacing of a subgraph input node's slots


@dataclass(frozen=True)
class Blueprint:
    """One blueprint: the workflow it wraps and which inner widgets the node shows.

    `widgets`: (node type, widget name) turned into subgraph inputs, in the node's order after `image`/`mask`;
    the sampler's seed follows them, the model files come last."""
    title: str        # the file name and the name in the node library
    workflow: str     # workflows/<workflow>.json
    category: str     # under "Subgraph Blueprints/", beside core's own blueprints of the same kind
    description: str
    widgets: tuple[tuple[str, str], ...]
    mask_label: str = "mask"


BASE_SIZE = (("QI21Sampler", "width"), ("QI21Sampler", "height"), ("QI21Sampler", "steps"))
BLUEPRINTS = (
    Blueprint("Text to Image (Qwen-Image 2.1 Base)", "text_to_image_base", "Image generation and editing/Text to image",
              "Qwen-Image 2.1 Base: an image from a prompt, 40 steps at cfg 1 (the official settings), the prompt's "
              "keys and values cached after step 1.",
              (("QI21TextEncode", "prompt"), *BASE_SIZE)),
    Blueprint("Text to Image (Qwen-Image 2.1 Turbo)", "text_to_image_turbo",
              "Image generation and editing/Text to image",
              "Qwen-Image 2.1 Turbo: an image from a prompt on Turbo's stored 8-step schedule, no CFG.",
              (("QI21TextEncode", "prompt"), ("QI21TurboSampler", "width"), ("QI21TurboSampler", "height"))),
    Blueprint("Image Edit (Qwen-Image 2.1)", "edit_one_reference", "Image generation and editing/Edit image",
              "Qwen-Image 2.1 Base edits one image as the prompt says (call it <image1>); the output has the "
              "reference's size, resized to about resolution x resolution. A transparent input stays transparent.",
              (("QI21TextEncode", "prompt"), ("QI21Reference", "resolution"), ("QI21Sampler", "steps")),
              mask_label="mask (optional: the image's alpha)"),
    Blueprint("Aligned Edit (Qwen-Image 2.1)", "edit_pixel_aligned",
              "Image generation and editing/Edit image",
              "Qwen-Image 2.1 Base edits one image (<image1>) and returns exactly its width, height and pixel grid: "
              "the reference is padded to a multiple of 32, never resampled, and the decode crops back, so the "
              "result lays over its input.",
              (("QI21TextEncode", "prompt"), ("QI21Sampler", "steps")),
              mask_label="mask (optional: the image's alpha)"),
    Blueprint("Image Inpainting (Qwen-Image 2.1)", "inpaint_with_a_mask", "Image generation and editing/Inpaint image",
              "Qwen-Image 2.1 Base repaints the image where the mask is 1 and keeps the rest exactly; connect Load "
              "Image's MASK (paint it in the mask editor) or any mask of the image's size.",
              (("QI21TextEncode", "prompt"), ("QI21Sampler", "steps"), ("QI21Sampler", "denoise")),
              mask_label="mask (1 = repaint)"),
)


def _uuid(*parts: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "qi21/subgraphs/" + "/".join(parts)))


def _one(nodes: list[dict], node_type: str, workflow: str) -> dict:
    found = [n for n in nodes if n["type"] == node_type]
    if len(found) != 1:
        raise ValueError(f"workflows/{workflow}.json: expected one {node_type} node, found {len(found)}")
    return found[0]


def _slot(node: dict, name: str) -> int:
    return next(i for i, entry in enumerate(node["inputs"]) if entry["name"] == name)


def build(blueprint: Blueprint, workflow: dict) -> dict:
    """The blueprint file's content for one shipped UI workflow."""
    name = blueprint.workflow
    nodes = [json.loads(json.dumps(n)) for n in workflow["nodes"] if n["type"] not in DROPPED]
    by_id = {n["id"]: n for n in nodes}
    dropped = {n["id"]: n for n in workflow["nodes"] if n["type"] in DROPPED}
    links, boundary = [], {"in": [], "out": []}  # boundary: (subgraph slot name, type, link id)
    for link_id, origin, origin_slot, target, target_slot, io_type in workflow["links"]:
        entry = {"id": link_id, "origin_id": origin, "origin_slot": origin_slot, "target_id": target,
                 "target_slot": target_slot, "type": io_type}
        if origin in dropped and target in by_id:  # Load Image's IMAGE / MASK: the subgraph's image / mask
            if dropped[origin]["type"] != "LoadImage":
                raise ValueError(f"workflows/{name}.json: link {link_id} from a {dropped[origin]['type']}")
            boundary["in"].append(("image" if io_type == "IMAGE" else "mask", io_type, link_id))
        elif target in dropped and origin in by_id:  # the decoded image: the subgraph's output
            boundary["out"].append((io_type, io_type, link_id))
        elif origin in dropped or target in dropped:
            raise ValueError(f"workflows/{name}.json: link {link_id} joins two removed nodes")
        links.append(entry)
    if len(boundary["out"]) != 1 or len({n for n, _, _ in boundary["in"]}) != len(boundary["in"]):
        raise ValueError(f"workflows/{name}.json: expected one saved image and at most one Load Image")

    inputs = [(slot_name, io_type, [link_id]) for slot_name, io_type, link_id in boundary["in"]]
    next_link = max(link[0] for link in workflow["links"]) + 1
    sampler = next(n["type"] for n in nodes if n["type"] in SAMPLERS)
    values = {}  # widget input -> the inner widget's value, which the node shows
    for node_type, widget in [*blueprint.widgets, (sampler, "seed"), *MODEL_FILES]:
        node = _one(nodes, node_type, name)
        entry = node["inputs"][_slot(node, widget)]
        if entry.get("widget", {}).get("name") != widget or entry.get("link") is not None:
            raise ValueError(f"workflows/{name}.json: {node_type}.{widget} is not a free widget")
        entry["link"] = next_link
        links.append({"id": next_link, "origin_id": -10, "origin_slot": len(inputs), "target_id": node["id"],
                      "target_slot": _slot(node, widget), "type": entry["type"]})
        inputs.append((widget, entry["type"], [next_link]))
        values[widget] = _value(node, widget)
        next_link += 1
    for index, (_, _, link_ids) in enumerate(inputs):
        for link in links:
            if link["id"] in link_ids:
                link["origin_id"], link["origin_slot"] = -10, index
    (_, out_type, out_link), = boundary["out"]
    for link in links:
        if link["id"] == out_link:
            link["target_id"], link["target_slot"] = -20, 0

    widget_inputs = list(values)
    # the node's widgets are its widget inputs ("-1": the subgraph's own); a promoted inner widget with no input slot
    # (the seed's control_after_generate) is set aside by the 1.49 front end with a warning, so there is none
    proxies = [["-1", w] for w in widget_inputs]

    left = min(n["pos"][0] for n in nodes) - 320
    top = min(n["pos"][1] for n in nodes)
    right = max(n["pos"][0] + n["size"][0] for n in nodes) + 120
    in_height = INPUT_SLOT_HEIGHT * (len(inputs) + 1) + 20
    subgraph_id = _uuid(name, "subgraph")
    outer_id = max(by_id) + 1
    labels = {"mask": blueprint.mask_label}
    subgraph = {
        "id": subgraph_id, "version": 1,
        "state": {"lastGroupId": 0, "lastNodeId": outer_id, "lastLinkId": next_link - 1, "lastRerouteId": 0},
        "revision": 0, "config": {}, "name": blueprint.title,
        "inputNode": {"id": -10, "bounding": [left, top, 180, in_height]},
        "outputNode": {"id": -20, "bounding": [right, top, 120, 60]},
        "inputs": [{"id": _uuid(name, "input", slot_name), "name": slot_name, "type": io_type, "linkIds": link_ids,
                    "localized_name": slot_name, **({"label": labels[slot_name]} if slot_name in labels else {}),
                    "pos": [left + 160, top + 20 + INPUT_SLOT_HEIGHT * i]}
                   for i, (slot_name, io_type, link_ids) in enumerate(inputs)],
        "outputs": [{"id": _uuid(name, "output", out_type), "name": out_type, "type": out_type, "linkIds": [out_link],
                     "localized_name": out_type, "pos": [right + 20, top + 20]}],
        "widgets": [], "nodes": nodes, "groups": [],
        "links": sorted(links, key=lambda link: link["id"]),
        "extra": {}, "category": blueprint.category, "description": blueprint.description,
    }
    outer = {
        "id": outer_id, "type": subgraph_id, "pos": [0, 0], "size": [400, 60 + 26 * (len(proxies) + len(inputs))],
        "flags": {}, "order": 0, "mode": 0,
        "inputs": [{"localized_name": slot_name, "name": slot_name, "type": io_type,
                    **({"label": labels[slot_name]} if slot_name in labels else {}),
                    **({"widget": {"name": slot_name}} if slot_name in widget_inputs else {}), "link": None}
                   for slot_name, io_type, _ in inputs],
        "outputs": [{"localized_name": out_type, "name": out_type, "type": out_type, "links": None}],
        "properties": {"proxyWidgets": proxies},
        "widgets_values": [values[w] for w in widget_inputs],
    }
    return {"id": _uuid(name), "revision": 0, "last_node_id": outer_id, "last_link_id": next_link - 1,
            "nodes": [outer], "links": [], "groups": [], "config": {},
            "extra": {"ds": {"scale": 1, "offset": [0, 0]}}, "version": 0.4,
            "definitions": {"subgraphs": [subgraph]}}


def _value(node: dict, widget: str):
    """A widget's value in a UI node: widgets_values follow the widget inputs in order, a seed's control after it."""
    values = iter(node["widgets_values"])
    for entry in node["inputs"]:
        if "widget" not in entry:
            continue
        value = next(values)
        if entry["name"] == widget:
            return value
        if entry["name"] in ("seed", "noise_seed"):
            next(values)  # control_after_generate
    raise KeyError(widget)


def _dumps(data) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def expected_files(workflows: Path = HERE) -> dict[str, str]:
    """File name -> text of every blueprint, from the UI workflows in `workflows`."""
    return {f"{b.title}.json": _dumps(build(b, json.loads((workflows / f"{b.workflow}.json").read_text("utf-8"))))
            for b in BLUEPRINTS}


def stale(folder: Path = OUT_FOLDER) -> list[str]:
    expected = expected_files()
    problems = [f"{name}: missing" if not (folder / name).is_file() else f"{name}: differs from the builder's output"
                for name, text in expected.items()
                if not (folder / name).is_file() or (folder / name).read_text(encoding="utf-8") != text]
    problems += [f"{p.name}: not written by the builder" for p in sorted(folder.glob("*.json"))
                 if p.name not in expected]
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the files on disk are not up to date")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale()
        for problem in problems:
            print(f"stale: subgraphs/{problem}", file=sys.stderr)
        if problems:
            print("run: python workflows/build_blueprints.py", file=sys.stderr)
        return 1 if problems else 0
    OUT_FOLDER.mkdir(exist_ok=True)
    written = []
    for file_name, text in expected_files().items():
        path = OUT_FOLDER / file_name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            written.append(file_name)
    print("\n".join(f"wrote subgraphs/{name}" for name in written) or "subgraphs are up to date")
    for problem in stale():
        print(f"warning: subgraphs/{problem} (delete it or add it to BLUEPRINTS)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
