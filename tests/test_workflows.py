"""The shipped example workflows against the node schemas, in both forms, without ComfyUI.

`workflows/*.json` are UI (LiteGraph) workflows: the front end matches `widgets_values` by position and links by
slot index, so a wrong count, an out-of-order value or a link into the wrong slot loads without complaint and
then runs with the wrong settings or fails on the server. `workflows/api/*.json` are what POST /prompt takes.
The validators below read the files, not the builder: they derive what each node must look like from
`define_schema()` (our nodes) or from CORE below (ComfyUI's), report every problem they find, and are
themselves tested on broken copies (`test_the_validators_catch_*`) so a check that can no longer fail is noticed.
"""

import copy
import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

from published_files import PUBLISHED, download_url
from qi21.nodes import NODES
from qi21.nodes.validation import widget_option

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "workflows"
UI_FILES = sorted(FOLDER.glob("*.json"))
API_FILES = sorted((FOLDER / "api").glob("*.json"))
NAMES = [p.stem for p in UI_FILES]

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
SEED_CONTROLS = {"fixed", "increment", "decrement", "randomize"}
#: Model-file combos list the user's model folders (empty here), so the examples must use published file names:
#: the bf16 files of the official repackage (tests/published_files.py) and its LoRAs.
RELEASED_FILES = {
    "model_name": {"qwen_image_2.1_bf16.safetensors", "qwen_image_2.1_turbo_bf16.safetensors",
                   "qwen_image_2.1_int8_convrot.safetensors", "qwen_image_2.1_turbo_int8_convrot.safetensors"},
    "text_encoder_name": {"qwen3vl_8b_bf16.safetensors", "qwen3vl_8b_int8_convrot.safetensors"},
    "clip_name": {"qwen3.5_9b_qwen_image_2.1_pe_t2i.int8_convrot.safetensors",  # the prompt enhancers
                  "qwen3.5_9b_qwen_image_2.1_pe_i2i.int8_convrot.safetensors"},
    "vae_name": {"qwen_image_2.1_vae_bf16.safetensors"},
    "lora_name": set(PUBLISHED["loras"]),
    "control_net_name": set(PUBLISHED["model_patches"]),
}
TURBO_FILES = {"qwen_image_2.1_turbo_bf16.safetensors", "qwen_image_2.1_turbo_int8_convrot.safetensors"}
#: The counterparts of the official templates (workflows/official_*.json): the templates' int8 files, which the tiny
#: model set does not hold, and the templates' own prompts (which name no <imageN>).
OFFICIAL = {"official_t2i", "official_image_edit", "official_background_removal", "official_turbo_t2i",
            "official_turbo_image_edit"}
NOTES = {"Note", "MarkdownNote"}


def _load_builder():
    spec = importlib.util.spec_from_file_location("qi21_build_workflows", FOLDER / "build_workflows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


builder = _load_builder()


# -- what each node type must look like ------------------------------------------------------------------------

class Sig:
    """A node type's serialised shape: sockets {name: (type, optional)}, widgets [(name, type, rule)] in
    widgets_values order, outputs [(name, type)]. `rule(value)` returns an error or None."""

    def __init__(self, display_name, sockets=(), widgets=(), outputs=(), note=False):
        self.display_name, self.note = display_name, note
        self.sockets = {name: (io_type, optional) for name, io_type, optional in sockets}
        self.widgets, self.outputs = list(widgets), list(outputs)

    def ui_input_names(self) -> list[str]:
        """The front end's slot order: link sockets first, then one socket per widget (notes have none)."""
        return [] if self.note else [*self.sockets, *(name for name, _, _ in self.widgets if name is not None)]


def _number_rule(io_type, lo, hi, step):
    def rule(value):
        if isinstance(value, bool) or not isinstance(value, int if io_type == "INT" else (int, float)):
            return f"{value!r} is not {io_type}"
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            return f"{value!r} outside [{lo}, {hi}]"
        if io_type == "INT" and step and (value - (lo or 0)) % step:
            return f"{value!r} is not on the step {step} grid"
        return None
    return rule


def _widget_rule(schema_input):
    io_type, name = schema_input.io_type, schema_input.id
    if io_type in ("INT", "FLOAT"):
        return _number_rule(io_type, widget_option(schema_input, "min"), widget_option(schema_input, "max"),
                            widget_option(schema_input, "step"))
    if io_type == "STRING":
        return lambda v: None if isinstance(v, str) else f"{v!r} is not a string"
    if io_type == "BOOLEAN":
        return lambda v: None if isinstance(v, bool) else f"{v!r} is not a boolean"
    allowed = RELEASED_FILES.get(name) or set(widget_option(schema_input, "options") or ())
    return lambda v: None if v in allowed else f"{v!r} is not one of {sorted(allowed)}"


def our_sig(node_class) -> Sig:
    schema = node_class.define_schema()
    inputs = [i for i in schema.inputs if not i.optional] + [i for i in schema.inputs if i.optional]
    widgets = []
    for i in inputs:
        if i.io_type in WIDGET_TYPES:
            widgets.append((i.id, i.io_type, _widget_rule(i)))
            if widget_option(i, "control_after_generate"):
                widgets.append((None, "CONTROL", lambda v: None if v in SEED_CONTROLS else f"{v!r} not a control"))
    return Sig(schema.display_name,
               sockets=[(i.id, i.io_type, bool(i.optional)) for i in inputs if i.io_type not in WIDGET_TYPES],
               widgets=widgets, outputs=[(o.display_name or o.io_type, o.io_type) for o in schema.outputs])


_any_string = lambda v: None if isinstance(v, str) else f"{v!r} is not a string"  # noqa: E731
_boolean = lambda v: None if isinstance(v, bool) else f"{v!r} is not a boolean"  # noqa: E731


def _one_of(allowed):
    return lambda v: None if v in allowed else f"{v!r} is not one of {sorted(allowed)}"


_png = lambda v: None if isinstance(v, str) and v.endswith(".png") else f"{v!r} is not an image file name"  # noqa: E731

#: ComfyUI core nodes the examples may use, as nodes.py / comfy_extras/nodes_mask.py define them (checked by
#: hand against ComfyUI at 783545f, 2026-08); Note and MarkdownNote are front-end only and never reach the API.
CORE = {
    "LoadImage": Sig("Load Image", widgets=[("image", "COMBO", _png),
                                            ("upload", "IMAGEUPLOAD", lambda v: None if v == "image" else repr(v))],
                     outputs=[("IMAGE", "IMAGE"), ("MASK", "MASK")]),
    "SaveImage": Sig("Save Image", sockets=[("images", "IMAGE", False)],
                     widgets=[("filename_prefix", "STRING", _any_string)], outputs=[("images", "IMAGE")]),
    "PreviewImage": Sig("Preview Image", sockets=[("images", "IMAGE", False)], outputs=[("images", "IMAGE")]),
    "MaskPreview": Sig("Preview Mask", sockets=[("mask", "MASK", False)], outputs=[("mask", "MASK")]),
    "Note": Sig("Note", widgets=[("text", "STRING", _any_string)], note=True),
    "MarkdownNote": Sig("Markdown Note", widgets=[("text", "STRING", _any_string)], note=True),
    "SetLatentNoiseMask": Sig("Set Latent Noise Mask", sockets=[("samples", "LATENT", False), ("mask", "MASK", False)],
                              outputs=[("LATENT", "LATENT")]),
    "ManualSigmas": Sig("ManualSigmas", widgets=[("sigmas", "STRING", _any_string)], outputs=[("SIGMAS", "SIGMAS")]),
    "Canny": Sig("Detect Edges (Canny)", sockets=[("image", "IMAGE", False)],
                 widgets=[("low_threshold", "FLOAT", _number_rule("FLOAT", 0.01, 0.99, 0.01)),
                          ("high_threshold", "FLOAT", _number_rule("FLOAT", 0.01, 0.99, 0.01))],
                 outputs=[("IMAGE", "IMAGE")]),
    # the official templates' prompt-enhancer step (TextGenerate as of ComfyUI 0.37: system_prompt, mtp, thinking)
    "CLIPLoader": Sig("Load CLIP", widgets=[("clip_name", "COMBO", _one_of(RELEASED_FILES["clip_name"])),
                                            ("type", "COMBO", _one_of({"stable_diffusion", "qwen_image"})),
                                            ("device", "COMBO", _one_of({"default", "cpu"}))],
                      outputs=[("CLIP", "CLIP")]),
    "TextGenerate": Sig("Generate Text",
                        sockets=[("clip", "CLIP", False), ("image", "IMAGE", True), ("video", "IMAGE", True),
                                 ("audio", "AUDIO", True), ("system_prompt", "STRING", True)],
                        widgets=[("prompt", "STRING", _any_string),
                                 ("max_length", "INT", _number_rule("INT", 1, 32768, 1)),
                                 ("sampling_mode", "COMBO", _one_of({"on", "off"})),
                                 ("sampling_mode.temperature", "FLOAT", _number_rule("FLOAT", 0.01, 2.0, None)),
                                 ("sampling_mode.top_k", "INT", _number_rule("INT", 0, 1000, 1)),
                                 ("sampling_mode.top_p", "FLOAT", _number_rule("FLOAT", 0.0, 1.0, None)),
                                 ("sampling_mode.min_p", "FLOAT", _number_rule("FLOAT", 0.0, 1.0, None)),
                                 ("sampling_mode.repetition_penalty", "FLOAT", _number_rule("FLOAT", 0.0, 5.0, None)),
                                 ("sampling_mode.seed", "INT", _number_rule("INT", 0, None, 1)),
                                 ("sampling_mode.presence_penalty", "FLOAT", _number_rule("FLOAT", 0.0, 5.0, None)),
                                 ("thinking", "BOOLEAN", _boolean), ("use_default_template", "BOOLEAN", _boolean),
                                 ("mtp", "COMBO", _one_of({"auto"}))],
                        outputs=[("generated_text", "STRING"), ("thinking", "STRING")]),
    "ComfySwitchNode": Sig("If/Else Switch", sockets=[("on_false", "STRING", True), ("on_true", "STRING", True)],
                           widgets=[("switch", "BOOLEAN", _boolean)], outputs=[("output", "STRING")]),
    "PrimitiveStringMultiline": Sig("Text (Multiline)", widgets=[("value", "STRING", _any_string)],
                                    outputs=[("STRING", "STRING")]),
    "PreviewAny": Sig("Preview as Text", sockets=[("source", "*", False)], outputs=[("STRING", "STRING")]),
    "KSamplerSelect": Sig("KSamplerSelect", widgets=[("sampler_name", "COMBO", _one_of({"euler"}))],
                          outputs=[("SAMPLER", "SAMPLER")]),
    "ImageBatch": Sig("Batch Images", sockets=[("image1", "IMAGE", False), ("image2", "IMAGE", False)],
                      outputs=[("IMAGE", "IMAGE")]),
}
UI_ONLY_WIDGETS = {("LoadImage", "upload")}  # a button; its value is saved in the UI form only
SIGS = {**CORE, **{n.define_schema().node_id: our_sig(n) for n in NODES}}


# -- validators: each returns a list of problems -----------------------------------------------------------------

def _check_value(where, rule, value, problems):
    if (error := rule(value)) is not None:
        problems.append(f"{where}: {error}")


def ui_widget_values(node) -> dict:
    """Widget values by name from a UI node (control values and UI-only widgets left out)."""
    sig = SIGS[node["type"]]
    return {name: value for (name, _, _), value in zip(sig.widgets, node["widgets_values"])
            if name is not None and (node["type"], name) not in UI_ONLY_WIDGETS}


def ui_problems(workflow: dict) -> list[str]:
    problems = []
    for key in ("last_node_id", "last_link_id", "nodes", "links", "groups", "extra", "version"):
        if key not in workflow:
            problems.append(f"workflow: no {key!r}")
    if problems:
        return problems
    if workflow["version"] != 0.4:
        problems.append(f"workflow: version {workflow['version']!r}, the front end writes 0.4")
    nodes = {}
    for node in workflow["nodes"]:
        if node["id"] in nodes:
            problems.append(f"node {node['id']}: duplicate id")
        nodes[node["id"]] = node
    links = {}
    for link in workflow["links"]:
        if len(link) != 6 or link[0] in links:
            problems.append(f"link {link}: not [id, origin, slot, target, slot, type] or a duplicate id")
            continue
        links[link[0]] = link
    if nodes and workflow["last_node_id"] < max(nodes):
        problems.append("workflow: last_node_id below a node id (the front end would reuse ids)")
    if links and workflow["last_link_id"] < max(links):
        problems.append("workflow: last_link_id below a link id")

    for node in nodes.values():
        where = f"node {node.get('id')} {node.get('type')}"
        missing = {"id", "type", "pos", "size", "flags", "order", "mode", "inputs", "outputs", "properties",
                   "widgets_values"} - node.keys()
        if missing:
            problems.append(f"{where}: no {sorted(missing)}")
            continue
        sig = SIGS.get(node["type"])
        if sig is None:
            problems.append(f"{where}: unknown node type")
            continue
        if not sig.note and node["properties"].get("Node name for S&R") != node["type"]:
            problems.append(f"{where}: properties['Node name for S&R'] is not the type")
        if node["mode"] != 0:
            problems.append(f"{where}: mode {node['mode']} (muted or bypassed)")

        names = [i.get("name") for i in node["inputs"]]
        if names != sig.ui_input_names():
            problems.append(f"{where}: inputs {names}, expected {sig.ui_input_names()}")
        widget_types = {name: io_type for name, io_type, _ in sig.widgets}
        for slot, entry in enumerate(node["inputs"]):
            name = entry.get("name")
            expected = sig.sockets.get(name, (widget_types.get(name),))[0]
            if entry.get("type") != expected:
                problems.append(f"{where}: input {name} has type {entry.get('type')}, expected {expected}")
            if (name in widget_types) != ("widget" in entry) or entry.get("widget", {"name": name})["name"] != name:
                problems.append(f"{where}: input {name} widget marker wrong")
            link_id = entry.get("link")
            if link_id is not None and (link_id not in links or links[link_id][3:5] != [node["id"], slot]):
                problems.append(f"{where}: input {name} points at link {link_id}, which does not end here")
        for name, (_, optional) in sig.sockets.items():
            linked = any(i.get("name") == name and i.get("link") is not None for i in node["inputs"])
            if not optional and not linked:
                problems.append(f"{where}: required input {name} is not connected")

        outputs = [(o.get("name"), o.get("type")) for o in node["outputs"]]
        if outputs != sig.outputs:
            problems.append(f"{where}: outputs {outputs}, expected {sig.outputs}")
        for slot, output in enumerate(node["outputs"]):
            for link_id in output.get("links") or ():
                if link_id not in links or links[link_id][1:3] != [node["id"], slot]:
                    problems.append(f"{where}: output {output.get('name')} lists link {link_id}, which does not "
                                    "start here")

        values = node["widgets_values"]
        if len(values) != len(sig.widgets):
            problems.append(f"{where}: {len(values)} widget values, expected {len(sig.widgets)} "
                            f"({[name or 'control_after_generate' for name, _, _ in sig.widgets]})")
        else:
            for (name, _, rule), value in zip(sig.widgets, values):
                _check_value(f"{where}.{name or 'control_after_generate'}", rule, value, problems)

    for link_id, (_, origin, origin_slot, target, target_slot, io_type) in links.items():
        where = f"link {link_id}"
        if origin not in nodes or target not in nodes:
            problems.append(f"{where}: joins a missing node ({origin} -> {target})")
            continue
        outs, ins = nodes[origin]["outputs"], nodes[target]["inputs"]
        if not (0 <= origin_slot < len(outs)) or not (0 <= target_slot < len(ins)):
            problems.append(f"{where}: slot out of range ({origin}:{origin_slot} -> {target}:{target_slot})")
            continue
        out_type, in_entry = outs[origin_slot].get("type"), ins[target_slot]
        target_sig = SIGS.get(nodes[target]["type"])
        widget_types = {name: t for name, t, _ in target_sig.widgets} if target_sig else {}
        schema_type = target_sig and target_sig.sockets.get(in_entry.get("name"),
                                                            (widget_types.get(in_entry.get("name")),))[0]
        takes_any = schema_type == "*" == in_entry.get("type")  # PreviewAny's source takes any type
        if not (out_type == io_type and (takes_any or io_type == in_entry.get("type") == schema_type)):
            problems.append(f"{where}: types disagree: output {out_type}, link {io_type}, input "
                            f"{in_entry.get('name')} {in_entry.get('type')} (schema {schema_type})")
        if in_entry.get("link") != link_id or link_id not in (outs[origin_slot].get("links") or ()):
            problems.append(f"{where}: not recorded on both ends")
    return problems


def api_problems(prompt: dict) -> list[str]:
    problems = []
    for node_id, node in prompt.items():
        where = f"api node {node_id} {node.get('class_type')}"
        if not node_id.isdigit() or {"inputs", "class_type", "_meta"} - node.keys():
            problems.append(f"{where}: needs a numeric id, inputs, class_type and _meta")
            continue
        sig = SIGS.get(node["class_type"])
        if sig is None or sig.note:
            problems.append(f"{where}: not a node the server knows")
            continue
        inputs = node["inputs"]
        widgets = {name: rule for name, _, rule in sig.widgets
                   if name is not None and (node["class_type"], name) not in UI_ONLY_WIDGETS}
        if unknown := set(inputs) - set(sig.sockets) - set(widgets):
            problems.append(f"{where}: unknown inputs {sorted(unknown)}")
        for name, rule in widgets.items():
            if name not in inputs:
                problems.append(f"{where}: widget {name} has no value")
            elif isinstance(inputs[name], list):  # a widget fed by a link (the enhanced prompt): a STRING link
                value = inputs[name]
                source = prompt.get(value[0]) if len(value) == 2 and isinstance(value[0], str) else None
                source_sig = source and SIGS.get(source.get("class_type"))
                widget_type = next(t for n, t, _ in sig.widgets if n == name)
                if source_sig is None or not 0 <= value[1] < len(source_sig.outputs) \
                        or source_sig.outputs[value[1]][1] != widget_type:
                    problems.append(f"{where}: widget {name} is linked to {value!r}, not a {widget_type} output")
            else:
                _check_value(f"{where}.{name}", rule, inputs[name], problems)
        for name, (io_type, optional) in sig.sockets.items():
            if name not in inputs:
                if not optional:
                    problems.append(f"{where}: required input {name} is not connected")
                continue
            value = inputs[name]
            if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
                    and isinstance(value[1], int)):
                problems.append(f"{where}: input {name} is {value!r}, not a link [node id, slot]")
                continue
            source = prompt.get(value[0])
            source_sig = source and SIGS.get(source.get("class_type"))
            if source_sig is None or source_sig.note:
                problems.append(f"{where}: input {name} links to missing node {value[0]}")
            elif not 0 <= value[1] < len(source_sig.outputs):
                problems.append(f"{where}: input {name} links to slot {value[1]} of {source['class_type']}")
            elif io_type != "*" and source_sig.outputs[value[1]][1] != io_type:
                problems.append(f"{where}: input {name} ({io_type}) fed by {source_sig.outputs[value[1]][1]}")
    return problems


def pair_problems(workflow: dict, prompt: dict) -> list[str]:
    """The API form must be the UI form's graph: same nodes less notes, widget values, links and titles."""
    problems = []
    ui_nodes = {str(n["id"]): n for n in workflow["nodes"] if not SIGS[n["type"]].note}
    if set(ui_nodes) != set(prompt):
        return [f"node ids differ: UI {sorted(ui_nodes)} vs API {sorted(prompt)}"]
    for node_id, node in ui_nodes.items():
        api = prompt[node_id]
        where = f"node {node_id} {node['type']}"
        if api["class_type"] != node["type"]:
            problems.append(f"{where}: API class_type {api['class_type']}")
            continue
        api_widgets = {k: v for k, v in api["inputs"].items() if not isinstance(v, list)}
        linked = {i["name"] for i in node["inputs"] if "widget" in i and i.get("link") is not None}
        ui_values = {k: v for k, v in ui_widget_values(node).items() if k not in linked}
        if api_widgets != ui_values:
            problems.append(f"{where}: widget values differ: UI {ui_values} vs API {api_widgets}")
        title = node.get("title") or SIGS[node["type"]].display_name
        if api["_meta"].get("title") != title:
            problems.append(f"{where}: API title {api['_meta'].get('title')!r}, UI {title!r}")

    def api_edges():
        return {(v[0], v[1], node_id, name) for node_id, node in prompt.items()
                for name, v in node["inputs"].items() if isinstance(v, list)}

    def ui_edges():
        by_id = {n["id"]: n for n in workflow["nodes"]}
        return {(str(origin), origin_slot, str(target), by_id[target]["inputs"][target_slot]["name"])
                for _, origin, origin_slot, target, target_slot, _ in workflow["links"]}
    if api_edges() != ui_edges():
        problems.append(f"links differ: only UI {sorted(ui_edges() - api_edges())}, "
                        f"only API {sorted(api_edges() - ui_edges())}")
    return problems


def read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def ui(name: str) -> dict:
    return read(FOLDER / f"{name}.json")


def api(name: str) -> dict:
    return read(FOLDER / "api" / f"{name}.json")


def nodes_of(workflow: dict, node_type: str) -> list[dict]:
    return [n for n in workflow["nodes"] if n["type"] == node_type]


def source_of(workflow: dict, node: dict, input_name: str) -> tuple[dict, int] | None:
    """(origin node, origin slot) feeding `input_name` of `node` in a UI workflow."""
    link_id = next(i["link"] for i in node["inputs"] if i["name"] == input_name)
    if link_id is None:
        return None
    link = next(link for link in workflow["links"] if link[0] == link_id)
    return next(n for n in workflow["nodes"] if n["id"] == link[1]), link[2]


# -- the shipped files -------------------------------------------------------------------------------------------

def test_the_examples_come_in_both_forms_in_their_folders():
    """UI files at the top of workflows/ (the folder ComfyUI's template browser lists: `<pack>/workflows/*.json`),
    API files in workflows/api/ (not listed: an API prompt would not load as a workflow)."""
    assert NAMES == sorted(builder.WORKFLOWS) and len(NAMES) == 18
    assert [p.stem for p in API_FILES] == NAMES
    assert all("nodes" in read(p) and "links" in read(p) for p in UI_FILES)
    assert all(all("class_type" in node for node in read(p).values()) for p in API_FILES)


@pytest.mark.parametrize("name", NAMES)
def test_ui_workflow_matches_the_schemas(name):
    assert ui_problems(ui(name)) == []


@pytest.mark.parametrize("name", NAMES)
def test_api_workflow_matches_the_schemas(name):
    assert api_problems(api(name)) == []


@pytest.mark.parametrize("name", NAMES)
def test_the_api_form_is_the_ui_graph(name):
    assert pair_problems(ui(name), api(name)) == []


@pytest.mark.parametrize("name", NAMES)
def test_every_example_loads_the_design_files_decodes_saves_and_explains_itself(name):
    workflow = ui(name)
    for loader, widget in (("QI21ModelLoader", "model_name"), ("QI21TextEncoderLoader", "text_encoder_name"),
                           ("QI21VAELoader", "vae_name")):
        (node,) = nodes_of(workflow, loader)
        assert ui_widget_values(node)[widget] in RELEASED_FILES[widget], (name, loader)
    saves = nodes_of(workflow, "SaveImage")
    assert saves and all(source_of(workflow, s, "images")[0]["type"] == "QI21VAEDecode" for s in saves)
    notes = [n for n in workflow["nodes"] if n["type"] in NOTES]
    assert len(notes) == 1 and len(notes[0]["widgets_values"][0]) > 100


@pytest.mark.parametrize("name", NAMES)
def test_each_sampler_gets_the_model_it_was_made_for(name):
    workflow = ui(name)
    for sampler in nodes_of(workflow, "QI21Sampler") + nodes_of(workflow, "QI21TurboSampler"):
        source = source_of(workflow, sampler, "model")[0]
        while source["type"] in ("QI21LoraLoader", "QI21ControlNetApply"):  # a LoRA / control passes the model on
            source = source_of(workflow, source, "model")[0]
        model_file = ui_widget_values(source)["model_name"]
        assert (model_file in TURBO_FILES) == (sampler["type"] == "QI21TurboSampler"), name


def _chain_length(workflow, node) -> int:
    source = source_of(workflow, node, "references")
    return 0 if source is None else 1 + _chain_length(workflow, source[0])


@pytest.mark.parametrize("name", [name for name in NAMES if name not in OFFICIAL])  # the templates name no images
def test_prompts_name_only_references_in_their_chain(name):
    workflow = ui(name)
    for encode in nodes_of(workflow, "QI21TextEncode"):
        mentioned = {int(n) for n in re.findall(r"<image(\d+)>", ui_widget_values(encode)["prompt"])}
        assert mentioned == set(range(1, _chain_length(workflow, encode) + 1)), name


def test_the_edit_examples_follow_their_references():
    for name, count in (("edit_one_reference", 1), ("edit_three_references", 3), ("edit_pixel_aligned", 1)):
        workflow = ui(name)
        sampler = nodes_of(workflow, "QI21Sampler")[0]
        assert _chain_length(workflow, source_of(workflow, sampler, "positive")[0]) == count
        assert ui_widget_values(sampler)["width"] == ui_widget_values(sampler)["height"] == 0
        for reference in nodes_of(workflow, "QI21Reference"):  # alpha travels with the image
            image, mask = source_of(workflow, reference, "image"), source_of(workflow, reference, "mask")
            assert image[0] is mask[0] and (image[1], mask[1]) == (0, 1)


def test_the_base_examples_use_the_official_settings():
    sampler = nodes_of(ui("text_to_image_base"), "QI21Sampler")[0]
    values = ui_widget_values(sampler)
    assert (values["steps"], values["cfg"], values["width"], values["height"]) == (40, 1.0, 1024, 1024)
    assert nodes_of(ui("text_to_image_turbo"), "QI21TurboSampler")


def test_the_transparent_example_saves_the_four_channel_output_and_shows_rgb_and_mask():
    workflow = ui("transparent_rgba_png")
    decode_outputs = [o["name"] for o in nodes_of(workflow, "QI21VAEDecode")[0]["outputs"]]
    fed = {n["type"]: decode_outputs[source_of(workflow, n, n["inputs"][0]["name"])[1]]
           for n in workflow["nodes"] if n["type"] in ("SaveImage", "PreviewImage", "MaskPreview")}
    assert fed == {"SaveImage": "RGBA", "PreviewImage": "IMAGE", "MaskPreview": "MASK"}


def test_the_readme_names_every_example_image():
    readme = (FOLDER / "README.md").read_text(encoding="utf-8")
    images = {v["inputs"]["image"] for p in API_FILES for v in read(p).values() if v["class_type"] == "LoadImage"}
    assert images and all(f"`{image}`" in readme for image in images)


# -- the builder --------------------------------------------------------------------------------------------------

def test_the_files_are_what_the_builder_writes():
    assert builder.stale() == [], "run: python workflows/build_workflows.py"
    assert builder.main(["--check"]) == 0


def test_the_builder_is_deterministic():
    assert builder.expected_files() == builder.expected_files()


def test_check_reports_edited_missing_and_unknown_files(tmp_path):
    copy_of = tmp_path / "workflows"
    shutil.copytree(FOLDER, copy_of)
    edited = copy_of / "api" / "text_to_image_base.json"
    edited.write_text(edited.read_text().replace('"steps": 40', '"steps": 41'))
    (copy_of / "edit_one_reference.json").unlink()
    (copy_of / "stray.json").write_text("{}")
    assert sorted(builder.stale(copy_of)) == ["api/text_to_image_base.json: differs from the builder's output",
                                              "edit_one_reference.json: missing",
                                              "stray.json: not written by the builder"]


# -- the contract the saved files rely on ---------------------------------------------------------------------------

#: Widget order as shipped (the node contract). Saved workflows match widgets by position, so these may only be
#: appended to; a reordered or removed widget silently shifts every saved value after it.
SHIPPED_WIDGETS = {
    "QI21ModelLoader": ["model_name", "weight_dtype", "attention"],
    "QI21TextEncoderLoader": ["text_encoder_name", "weight_dtype", "device"],
    "QI21VAELoader": ["vae_name", "weight_dtype"],
    "QI21Reference": ["resolution"],
    "QI21TextEncode": ["prompt"],
    "QI21Sampler": ["seed", None, "steps", "cfg", "width", "height", "batch_size", "prefix_cache", "keep_cache"],
    "QI21TurboSampler": ["seed", None, "width", "height", "batch_size", "prefix_cache", "keep_cache"],
    "QI21VAEDecode": ["tiled"],
}


@pytest.mark.parametrize("node_type", sorted(SHIPPED_WIDGETS))
def test_widgets_are_only_ever_appended(node_type):
    live = [name for name, _, _ in SIGS[node_type].widgets]
    assert live[:len(SHIPPED_WIDGETS[node_type])] == SHIPPED_WIDGETS[node_type]


def test_the_builder_and_the_validators_agree_on_every_node_shape():
    """The builder derives shapes itself (spec_from_schema); the validators derive them independently."""
    for node_type, spec in builder.load_specs().items():
        sig = SIGS[node_type]
        assert [p.name for p in spec.sockets] == list(sig.sockets), node_type
        assert [(w.name, w.io_type) for w in spec.widgets] == [(n, t) for n, t, _ in sig.widgets if n], node_type
        assert [(p.name, p.io_type) for p in spec.outputs] == sig.outputs, node_type
        assert spec.display_name == sig.display_name, node_type


# -- the validators can fail ----------------------------------------------------------------------------------------

def _node(workflow, node_type):
    return nodes_of(workflow, node_type)[0]


def _link(workflow, target_type, input_name):
    node = _node(workflow, target_type)
    link_id = next(i["link"] for i in node["inputs"] if i["name"] == input_name)
    return next(link for link in workflow["links"] if link[0] == link_id)


def _swap_steps_and_cfg(w):
    values = _node(w, "QI21Sampler")["widgets_values"]
    values[2], values[3] = values[3], values[2]


def _drop_seed_control(w):
    del _node(w, "QI21Sampler")["widgets_values"][1]


def _disconnect_positive(w):
    link = _link(w, "QI21Sampler", "positive")
    w["links"].remove(link)
    next(i for i in _node(w, "QI21Sampler")["inputs"] if i["name"] == "positive")["link"] = None
    _node(w, "QI21TextEncode")["outputs"][0]["links"].remove(link[0])


def _mislabel_link(w):
    _link(w, "QI21VAEDecode", "samples")[5] = "IMAGE"


def _wrong_target_slot(w):
    _link(w, "QI21VAEDecode", "samples")[4] = 0  # the vae slot


def _origin_slot_out_of_range(w):
    _link(w, "SaveImage", "images")[2] = 7


def _rename_input(w):
    _node(w, "QI21Sampler")["inputs"][0]["name"] = "unet"


def _unknown_node(w):
    _node(w, "SaveImage")["type"] = "SaveImageExtended"


def _bad_dtype(w):
    _node(w, "QI21ModelLoader")["widgets_values"][1] = "bf8"


def _user_model_name(w):
    _node(w, "QI21ModelLoader")["widgets_values"][0] = "my_model.safetensors"


def _steps_out_of_range(w):
    _node(w, "QI21Sampler")["widgets_values"][2] = 0


def _size_off_grid(w):
    _node(w, "QI21Sampler")["widgets_values"][5] = 1000


def _missing_optional_widget(w):
    _node(w, "QI21VAEDecode")["widgets_values"].clear()


UI_BREAKAGES = {
    "swapped widgets": (_swap_steps_and_cfg, "outside"),
    "no control value after seed": (_drop_seed_control, "widget values"),
    "required input unconnected": (_disconnect_positive, "required input positive"),
    "link type field wrong": (_mislabel_link, "types disagree"),
    "link into the wrong slot": (_wrong_target_slot, "does not end here"),
    "origin slot out of range": (_origin_slot_out_of_range, "out of range"),
    "renamed input": (_rename_input, "inputs ["),
    "unknown node type": (_unknown_node, "unknown node type"),
    "invalid combo value": (_bad_dtype, "'bf8' is not one of"),
    "model file not a released name": (_user_model_name, "my_model.safetensors"),
    "number below min": (_steps_out_of_range, "outside"),
    "size off the x32 grid": (_size_off_grid, "step 32"),
    "optional widget value missing": (_missing_optional_widget, "0 widget values"),
}


@pytest.mark.parametrize("breakage", sorted(UI_BREAKAGES))
def test_the_validators_catch_a_broken_ui_workflow(breakage):
    mutate, expected = UI_BREAKAGES[breakage]
    workflow = copy.deepcopy(ui("edit_one_reference"))
    assert ui_problems(workflow) == []
    mutate(workflow)
    problems = ui_problems(workflow)
    assert any(expected in p for p in problems), problems


def _api_node(p, class_type):
    return next(n for n in p.values() if n["class_type"] == class_type)


API_BREAKAGES = {
    "required input missing": (lambda p: _api_node(p, "QI21Sampler")["inputs"].pop("model"), "required input model"),
    "link to a missing node": (lambda p: _api_node(p, "QI21VAEDecode")["inputs"].update(samples=["99", 0]),
                               "missing node 99"),
    "link to a mistyped output": (lambda p: _api_node(p, "QI21VAEDecode")["inputs"].update(samples=["1", 0]),
                                  "fed by QI21_MODEL"),
    "widget value missing": (lambda p: _api_node(p, "QI21Sampler")["inputs"].pop("cfg"), "widget cfg"),
    "unknown input": (lambda p: _api_node(p, "QI21Sampler")["inputs"].update(strength=1.0), "unknown inputs"),
    "note in the prompt": (lambda p: p.update({"50": {"inputs": {"text": "x"}, "class_type": "MarkdownNote",
                                                      "_meta": {"title": "n"}}}), "not a node the server knows"),
}


@pytest.mark.parametrize("breakage", sorted(API_BREAKAGES))
def test_the_validators_catch_a_broken_api_workflow(breakage):
    mutate, expected = API_BREAKAGES[breakage]
    prompt = copy.deepcopy(api("edit_one_reference"))
    mutate(prompt)
    problems = api_problems(prompt)
    assert any(expected in p for p in problems), problems


PAIR_BREAKAGES = {
    "seed differs": (lambda w, p: _api_node(p, "QI21Sampler")["inputs"].update(seed=7), "widget values differ"),
    "link differs": (lambda w, p: _api_node(p, "QI21Reference")["inputs"].pop("mask"), "links differ"),
    "node missing": (lambda w, p: p.pop(next(k for k, n in p.items() if n["class_type"] == "SaveImage")),
                     "node ids differ"),
    "title differs": (lambda w, p: _api_node(p, "QI21Sampler")["_meta"].update(title="Sampler"), "title"),
}


@pytest.mark.parametrize("breakage", sorted(PAIR_BREAKAGES))
def test_the_validators_catch_api_and_ui_forms_that_disagree(breakage):
    mutate, expected = PAIR_BREAKAGES[breakage]
    workflow, prompt = ui("edit_one_reference"), copy.deepcopy(api("edit_one_reference"))
    mutate(workflow, prompt)
    problems = pair_problems(workflow, prompt)
    assert any(expected in p for p in problems), problems


# -- download hints ----------------------------------------------------------------------------------------------
LOADER_FOLDERS = {"QI21ModelLoader": ("model_name", "diffusion_models"),
                  "QI21TextEncoderLoader": ("text_encoder_name", "text_encoders"), "QI21VAELoader": ("vae_name", "vae"),
                  "QI21LoraLoader": ("lora_name", "loras"),
                  "QI21ControlNetLoader": ("control_net_name", "model_patches")}


@pytest.mark.parametrize("name", NAMES)
def test_every_loader_says_where_to_download_its_file(name, models_root):
    """Opening a shared workflow without the files offers their download, as core templates do: each loader node
    carries `properties.models` naming the file it loads, a folder the loader reads, and the official repackage's
    URL for that file; the name is one the loader lists (the released names, as in the tiny model set)."""
    from qi21.nodes import controlnet, loaders
    from qi21.nodes.lora import QI21LoraLoader

    classes = {"QI21ModelLoader": loaders.QI21ModelLoader, "QI21TextEncoderLoader": loaders.QI21TextEncoderLoader,
               "QI21VAELoader": loaders.QI21VAELoader, "QI21LoraLoader": QI21LoraLoader,
               "QI21ControlNetLoader": controlnet.QI21ControlNetLoader}
    checked = 0
    for node in ui(name)["nodes"]:
        if node["type"] not in LOADER_FOLDERS:
            continue
        widget, folder = LOADER_FOLDERS[node["type"]]
        listed = widget_option(next(i for i in classes[node["type"]].define_schema().inputs if i.id == widget),
                               "options")
        file_name = ui_widget_values(node)[widget]
        entries = node["properties"].get("models")
        expected = [{"name": file_name, "url": download_url(folder, file_name), "directory": folder}]
        assert entries == expected, node["type"]
        assert file_name in PUBLISHED[folder]
        assert file_name in listed or name in OFFICIAL  # the tiny set holds the bf16 names only
        checked += 1
    assert checked >= 3
