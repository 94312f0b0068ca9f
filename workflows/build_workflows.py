"""Writes the example workflows: ComfyUI's UI format in `workflows/*.json` (what the template browser lists and
the canvas loads) and the same graphs in API format in `workflows/api/*.json` (what POST /prompt takes).

    python workflows/build_workflows.py           write every file
    python workflows/build_workflows.py --check   exit 1 when a file on disk differs from what this script writes

Our nodes' inputs, widget order and outputs come from their `define_schema()`, so a file can only disagree
with a schema when it is stale (`--check`, run by tests/test_workflows.py, catches that). Core nodes are
described by hand in CORE_NODES. Output is deterministic: same code, same bytes.
"""

import argparse
import importlib.util
import json
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
API_FOLDER = "api"

#: Widget socket types: every other input is a link-only socket (ComfyUI's front end draws widgets for these).
WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})
#: The extra UI value after a seed (`control_after_generate`); "fixed" so the examples reproduce.
SEED_CONTROL = "fixed"
SEED = 42

#: The released model file names (ComfyUI single-file layouts).
BASE_MODEL = "qwen_image_2.1_bf16.safetensors"
TURBO_MODEL = "qwen_image_2.1_turbo_bf16.safetensors"
TEXT_ENCODER = "qwen3vl_8b_bf16.safetensors"
VAE_FILE = "qwen_image_2.1_vae_bf16.safetensors"
#: Pruna's 8-step LoRA as Comfy-Org repackages it, and the 8 sigmas published with it for ComfyUI (ManualSigmas;
#: a shift of 2 over 8 even steps: sigma = 2t / (1 + t)).
SPEED_LORA = "p_q_image_2.1_8_steps_v0.1_comfyui_bf16.safetensors"
SPEED_LORA_SIGMAS = "1.0, 0.9333333333, 0.8571428571, 0.7692307692, 0.6666666667, 0.5454545455, 0.4, 0.2222222222, 0.0"
#: The Turbo weights extracted as a LoRA (Comfy-Org), for Base at Turbo's 8 stored sigmas.
TURBO_LORA = "qwen_image_2.1_turbo_lora_avg_rank_178_bf16.safetensors"
#: The files the official templates load: int8 ConvRot DiTs and text encoder, and the Qwen 3.5 prompt enhancers.
INT8_MODEL = "qwen_image_2.1_int8_convrot.safetensors"
INT8_TURBO_MODEL = "qwen_image_2.1_turbo_int8_convrot.safetensors"
INT8_TEXT_ENCODER = "qwen3vl_8b_int8_convrot.safetensors"
PE_T2I = "qwen3.5_9b_qwen_image_2.1_pe_t2i.int8_convrot.safetensors"
PE_I2I = "qwen3.5_9b_qwen_image_2.1_pe_i2i.int8_convrot.safetensors"
#: Where the front end offers to download a missing file (`properties.models`, as core templates do): the
#: official ComfyUI repackage, Comfy-Org/Qwen-Image-2.1 on Hugging Face, `<folder>/<file>` under this address.
#: Keyed by loader node type: (widget holding the file name, models folder).
REPACKAGE_URL = "https://huggingface.co/Comfy-Org/Qwen-Image-2.1/resolve/main"
MODEL_WIDGETS = {"QI21ModelLoader": ("model_name", "diffusion_models"),
                 "QI21TextEncoderLoader": ("text_encoder_name", "text_encoders"),
                 "QI21VAELoader": ("vae_name", "vae"),
                 "QI21LoraLoader": ("lora_name", "loras"),
                 "CLIPLoader": ("clip_name", "text_encoders"),
                 "QI21ControlNetLoader": ("control_net_name", "model_patches")}
CONTROLNET = "qwen_image_2.1_fun_controlnet_union_bf16.safetensors"  # Comfy-Org's repack of alibaba-pai's net
RELEASED_FILES = frozenset({BASE_MODEL, TURBO_MODEL, TEXT_ENCODER, VAE_FILE, CONTROLNET})
#: The official templates' prompt-enhancer system prompts (comfyui-workflow-templates-json 0.1.123, the settings of
#: the prompt enhancer's release), kept verbatim as data: the enhancer model was released to be run with them.
PE_SYSTEM_PROMPTS = {kind: (HERE / "prompt_enhancer" / f"system_prompt_{kind}.md").read_text(encoding="utf-8")
                     for kind in ("t2i", "i2i")}
#: The official wording for transparent output (the model's documentation): the description goes in the middle.
RGBA_PROMPT = ("This is an RGBA image with transparency. {}. The image has alpha channel and the background is "
               "transparent.")


@dataclass(frozen=True)
class Port:
    """A link socket (input or output) as the front end names it."""
    name: str
    io_type: str
    optional: bool = False


@dataclass(frozen=True)
class Widget:
    name: str
    io_type: str
    default: object = None
    optional: bool = False
    control_after_generate: bool = False
    in_api: bool = True  # LoadImage's upload button is saved in the UI form only


@dataclass(frozen=True)
class NodeSpec:
    """What the front end serialises for one node type: sockets (required, then optional), then widgets in
    the same order, then outputs. That is the order of ComfyUI's `input_order` and of `widgets_values`."""
    node_type: str
    display_name: str
    sockets: tuple[Port, ...] = ()
    widgets: tuple[Widget, ...] = ()
    outputs: tuple[Port, ...] = ()
    in_api: bool = True          # note nodes live in the front end only
    widget_sockets: bool = True  # the front end gives each widget an input socket (notes have none)


#: Core nodes the examples use, as ComfyUI defines them (nodes.py: LoadImage, SaveImage, PreviewImage;
#: comfy_extras/nodes_mask.py: MaskPreview; Note and MarkdownNote are front-end-only). The save/preview nodes
#: pass their input through as an output since ComfyUI #13866; older versions simply show no output socket.
CORE_NODES = {spec.node_type: spec for spec in (
    NodeSpec("LoadImage", "Load Image",
             widgets=(Widget("image", "COMBO"), Widget("upload", "IMAGEUPLOAD", "image", in_api=False)),
             outputs=(Port("IMAGE", "IMAGE"), Port("MASK", "MASK"))),
    NodeSpec("SaveImage", "Save Image", sockets=(Port("images", "IMAGE"),),
             widgets=(Widget("filename_prefix", "STRING", "ComfyUI"),), outputs=(Port("images", "IMAGE"),)),
    NodeSpec("PreviewImage", "Preview Image", sockets=(Port("images", "IMAGE"),), outputs=(Port("images", "IMAGE"),)),
    NodeSpec("MaskPreview", "Preview Mask", sockets=(Port("mask", "MASK"),), outputs=(Port("mask", "MASK"),)),
    NodeSpec("MarkdownNote", "Markdown Note", widgets=(Widget("text", "STRING", ""),), in_api=False,
             widget_sockets=False),
    NodeSpec("Note", "Note", widgets=(Widget("text", "STRING", ""),), in_api=False, widget_sockets=False),
    NodeSpec("SetLatentNoiseMask", "Set Latent Noise Mask", sockets=(Port("samples", "LATENT"), Port("mask", "MASK")),
             outputs=(Port("LATENT", "LATENT"),)),
    NodeSpec("ManualSigmas", "ManualSigmas", widgets=(Widget("sigmas", "STRING", "1, 0.5"),),
             outputs=(Port("SIGMAS", "SIGMAS"),)),
    NodeSpec("Canny", "Detect Edges (Canny)", sockets=(Port("image", "IMAGE"),),
             widgets=(Widget("low_threshold", "FLOAT", 0.4), Widget("high_threshold", "FLOAT", 0.8)),
             outputs=(Port("IMAGE", "IMAGE"),)),
    # the prompt-enhancer step of the official templates (nodes.py CLIPLoader; comfy_extras: nodes_textgen.py
    # TextGenerate as of ComfyUI 0.37, with `system_prompt` and `mtp`; nodes_logic.py ComfySwitchNode, whose
    # match-type sockets the front end saves with the linked type; nodes_primitive.py; nodes_preview_any.py)
    NodeSpec("CLIPLoader", "Load CLIP", widgets=(Widget("clip_name", "COMBO"), Widget("type", "COMBO"),
                                                 Widget("device", "COMBO", "default", optional=True)),
             outputs=(Port("CLIP", "CLIP"),)),
    NodeSpec("TextGenerate", "Generate Text",
             sockets=(Port("clip", "CLIP"), Port("image", "IMAGE", True), Port("video", "IMAGE", True),
                      Port("audio", "AUDIO", True), Port("system_prompt", "STRING", True)),
             widgets=(Widget("prompt", "STRING", ""), Widget("max_length", "INT", 512),
                      Widget("sampling_mode", "COMBO", "on"), Widget("sampling_mode.temperature", "FLOAT", 0.7),
                      Widget("sampling_mode.top_k", "INT", 64), Widget("sampling_mode.top_p", "FLOAT", 0.95),
                      Widget("sampling_mode.min_p", "FLOAT", 0.05),
                      Widget("sampling_mode.repetition_penalty", "FLOAT", 1.05),
                      Widget("sampling_mode.seed", "INT", 0), Widget("sampling_mode.presence_penalty", "FLOAT", 0.0),
                      Widget("thinking", "BOOLEAN", False, optional=True),
                      Widget("use_default_template", "BOOLEAN", True, optional=True),
                      Widget("mtp", "COMBO", "auto", optional=True)),
             outputs=(Port("generated_text", "STRING"), Port("thinking", "STRING"))),
    NodeSpec("ComfySwitchNode", "If/Else Switch", sockets=(Port("on_false", "STRING", True),
                                                          Port("on_true", "STRING", True)),
             widgets=(Widget("switch", "BOOLEAN", False),), outputs=(Port("output", "STRING"),)),
    NodeSpec("PrimitiveStringMultiline", "Text (Multiline)", widgets=(Widget("value", "STRING", ""),),
             outputs=(Port("STRING", "STRING"),)),
    NodeSpec("PreviewAny", "Preview as Text", sockets=(Port("source", "*"),), outputs=(Port("STRING", "STRING"),)),
    NodeSpec("KSamplerSelect", "KSamplerSelect", widgets=(Widget("sampler_name", "COMBO", "euler"),),
             outputs=(Port("SAMPLER", "SAMPLER"),)),
    NodeSpec("ImageBatch", "Batch Images", sockets=(Port("image1", "IMAGE"), Port("image2", "IMAGE")),
             outputs=(Port("IMAGE", "IMAGE"),)),
)}


def model_downloads(node: "Node") -> list[dict]:
    """The front end's `properties.models` of a loader node: the file, its download URL and folder."""
    if node.spec.node_type not in MODEL_WIDGETS:
        return []
    widget, folder = MODEL_WIDGETS[node.spec.node_type]
    name = node.values[widget]
    return [{"name": name, "url": f"{REPACKAGE_URL}/{folder}/{name}", "directory": folder}]


def spec_from_schema(schema, option) -> NodeSpec:
    """The serialised shape of one of our nodes, from its `define_schema()`; `option` reads a widget option (the
    pack's `widget_option`, nodes/validation.py, which knows ComfyUI's V3 inputs and our stand-in)."""
    inputs = sorted(schema.inputs, key=lambda i: bool(i.optional))  # stable: required first, as input_order
    return NodeSpec(
        node_type=schema.node_id,
        display_name=schema.display_name or schema.node_id,
        sockets=tuple(Port(i.id, i.io_type, bool(i.optional)) for i in inputs if i.io_type not in WIDGET_TYPES),
        widgets=tuple(Widget(i.id, i.io_type, i.default, bool(i.optional), bool(option(i, "control_after_generate")))
                      for i in inputs if i.io_type in WIDGET_TYPES),
        outputs=tuple(Port(o.display_name or o.io_type, o.io_type) for o in schema.outputs),
    )


def import_pack():
    """The repository as package `qi21` (already registered when the tests import this file), through the one
    shared helper, demo/pack_import.py, loaded by its path: run as a script, Python puts workflows/ on sys.path,
    not the repository."""
    spec = importlib.util.spec_from_file_location("qi21_pack_import", ROOT / "demo" / "pack_import.py")
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    return helper.import_pack()


def load_specs() -> dict[str, NodeSpec]:
    """Every node type the examples may use: the pack's (imported as `qi21`, without ComfyUI) and CORE_NODES."""
    pack = import_pack().__name__
    nodes = importlib.import_module(f"{pack}.nodes")
    widget_option = importlib.import_module(f"{pack}.nodes.validation").widget_option
    ours = {s.node_type: s for s in (spec_from_schema(n.define_schema(), widget_option) for n in nodes.NODES)}
    return {**CORE_NODES, **ours}


# -- the graph ------------------------------------------------------------------------------------------------

@dataclass
class Node:
    id: int
    spec: NodeSpec
    pos: tuple[int, int]
    size: tuple[int, int]
    values: dict
    title: str | None = None
    inputs: dict = field(default_factory=dict)   # socket name -> link id
    outputs: dict = field(default_factory=dict)  # output slot -> [link ids]

    def ui_inputs(self) -> list[tuple[str, str, bool, bool]]:
        """(name, type, is_widget, optional) in the front end's slot order: sockets, then widget sockets."""
        sockets = [(p.name, p.io_type, False, p.optional) for p in self.spec.sockets]
        widgets = [(w.name, w.io_type, True, w.optional) for w in self.spec.widgets] if self.spec.widget_sockets else []
        return sockets + widgets


@dataclass(frozen=True)
class Link:
    id: int
    origin: Node
    origin_slot: int
    target: Node
    target_name: str
    io_type: str


class Graph:
    """One workflow: nodes added with widget values by name, links by socket names; serialises both forms."""

    def __init__(self, name: str, specs: dict[str, NodeSpec]):
        self.name, self.specs = name, specs
        self.nodes: list[Node] = []
        self.links: list[Link] = []

    def add(self, node_type: str, pos, size, title: str = None, **values) -> Node:
        spec = self.specs[node_type]
        known = {w.name for w in spec.widgets}
        if unknown := set(values) - known:
            raise KeyError(f"{node_type} has no widget {sorted(unknown)}")
        full = {}
        for widget in spec.widgets:
            value = values.get(widget.name, widget.default)
            if value is None:
                raise ValueError(f"{self.name}: {node_type}.{widget.name} has no default; give a value")
            full[widget.name] = value
        node = Node(len(self.nodes) + 1, spec, tuple(pos), tuple(size), full, title)
        self.nodes.append(node)
        return node

    def note(self, text: str, pos, size) -> Node:
        return self.add("MarkdownNote", pos, size, text=text.strip() + "\n")

    def link(self, origin: Node, output: str, target: Node, socket: str) -> None:
        """Link an output to a socket, or to a widget's socket (the widget's value then comes from the link)."""
        slots = [i for i, p in enumerate(origin.spec.outputs) if p.name == output]
        ports = {p.name: p for p in target.spec.sockets}
        ports |= {w.name: w for w in target.spec.widgets if target.spec.widget_sockets and w.in_api}
        if len(slots) != 1 or socket not in ports or socket in target.inputs:
            raise ValueError(f"{self.name}: cannot link {origin.spec.node_type}.{output} -> "
                             f"{target.spec.node_type}.{socket}")
        out_type, in_type = origin.spec.outputs[slots[0]].io_type, ports[socket].io_type
        if in_type not in ("*", out_type):  # "*": a socket that takes any type (PreviewAny)
            raise TypeError(f"{self.name}: {out_type} output into {in_type} input {target.spec.node_type}.{socket}")
        link = Link(len(self.links) + 1, origin, slots[0], target, socket, out_type)
        self.links.append(link)
        target.inputs[socket] = link.id
        origin.outputs.setdefault(slots[0], []).append(link.id)

    def _order(self) -> dict[int, int]:
        """Execution order the front end stores in `order`: topological, ties by node id."""
        waiting = {n.id: {link.origin.id for link in self.links if link.target is n} for n in self.nodes}
        order = {}
        while waiting:
            ready = min(i for i, deps in waiting.items() if not deps - order.keys())
            order[ready] = len(order)
            del waiting[ready]
        return order

    def _widgets_values(self, node: Node) -> list:
        values = []
        for widget in node.spec.widgets:
            values.append(node.values[widget.name])
            if widget.control_after_generate:
                values.append(SEED_CONTROL)
        return values

    @staticmethod
    def _properties(node: Node) -> dict:
        if not node.spec.in_api:
            return {}
        properties = {"Node name for S&R": node.spec.node_type}
        if downloads := model_downloads(node):
            properties["models"] = downloads
        return properties

    def ui(self) -> dict:
        order = self._order()
        nodes = []
        for node in self.nodes:
            inputs = []
            for name, io_type, is_widget, optional in node.ui_inputs():
                entry = {"localized_name": name, "name": name, "type": io_type}
                if is_widget:
                    entry["widget"] = {"name": name}
                if optional:
                    entry["shape"] = 7  # the hollow dot the front end draws for optional inputs
                entry["link"] = node.inputs.get(name)
                inputs.append(entry)
            outputs = [{"localized_name": p.name, "name": p.name, "type": p.io_type, "slot_index": slot,
                        "links": node.outputs.get(slot)} for slot, p in enumerate(node.spec.outputs)]
            entry = {"id": node.id, "type": node.spec.node_type}
            if node.title:
                entry["title"] = node.title
            entry |= {"pos": list(node.pos), "size": list(node.size), "flags": {}, "order": order[node.id],
                      "mode": 0, "inputs": inputs, "outputs": outputs,
                      "properties": self._properties(node),
                      "widgets_values": self._widgets_values(node)}
            nodes.append(entry)
        links = [[link.id, link.origin.id, link.origin_slot, link.target.id,
                  [name for name, *_ in link.target.ui_inputs()].index(link.target_name), link.io_type]
                 for link in self.links]
        return {
            "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"qi21/workflows/{self.name}")),
            "revision": 0,
            "last_node_id": max(n.id for n in self.nodes),
            "last_link_id": max((link.id for link in self.links), default=0),
            "nodes": nodes,
            "links": links,
            "groups": [],
            "config": {},
            "extra": {"ds": {"scale": 0.75, "offset": [40, 40]}},
            "version": 0.4,
        }

    def api(self) -> dict:
        by_id = {link.id: link for link in self.links}
        prompt = {}
        for node in self.nodes:
            if not node.spec.in_api:
                continue
            inputs = {w.name: node.values[w.name] for w in node.spec.widgets if w.in_api and w.name not in node.inputs}
            for name in [p.name for p in node.spec.sockets] + [w.name for w in node.spec.widgets]:
                if name in node.inputs:
                    link = by_id[node.inputs[name]]
                    inputs[name] = [str(link.origin.id), link.origin_slot]
            prompt[str(node.id)] = {"inputs": inputs, "class_type": node.spec.node_type,
                                    "_meta": {"title": node.title or node.spec.display_name}}
        return prompt


# -- the five examples ----------------------------------------------------------------------------------------
# Columns: loaders at x=0, images/references/prompts at x=420, sampler at x=900, decode at x=1280, outputs at 1600.

def _loaders(g: Graph, model_file: str) -> tuple[Node, Node, Node]:
    model = g.add("QI21ModelLoader", (0, 120), (340, 130), model_name=model_file)
    encoder = g.add("QI21TextEncoderLoader", (0, 300), (340, 130), text_encoder_name=TEXT_ENCODER)
    vae = g.add("QI21VAELoader", (0, 480), (340, 110), vae_name=VAE_FILE)
    return model, encoder, vae


def _prompt(g: Graph, encoder: Node, text: str, pos=(420, 120), references: Node = None) -> Node:
    node = g.add("QI21TextEncode", pos, (420, 200), prompt=text)
    g.link(encoder, "text_encoder", node, "text_encoder")
    if references is not None:
        g.link(references, "references", node, "references")
    return node


def _sampler(g: Graph, node_type: str, model: Node, positive: Node, pos=(900, 120), **values) -> Node:
    size = (320, 330) if node_type == "QI21Sampler" else (320, 260)
    node = g.add(node_type, pos, size, seed=SEED, **values)
    g.link(model, "model", node, "model")
    g.link(positive, "conditioning", node, "positive")
    return node


def _decode(g: Graph, vae: Node, latent: Node, pos=(1280, 120)) -> Node:
    node = g.add("QI21VAEDecode", pos, (260, 120))
    g.link(vae, "vae", node, "vae")
    g.link(latent, "LATENT", node, "samples")
    return node


def _save(g: Graph, decode: Node, output: str, prefix: str, pos=(1600, 120)) -> Node:
    node = g.add("SaveImage", pos, (480, 520), filename_prefix=prefix)
    g.link(decode, output, node, "images")
    return node


def _reference(g: Graph, vae: Node, image_file: str, index: int, pos, previous: Node = None) -> Node:
    x, y = pos
    image = g.add("LoadImage", (x, y), (320, 360), title=f"Load Image (<image{index}>)", image=image_file)
    reference = g.add("QI21Reference", (x + 360, y), (320, 150), title=f"Reference <image{index}>")
    g.link(vae, "vae", reference, "vae")
    g.link(image, "IMAGE", reference, "image")
    g.link(image, "MASK", reference, "mask")
    if previous is not None:
        g.link(previous, "references", reference, "references")
    return reference


def text_to_image_base(g: Graph) -> None:
    model, encoder, vae = _loaders(g, BASE_MODEL)
    positive = _prompt(g, encoder, "A red fox sitting in a snowy birch forest at dawn, soft golden light, shallow "
                                   "depth of field, detailed wildlife photograph.")
    sampler = _sampler(g, "QI21Sampler", model, positive, steps=40, cfg=1.0, width=1024, height=1024)
    _save(g, _decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/text_to_image_base")
    g.note("""
## Qwen-Image 2.1 Base: text to image

The official settings: **40 steps, cfg 1**, 1024 x 1024. The sampler computes the prompt once and caches its
keys/values after step 1 (`prefix_cache` on); its report on the node shows tokens, cache size and timings.

True CFG: connect a second *Text Encode* to `negative` and raise `cfg` above 1 (about twice the work).
Models go in `models/diffusion_models`, `models/text_encoders` and `models/vae`.
""", (0, 660), (420, 260))


def text_to_image_turbo(g: Graph) -> None:
    model, encoder, vae = _loaders(g, TURBO_MODEL)
    positive = _prompt(g, encoder, "A cozy reading nook by a tall window, rain on the glass, warm lamp light, "
                                   "stacks of books, watercolor illustration.")
    sampler = _sampler(g, "QI21TurboSampler", model, positive, width=1024, height=1024)
    _save(g, _decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/text_to_image_turbo")
    g.note("""
## Qwen-Image 2.1 Turbo: text to image

The Turbo model with its own sampler: the stored **8-step** schedule, no CFG, so there are no steps or cfg
to set. Use the Base sampler for the Base model and this one for Turbo; a mismatch is warned about.
""", (0, 660), (420, 200))


def edit_one_reference(g: Graph) -> None:
    model, encoder, vae = _loaders(g, BASE_MODEL)
    reference = _reference(g, vae, "example.png", 1, (420, 660))
    positive = _prompt(g, encoder, "Turn the sky in <image1> into a warm sunset with pink clouds; keep everything "
                                   "else unchanged.", references=reference)
    sampler = _sampler(g, "QI21Sampler", model, positive, steps=40, cfg=1.0, width=0, height=0)
    _save(g, _decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/edit_one_reference")
    g.note("""
## Qwen-Image 2.1: edit one image

*Load Image* -> *Reference* -> *Text Encode* (`references`). The prompt calls the image `<image1>`.
Width and height 0 follow the reference's size (resized to about `resolution`^2, sides x32).
The image's alpha (LoadImage's MASK) is kept: transparent inputs stay transparent.
Replace `example.png` with your own image.
""", (0, 660), (380, 300))


def edit_three_references(g: Graph) -> None:
    model, encoder, vae = _loaders(g, BASE_MODEL)
    first = _reference(g, vae, "example_1.png", 1, (420, 660))
    second = _reference(g, vae, "example_2.png", 2, (420, 1060), previous=first)
    third = _reference(g, vae, "example_3.png", 3, (420, 1460), previous=second)
    positive = _prompt(g, encoder, "The person from <image1> wears the jacket from <image2> and stands in the "
                                   "street scene of <image3>, natural evening light.", references=third)
    sampler = _sampler(g, "QI21Sampler", model, positive, steps=40, cfg=1.0, width=0, height=0)
    _save(g, _decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/edit_three_references")
    g.note("""
## Qwen-Image 2.1: three references

Chain *Reference* nodes (`references` -> `references`): they become `<image1>`, `<image2>`, `<image3>`
in chain order (up to 10). Only the last one goes into *Text Encode*. Width and height 0 follow the last
reference. The prefix cache pays off most here: the references are computed once, not every step.
Replace `example_1.png`..`example_3.png` with your own images.
""", (0, 660), (380, 320))


def transparent_rgba_png(g: Graph) -> None:
    model, encoder, vae = _loaders(g, TURBO_MODEL)
    positive = _prompt(g, encoder, RGBA_PROMPT.format("A glass perfume bottle with a gold cap, product shot, soft "
                                                      "studio lighting"))
    sampler = _sampler(g, "QI21TurboSampler", model, positive, width=1024, height=1024)
    decode = _decode(g, vae, sampler)
    _save(g, decode, "RGBA", "qwen-image-2.1/transparent_rgba")
    rgb = g.add("PreviewImage", (1600, 700), (400, 440))
    g.link(decode, "IMAGE", rgb, "images")
    mask = g.add("MaskPreview", (2040, 700), (400, 440))
    g.link(decode, "MASK", mask, "mask")
    g.note("""
## Qwen-Image 2.1: transparent PNG

The VAE decodes RGB **and alpha**. *VAE Decode* gives `IMAGE` (RGB), `MASK` (1 = transparent, ComfyUI's
convention) and `RGBA` (4 channels). *Save Image* writes the RGBA output as a PNG with an alpha channel.
Ask for transparency in the prompt. Works the same with the Base model and sampler.
""", (0, 660), (420, 260))


def base_speed_lora(g: Graph) -> None:
    model, encoder, vae = _loaders(g, BASE_MODEL)
    lora = g.add("QI21LoraLoader", (420, 380), (420, 110), lora_name=SPEED_LORA, strength=1.0)
    g.link(model, "model", lora, "model")
    positive = _prompt(g, encoder, "A lighthouse on a rocky coast under a stormy sky, waves breaking, dramatic "
                                   "light, detailed photograph.")
    sigmas = g.add("ManualSigmas", (420, 540), (420, 90), sigmas=SPEED_LORA_SIGMAS)
    sampler = _sampler(g, "QI21Sampler", lora, positive, steps=8, cfg=1.0, width=1024, height=1024)
    g.link(sigmas, "SIGMAS", sampler, "sigmas")
    _save(g, _decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/base_speed_lora")
    g.note("""
## Qwen-Image 2.1 Base + speed LoRA

*LoRA* sits between the model loader and the sampler: it returns the model with the LoRA, and leaves the
loaded model as it was (no second copy of the weights). Pruna's 8-step LoRA
(`p_q_image_2.1_8_steps_v0.1_comfyui_bf16.safetensors`, Comfy-Org's repackage, in `models/loras`) runs Base in
**8 steps, cfg 1, strength 1**, on the 8 sigmas published with it (*ManualSigmas*: a shift of 2 over 8 even
steps). Its 5- and 6-step siblings work the same way with their own sigmas. Chain more *LoRA* nodes to stack
LoRAs; the sampler's report lists each with its strength.
""", (0, 660), (420, 300))


def base_turbo_lora(g: Graph) -> None:
    model, encoder, vae = _loaders(g, BASE_MODEL)
    lora = g.add("QI21LoraLoader", (420, 380), (420, 110), lora_name=TURBO_LORA, strength=1.0)
    g.link(model, "model", lora, "model")
    positive = _prompt(g, encoder, "A street market at dusk, paper lanterns, steam rising from food stalls, "
                                   "cinematic photograph.")
    sigmas = g.add("QI21Sigmas", (420, 540), (420, 170), schedule="turbo", steps=8, width=1024, height=1024)
    sampler = _sampler(g, "QI21Sampler", lora, positive, steps=8, cfg=1.0, width=1024, height=1024)
    g.link(sigmas, "SIGMAS", sampler, "sigmas")
    _save(g, _decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/base_turbo_lora")
    g.note("""
## Qwen-Image 2.1 Base + official Turbo LoRA

Comfy-Org's `qwen_image_2.1_turbo_lora_avg_rank_178_bf16.safetensors` (in `models/loras`) is the Turbo model
extracted as a LoRA of Base: low-rank pairs plus full patches (`.diff`) of the norms, applied as ComfyUI applies
them. Base + this LoRA samples on Turbo's **8 stored sigmas** (*Schedule* set to turbo), cfg 1, so one Base file
serves both. The Turbo file itself is exact; the LoRA is its rank-reduced copy.
""", (0, 660), (420, 280))


def _encode(g: Graph, vae: Node, image_file: str, pos=(420, 660)) -> tuple[Node, Node]:
    image = g.add("LoadImage", pos, (320, 360), image=image_file)
    encode = g.add("QI21VAEEncode", (pos[0] + 360, pos[1]), (300, 120))
    g.link(vae, "vae", encode, "vae")
    g.link(image, "IMAGE", encode, "image")
    return image, encode


def img2img(g: Graph) -> None:
    model, encoder, vae = _loaders(g, BASE_MODEL)
    _, encode = _encode(g, vae, "example.png")
    positive = _prompt(g, encoder, "An oil painting of the same scene, thick brush strokes, warm colours.")
    sampler = _sampler(g, "QI21Sampler", model, positive, steps=40, cfg=1.0, width=0, height=0, denoise=0.6)
    g.link(encode, "LATENT", sampler, "latent_image")
    _save(g, _decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/img2img")
    g.note("""
## Qwen-Image 2.1: image to image

*Load Image* -> *VAE Encode* -> the sampler's `latent_image`. `denoise` 0.6 keeps the layout and redoes
the rest: the sampler runs the last 40 steps of a 40 / 0.6 = 66-step schedule, starting from the image noised
to that point. 1.0 ignores the image; lower keeps more of it. Width and height (0) follow the image, whose
sides are centre-cropped to multiples of 32. Replace `example.png` with your own image.
""", (0, 660), (400, 300))


def inpaint_with_a_mask(g: Graph) -> None:
    model, encoder, vae = _loaders(g, BASE_MODEL)
    image, encode = _encode(g, vae, "example.png")
    mask = g.add("SetLatentNoiseMask", (780, 820), (260, 80))
    g.link(encode, "LATENT", mask, "samples")
    g.link(image, "MASK", mask, "mask")
    positive = _prompt(g, encoder, "A small red boat on the water.")
    sampler = _sampler(g, "QI21Sampler", model, positive, steps=40, cfg=1.0, width=0, height=0, denoise=1.0)
    g.link(mask, "LATENT", sampler, "latent_image")
    _save(g, _decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/inpaint")
    g.note("""
## Qwen-Image 2.1: inpaint with a mask

Paint the area to redo in *Load Image*'s mask editor (right click -> Open in MaskEditor): its MASK goes
through core *Set Latent Noise Mask* onto the encoded image. The sampler repaints where the mask is 1 and
keeps the rest: after every step the kept part is reset to the input noised to the next sigma, so it ends
exactly as encoded. Lower `denoise` to keep more of the masked area's original content.
""", (0, 660), (400, 300))


def manual_schedule(g: Graph) -> None:
    model, encoder, vae = _loaders(g, BASE_MODEL)
    positive = _prompt(g, encoder, "A paper boat on a puddle after the rain, city reflections, macro photograph.")
    sigmas = g.add("ManualSigmas", (420, 380), (420, 90), sigmas="1.0, 0.94, 0.85, 0.72, 0.55, 0.35, 0.15, 0.0")
    sampler = _sampler(g, "QI21Sampler", model, positive, steps=40, cfg=1.0, width=1024, height=1024)
    g.link(sigmas, "SIGMAS", sampler, "sigmas")
    _save(g, _decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/manual_schedule")
    g.note("""
## Qwen-Image 2.1: a schedule typed by hand

Core *ManualSigmas* -> the sampler's `sigmas`: the values are used exactly as typed (decreasing, from 1 for
pure noise to 0), and `steps` is ignored. Use the schedule a speed LoRA's card gives, or split a schedule
with *SplitSigmas* between two samplers (the second with `add_noise` off). *Qwen-Image 2.1 Schedule* gives
the official sigmas as a starting point.
""", (0, 660), (420, 280))


def _controlnet(g: Graph, model: Node, vae: Node, pos=(420, 380), **values) -> tuple[Node, Node]:
    loader = g.add("QI21ControlNetLoader", (0, 660), (340, 110), control_net_name=CONTROLNET)
    apply = g.add("QI21ControlNetApply", pos, (420, 230), **values)
    g.link(model, "model", apply, "model")
    g.link(loader, "control_net", apply, "control_net")
    g.link(vae, "vae", apply, "vae")
    return loader, apply


def controlnet_canny(g: Graph) -> None:
    model, encoder, vae = _loaders(g, BASE_MODEL)
    image = g.add("LoadImage", (420, 680), (320, 360), image="example.png")
    edges = g.add("Canny", (780, 680), (300, 110), low_threshold=0.4, high_threshold=0.8)
    g.link(image, "IMAGE", edges, "image")
    preview = g.add("PreviewImage", (780, 840), (300, 260))
    g.link(edges, "IMAGE", preview, "images")
    _, apply = _controlnet(g, model, vae, strength=1.0)
    g.link(edges, "IMAGE", apply, "control_image")
    positive = _prompt(g, encoder, "A glass greenhouse full of tropical plants at sunset, warm light through the "
                                   "panes, detailed photograph.")
    sampler = _sampler(g, "QI21Sampler", apply, positive, steps=40, cfg=1.0, width=1024, height=1024)
    _save(g, _decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/controlnet_canny")
    g.note("""
## Qwen-Image 2.1 Fun ControlNet: canny edges

*Load Image* -> core *Detect Edges (Canny)* -> *Apply Fun ControlNet*'s `control_image`; the model it returns
goes to the sampler. The same net takes depth, pose (DWPose), HED, lineart, MLSD, scribble or grayscale maps:
feed any such RGB map instead. The map is stretched to the sampler's size, so set width and height to your
image's aspect. `strength` 1 is what the net was trained for (lower loosens the structure); the official
settings are 40 steps, cfg 1. The sampler keeps its prefix cache on (about +50% cache memory for the control's
own keys and values); its report lists the control and the cache bytes of each stream. The control net file
goes in `models/model_patches` (the int8 ConvRot file works too).
""", (0, 800), (400, 360))


def controlnet_inpaint(g: Graph) -> None:
    model, encoder, vae = _loaders(g, BASE_MODEL)
    image = g.add("LoadImage", (420, 680), (320, 360), image="example.png")
    _, apply = _controlnet(g, model, vae, strength=1.0)
    g.link(image, "IMAGE", apply, "inpaint_image")
    g.link(image, "MASK", apply, "mask")
    positive = _prompt(g, encoder, "A small wooden cabin with a lit window, in the same style as the rest of the "
                                   "picture.")
    sampler = _sampler(g, "QI21Sampler", apply, positive, steps=40, cfg=1.0, width=1024, height=1024)
    _save(g, _decode(g, vae, sampler), "IMAGE", "qwen-image-2.1/controlnet_inpaint")
    g.note("""
## Qwen-Image 2.1 Fun ControlNet: inpainting with a mask

Paint the area to regenerate in *Load Image*'s mask editor (right click -> Open in MaskEditor): its MASK (1 =
regenerate) and the image go to *Apply Fun ControlNet*'s `mask` and `inpaint_image`. The net repaints the masked
area to fit the rest, from the prompt. Set width and height to your image's size (the image and the mask are
stretched to it). Connect a `control_image` as well (e.g. canny of the original) to steer the new content.
""", (0, 800), (400, 300))
# -- the official Qwen-Image 2.1 templates, rebuilt from our nodes ------------------------------------------------
# comfyui-workflow-templates-json 0.1.123: image_qwen_image_2_1_{t2i, image_edit, background_removal, turbo_t2i,
# turbo_image_edit}. Same files (int8 ConvRot DiT and text encoder), sampler, steps, cfg and Turbo sigmas; the prompt
# enhancer as there: core CLIPLoader (the Qwen 3.5 PE file) -> TextGenerate with the release's system prompt,
# behind an on/off switch (off by default), its text shown by PreviewAny and fed to our Text Encode.
TURBO_SIGMAS_TEXT = "1.0, 0.978453, 0.95418, 0.926626, 0.89508, 0.845148, 0.704534, 0.414568, 0"
PE_SAMPLING = {"t2i": 1.5, "i2i": 0.0}  # presence_penalty; otherwise the same sampling settings in both


def _template_loaders(g: Graph, model_file: str) -> tuple[Node, Node, Node]:
    model = g.add("QI21ModelLoader", (0, 120), (340, 130), model_name=model_file)
    encoder = g.add("QI21TextEncoderLoader", (0, 300), (340, 130), text_encoder_name=INT8_TEXT_ENCODER)
    vae = g.add("QI21VAELoader", (0, 480), (340, 110), vae_name=VAE_FILE)
    return model, encoder, vae


def _prompt_enhancer(g: Graph, kind: str, text: str, pos, images: Node = None) -> Node:
    """Prompt -> (switch off: as typed | on: rewritten by the PE model) -> PreviewAny, whose STRING is the prompt."""
    x, y = pos
    prompt = g.add("PrimitiveStringMultiline", (x, y), (420, 220), title="Prompt", value=text)
    system = g.add("PrimitiveStringMultiline", (x, y + 260), (420, 220), title="Text (System Prompt)",
                   value=PE_SYSTEM_PROMPTS[kind])
    clip = g.add("CLIPLoader", (x, y + 520), (420, 110), clip_name=PE_T2I if kind == "t2i" else PE_I2I,
                 type="stable_diffusion" if kind == "t2i" else "qwen_image")
    generate = g.add("TextGenerate", (x + 460, y + 260), (400, 460), max_length=4096, sampling_mode="on",
                     thinking=False, **{"sampling_mode.temperature": 1.0, "sampling_mode.top_k": 20,
                                        "sampling_mode.top_p": 0.95, "sampling_mode.min_p": 0.0,
                                        "sampling_mode.repetition_penalty": 1.0, "sampling_mode.seed": 0,
                                        "sampling_mode.presence_penalty": PE_SAMPLING[kind]})
    switch = g.add("ComfySwitchNode", (x + 460, y), (300, 90), title="Prompt enhancer (true = on)", switch=False)
    preview = g.add("PreviewAny", (x + 460, y + 120), (400, 100), title="Prompt used")
    g.link(clip, "CLIP", generate, "clip")
    g.link(system, "STRING", generate, "system_prompt")
    g.link(prompt, "STRING", generate, "prompt")
    if images is not None:
        g.link(images, "IMAGE", generate, "image")
    g.link(prompt, "STRING", switch, "on_false")
    g.link(generate, "generated_text", switch, "on_true")
    g.link(switch, "output", preview, "source")
    return preview


def _enhanced_prompt(g: Graph, encoder: Node, enhancer: Node, text: str, references: Node = None) -> Node:
    node = _prompt(g, encoder, text, pos=(1340, 120), references=references)
    g.link(enhancer, "STRING", node, "prompt")
    return node


def _select_sampler(g: Graph, sampler: Node, pos) -> None:
    select = g.add("KSamplerSelect", pos, (320, 60), sampler_name="euler")
    g.link(select, "SAMPLER", sampler, "sampler")


def _turbo_sigmas(g: Graph, sampler: Node, pos) -> None:
    sigmas = g.add("ManualSigmas", pos, (420, 90), sigmas=TURBO_SIGMAS_TEXT)
    g.link(sigmas, "SIGMAS", sampler, "sigmas")


def _template_reference(g: Graph, vae: Node, image_file: str, index: int, pos, previous: Node = None):
    x, y = pos
    image = g.add("LoadImage", (x, y), (320, 360), title=f"Load Image (<image{index}>)", image=image_file)
    reference = g.add("QI21Reference", (x + 360, y), (320, 150), title=f"Reference <image{index}>", resolution=0)
    g.link(vae, "vae", reference, "vae")
    g.link(image, "IMAGE", reference, "image")
    g.link(image, "MASK", reference, "mask")
    if previous is not None:
        g.link(previous, "references", reference, "references")
    return image, reference


TEMPLATE_NOTE = """
## Qwen-Image 2.1 {title}: the official template, with this pack's nodes

The same job as core's `image_qwen_image_2_1_{template}` template, with the same files ({files}), {settings}.
**Prompt enhancer**: set the switch to true to rewrite the prompt with the Qwen 3.5 prompt enhancer
(`{pe}` in `models/text_encoders`, ComfyUI >= 0.37.2) before the image model sees it; *Prompt used* shows the text.

What ours does differently: {difference} The prompt and references are computed once and cached (`prefix_cache`);
the report on the sampler shows the cache and timings.
"""
BASE_DIFFERENCE = ("the Base schedule is the official one (dynamic shift from the image size, last sigma 0.02) where "
                   "the template's `simple` scheduler uses core's fixed shift; for the template's exact sigmas, feed "
                   "*Qwen-Image 2.1 Schedule* with scheduler `simple` into `sigmas`.")


def official_t2i(g: Graph) -> None:
    model, encoder, vae = _template_loaders(g, INT8_MODEL)
    enhancer = _prompt_enhancer(g, "t2i", "A greyscale fashion editorial portrait of a woman in profile wearing "
                                "oversized round black sunglasses, high-contrast studio light, against a vivid lime "
                                "green pop-art collage background.", (420, 660))
    positive = _enhanced_prompt(g, encoder, enhancer, "")
    sampler = _sampler(g, "QI21Sampler", model, positive, pos=(1340, 400), steps=25, cfg=1.0, width=1024,
                       height=1024)
    _select_sampler(g, sampler, (1340, 780))
    _save(g, _decode(g, vae, sampler, pos=(1720, 120)), "IMAGE", "qwen-image-2.1/official_t2i", pos=(2020, 120))
    g.note(TEMPLATE_NOTE.format(title="text to image", template="t2i", files=f"`{INT8_MODEL}`, `{INT8_TEXT_ENCODER}`",
                                settings="25 steps, cfg 1, euler (KSamplerSelect into `sampler`), 1024 x 1024",
                                pe=PE_T2I, difference=BASE_DIFFERENCE), (0, 660), (400, 420))


def official_image_edit(g: Graph) -> None:
    model, encoder, vae = _template_loaders(g, INT8_MODEL)
    first_image, first = _template_reference(g, vae, "portrait_model_denim.png", 1, (420, 1500))
    second_image, second = _template_reference(g, vae, "clothing_light_blue_denim_shirt.png", 2, (420, 1900),
                                               previous=first)
    images = g.add("ImageBatch", (1140, 1500), (260, 80))
    g.link(first_image, "IMAGE", images, "image1")
    g.link(second_image, "IMAGE", images, "image2")
    enhancer = _prompt_enhancer(g, "i2i", "Replace costumes for the character", (420, 660), images=images)
    positive = _enhanced_prompt(g, encoder, enhancer, "", references=second)
    sampler = _sampler(g, "QI21Sampler", model, positive, pos=(1340, 400), steps=25, cfg=1.0, width=0, height=0)
    _select_sampler(g, sampler, (1340, 780))
    _save(g, _decode(g, vae, sampler, pos=(1720, 120)), "IMAGE", "qwen-image-2.1/official_image_edit",
          pos=(2020, 120))
    g.note(TEMPLATE_NOTE.format(
        title="image edit", template="image_edit", files=f"`{INT8_MODEL}`, `{INT8_TEXT_ENCODER}`",
        settings="25 steps, cfg 1, euler, references at their own size (resolution 0)", pe=PE_I2I,
        difference=BASE_DIFFERENCE + " The output follows the last reference's size (width/height 0); the prompt "
                   "enhancer sees the images as one batch (core Batch Images, resized to the first)."),
        (0, 660), (400, 460))


def official_background_removal(g: Graph) -> None:
    model, encoder, vae = _template_loaders(g, INT8_MODEL)
    _, reference = _template_reference(g, vae, "angry_broccoli.png", 1, (420, 660))
    positive = _prompt(g, encoder, "Remove the background, and output a PNG image", references=reference)
    sampler = _sampler(g, "QI21Sampler", model, positive, steps=25, cfg=1.0, width=0, height=0)
    _select_sampler(g, sampler, (900, 500))
    decode = _decode(g, vae, sampler)
    _save(g, decode, "RGBA", "qwen-image-2.1/official_background_removal")
    g.note(f"""
## Qwen-Image 2.1 background removal: the official template, with this pack's nodes

The same job as core's `image_qwen_image_2_1_background_removal` template, with the same files (`{INT8_MODEL}`,
`{INT8_TEXT_ENCODER}`), prompt and settings (25 steps, cfg 1, euler, the image at its own size). *VAE Decode*'s
`RGBA` output goes to *Save Image*: a PNG with the alpha channel the model generates.

What ours does differently: {BASE_DIFFERENCE} The image is computed once and cached (`prefix_cache`).
""", (0, 1100), (400, 360))


def official_turbo_t2i(g: Graph) -> None:
    model, encoder, vae = _template_loaders(g, INT8_TURBO_MODEL)
    enhancer = _prompt_enhancer(g, "t2i", "An underground techno event poster: black background, the two-line "
                                "headline \"QWEN IMAGE\" / \"2.1 TURBO\" in heavy white capitals, black-and-white "
                                "halftone portraits, fluorescent orange accents, risograph texture.", (420, 660))
    positive = _enhanced_prompt(g, encoder, enhancer, "")
    sampler = _sampler(g, "QI21TurboSampler", model, positive, pos=(1340, 400), width=1024, height=1024)
    _select_sampler(g, sampler, (1340, 720))
    _turbo_sigmas(g, sampler, (1340, 820))
    _save(g, _decode(g, vae, sampler, pos=(1720, 120)), "IMAGE", "qwen-image-2.1/official_turbo_t2i",
          pos=(2020, 120))
    g.note(TEMPLATE_NOTE.format(
        title="Turbo text to image", template="turbo_t2i", files=f"`{INT8_TURBO_MODEL}`, `{INT8_TEXT_ENCODER}`",
        settings="the stored 8 sigmas (ManualSigmas), euler, no CFG, 1024 x 1024", pe=PE_T2I,
        difference="the Turbo sampler replaces SamplerCustomAdvanced + RandomNoise + CFGGuider (cfg 1: no guidance)."),
        (0, 660), (400, 420))


def official_turbo_image_edit(g: Graph) -> None:
    model, encoder, vae = _template_loaders(g, INT8_TURBO_MODEL)
    image, reference = _template_reference(g, vae, "ballet_dancer_photography_minimalist_architecture.png", 1,
                                           (420, 1500))
    enhancer = _prompt_enhancer(g, "i2i", "Relight the scene as a clear moonlit night with a full moon in the sky "
                                "seen through the oculus; soft blue-silver moonlight on the stone platform and a long "
                                "soft shadow of the dancer. Keep her pose, the architecture and the framing.",
                                (420, 660), images=image)
    positive = _enhanced_prompt(g, encoder, enhancer, "", references=reference)
    sampler = _sampler(g, "QI21TurboSampler", model, positive, pos=(1340, 400), width=0, height=0)
    _select_sampler(g, sampler, (1340, 720))
    _turbo_sigmas(g, sampler, (1340, 820))
    _save(g, _decode(g, vae, sampler, pos=(1720, 120)), "IMAGE", "qwen-image-2.1/official_turbo_image_edit",
          pos=(2020, 120))
    g.note(TEMPLATE_NOTE.format(
        title="Turbo image edit", template="turbo_image_edit", files=f"`{INT8_TURBO_MODEL}`, `{INT8_TEXT_ENCODER}`",
        settings="the stored 8 sigmas, euler, cfg 1, the image at its own size", pe=PE_I2I,
        difference="the Turbo sampler replaces SamplerCustomAdvanced + RandomNoise + CFGGuider (cfg 1: no guidance); "
                   "the output follows the reference's size."),
        (0, 660), (400, 420))


WORKFLOWS = {
    "text_to_image_base": text_to_image_base,
    "text_to_image_turbo": text_to_image_turbo,
    "edit_one_reference": edit_one_reference,
    "edit_three_references": edit_three_references,
    "transparent_rgba_png": transparent_rgba_png,
    "base_speed_lora": base_speed_lora,
    "base_turbo_lora": base_turbo_lora,
    "img2img": img2img,
    "inpaint_with_a_mask": inpaint_with_a_mask,
    "manual_schedule": manual_schedule,
    "controlnet_canny": controlnet_canny,
    "controlnet_inpaint": controlnet_inpaint,
    "official_t2i": official_t2i,
    "official_image_edit": official_image_edit,
    "official_background_removal": official_background_removal,
    "official_turbo_t2i": official_turbo_t2i,
    "official_turbo_image_edit": official_turbo_image_edit,
}


# -- files ----------------------------------------------------------------------------------------------------

def _dumps(data) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def build_graphs(specs: dict[str, NodeSpec] = None) -> dict[str, Graph]:
    specs = specs or load_specs()
    graphs = {}
    for name, build in WORKFLOWS.items():
        graphs[name] = Graph(name, specs)
        build(graphs[name])
    return graphs


def expected_files() -> dict[str, str]:
    """Relative path (under workflows/) -> file text, UI form and API form of every example."""
    files = {}
    for name, graph in build_graphs().items():
        files[f"{name}.json"] = _dumps(graph.ui())
        files[f"{API_FOLDER}/{name}.json"] = _dumps(graph.api())
    return files


def stale(folder: Path = HERE) -> list[str]:
    """What in `folder` differs from the builder's output: changed, missing and unknown workflow files."""
    expected = expected_files()
    problems = []
    for relative, text in expected.items():
        path = folder / relative
        if not path.is_file():
            problems.append(f"{relative}: missing")
        elif path.read_text(encoding="utf-8") != text:
            problems.append(f"{relative}: differs from the builder's output")
    on_disk = [*folder.glob("*.json"), *(folder / API_FOLDER).glob("*.json")]
    problems += [f"{p.relative_to(folder).as_posix()}: not written by the builder"
                 for p in sorted(on_disk) if p.relative_to(folder).as_posix() not in expected]
    return problems


def write(folder: Path = HERE) -> list[str]:
    written = []
    for relative, text in expected_files().items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            written.append(relative)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the files on disk are not up to date")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale()
        for problem in problems:
            print(f"stale: {problem}", file=sys.stderr)
        if problems:
            print("run: python workflows/build_workflows.py", file=sys.stderr)
        return 1 if problems else 0
    written = write()
    print("\n".join(f"wrote workflows/{r}" for r in written) or "workflows are up to date")
    leftovers = [p for p in stale() if p.endswith("not written by the builder")]
    for problem in leftovers:
        print(f"warning: {problem} (delete it or add it to WORKFLOWS)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
