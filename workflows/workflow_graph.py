"""The workflow graphs' vocabulary: node shapes (ours from their `define_schema()`, core's by hand in CORE_NODES),
a `Graph` that adds nodes and links by name and writes both of ComfyUI's forms (UI and API), the released file
names with their download addresses, and the node chains every example shares. `build_workflows.py` builds the
examples with it, `official_templates.py` the counterparts of the official templates.
"""

import importlib.util
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from workflow_layout import GROUP_COLOR, Group, lay_out, overlaps

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

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
    multiline: bool = False  # a text box, taller than a one-line widget (workflow_layout.min_height)


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
    NodeSpec("MarkdownNote", "Markdown Note", widgets=(Widget("text", "STRING", "", multiline=True),), in_api=False,
             widget_sockets=False),
    NodeSpec("Note", "Note", widgets=(Widget("text", "STRING", "", multiline=True),), in_api=False,
             widget_sockets=False),
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
             widgets=(Widget("prompt", "STRING", "", multiline=True), Widget("max_length", "INT", 512),
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
    NodeSpec("PrimitiveStringMultiline", "Text (Multiline)", widgets=(Widget("value", "STRING", "", multiline=True),),
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
        widgets=tuple(Widget(i.id, i.io_type, i.default, bool(i.optional), bool(option(i, "control_after_generate")),
                             multiline=bool(option(i, "multiline")))
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
        self.groups: list[Group] = []

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

    def group(self, title: str, *nodes: Node) -> None:
        """A titled frame around `nodes` (placed by `arrange`), as core's templates frame theirs."""
        self.groups.append(Group(title, list(nodes)))

    def arrange(self) -> None:
        """Lay the nodes out on the grid (workflow_layout.py); refuses a layout where anything overlaps."""
        lay_out(self.nodes, self.groups)
        if problems := overlaps(*self.layout_view()):
            raise ValueError(f"{self.name}: " + "; ".join(problems))

    def layout_view(self) -> tuple[list, list]:
        """(name, pos, size) of every node and (title, bounding, member names) of every group."""
        name = {id(n): f"#{n.id} {n.title or n.spec.display_name}" for n in self.nodes}
        return ([(name[id(n)], n.pos, n.size) for n in self.nodes],
                [(g.title, g.bounding, {name[id(n)] for n in g.nodes}) for g in self.groups])

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
            "groups": [{"id": i, "title": g.title, "bounding": list(g.bounding), "color": GROUP_COLOR, "flags": {}}
                       for i, g in enumerate(self.groups, 1)],
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


# -- node chains the graphs share -------------------------------------------------------------------------
# Columns: loaders at x=0, images/references/prompts at x=420, sampler at x=900, decode at x=1280, outputs at 1600.

def add_loaders(g: Graph, model_file: str, text_encoder: str = TEXT_ENCODER) -> tuple[Node, Node, Node]:
    model = g.add("QI21ModelLoader", (0, 120), (340, 130), model_name=model_file)
    encoder = g.add("QI21TextEncoderLoader", (0, 300), (340, 130), text_encoder_name=text_encoder)
    vae = g.add("QI21VAELoader", (0, 480), (340, 110), vae_name=VAE_FILE)
    return model, encoder, vae


def add_prompt(g: Graph, encoder: Node, text: str, pos=(420, 120), references: Node = None) -> Node:
    node = g.add("QI21TextEncode", pos, (420, 200), prompt=text)
    g.link(encoder, "text_encoder", node, "text_encoder")
    if references is not None:
        g.link(references, "references", node, "references")
    return node


def add_sampler(g: Graph, node_type: str, model: Node, positive: Node, pos=(900, 120), **values) -> Node:
    size = (320, 330) if node_type == "QI21Sampler" else (320, 260)
    node = g.add(node_type, pos, size, seed=SEED, **values)
    g.link(model, "model", node, "model")
    g.link(positive, "conditioning", node, "positive")
    return node


def add_decode(g: Graph, vae: Node, latent: Node, pos=(1280, 120)) -> Node:
    node = g.add("QI21VAEDecode", pos, (260, 120))
    g.link(vae, "vae", node, "vae")
    g.link(latent, "LATENT", node, "samples")
    return node


def add_save(g: Graph, decode: Node, output: str, prefix: str, pos=(1600, 120)) -> Node:
    node = g.add("SaveImage", pos, (480, 520), filename_prefix=prefix)
    g.link(decode, output, node, "images")
    return node


def add_reference(g: Graph, vae: Node, image_file: str, index: int, pos, previous: Node = None,
                  **values) -> tuple[Node, Node]:
    """Load Image -> Reference `<image{index}>` (chained after `previous`): `(image, reference)`."""
    x, y = pos
    image = g.add("LoadImage", (x, y), (320, 360), title=f"Load Image (<image{index}>)", image=image_file)
    reference = g.add("QI21Reference", (x + 360, y), (320, 150), title=f"Reference <image{index}>", **values)
    g.link(vae, "vae", reference, "vae")
    g.link(image, "IMAGE", reference, "image")
    g.link(image, "MASK", reference, "mask")
    if previous is not None:
        g.link(previous, "references", reference, "references")
    return image, reference
