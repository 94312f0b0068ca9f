"""The headless workflow runner: an API-format workflow run node by node through the pack's own node classes and
the core nodes demo/core_nodes.py and demo/core_standins.py implement, with loaders' outputs reused across
workflows. The command line around it is run_workflows.py."""

import heapq
import inspect
import json
import math
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from ..model.encoders.references import MIN_VLM_PIXELS, reference_size
from ..nodes import NODES, bridge
from ..nodes.validation import widget_option, widget_problem
from . import core_standins
from .core_nodes import (
    WorkflowError,
    core_schemas,
    input_file_name,
    load_image,
    manual_sigmas,
    save_images,
    save_latent,
    set_latent_noise_mask,
)

TINY_BANNER = "USING A SMALL RANDOM CHECKPOINT: images are noise; pass --models for real weights"
#: Limits of a quick run (always in tiny mode: the random model gives noise at any size, so run small).
QUICK_MAX_SIDE = 256  # sampler width/height (the samplers' minimum size)
QUICK_MAX_STEPS = 4  # Base sampler steps (Turbo always runs its 8 stored sigmas)
QUICK_REFERENCE_RESOLUTION = 256  # raised per image until the vision processor's 65536-pixel minimum is met
QUICK_NOTE = (f"quick run: sampler width/height capped at {QUICK_MAX_SIDE} (0 without references -> {QUICK_MAX_SIDE}), "
              f"Base steps capped at {QUICK_MAX_STEPS}, reference resolution capped at ~{QUICK_REFERENCE_RESOLUTION}")
LOADERS = ("QI21ModelLoader", "QI21TextEncoderLoader", "QI21VAELoader")  # outputs reused across workflows


def _io_type(port) -> str:
    value = getattr(port, "io_type", None)
    return value if isinstance(value, str) else port.get_io_type()


def _is_link(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[1], int) and not isinstance(value[1], bool)


def _node_order_key(node_id: str):
    return (0, int(node_id), "") if node_id.isdigit() else (1, 0, node_id)


def load_workflow(path: Path) -> dict[str, dict]:
    """`{node id: {"class_type", "inputs"}}` from an API-format file (or a /prompt request body holding one)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WorkflowError(f"cannot read {path.name}: {error}") from error
    if isinstance(data, dict) and isinstance(data.get("prompt"), dict):
        data = data["prompt"]
    if isinstance(data, dict) and isinstance(data.get("nodes"), list) and "links" in data:
        raise WorkflowError(f"{path.name} is a UI-format workflow (nodes + links); this runner needs the API format "
                            "(ComfyUI: Workflow > Export (API)).")
    if not isinstance(data, dict):
        raise WorkflowError(f"{path.name} is not an API-format workflow (a JSON object of nodes).")
    nodes = {str(k): v for k, v in data.items() if isinstance(v, dict) and "class_type" in v}
    if not nodes:
        raise WorkflowError(f"{path.name} holds no nodes (no entries with a class_type).")
    for node_id, node in nodes.items():
        if not isinstance(node.get("inputs", {}), dict):
            raise WorkflowError(f"node {node_id} ({node['class_type']}): inputs must be a JSON object.")
    return nodes


# -- the runner ------------------------------------------------------------------------------------------------
@dataclass
class WorkflowResult:
    name: str
    ok: bool = False
    seconds: float = 0.0
    images: list = field(default_factory=list)
    reports: list = field(default_factory=list)  # (node id, the qi21_report list, its JSON file)
    notes: list = field(default_factory=list)
    error: str | None = None
    details: str | None = None
    skipped: str | None = None  # why it needs a real ComfyUI (its prompt enhancer is switched on)
    prompts: list = field(default_factory=list)  # what each QI21TextEncode node encoded
    loaded: list = field(default_factory=list)  # the files its LoadImage nodes read, in the order they ran
    references: int = 0  # how many QI21Reference nodes ran
    drew: str | None = None  # on the toy: "yes" / "no" / "n/a" (run_workflows.py judges it)
    drew_detail: str = ""  # what was asked and what was seen, or why it was not judged


class Runner:
    """Validates and executes API-format workflows through the pack's node classes and the core nodes above."""

    def __init__(self, out_dir: Path, input_dir: Path, quick: bool, verbose: bool = False, log=print,
                 overrides=None):
        """`overrides(workflow name, class_type, kwargs) -> [changes]` rewrites node inputs before they run (the
        toy's prompts and sizes, demo/toy_workflows.py); its changes are noted like the quick run's."""
        self.out_dir, self.input_dir, self.quick, self.verbose, self.log = out_dir, input_dir, quick, verbose, log
        self.overrides = overrides
        self.classes = {cls.define_schema().node_id: cls for cls in NODES}  # after set_models_root: combo lists
        self.schemas = {node_id: cls.define_schema() for node_id, cls in self.classes.items()}
        self.schemas.update(core_schemas())
        self.schemas.update(core_standins.schemas())
        self.loader_cache: dict[tuple, tuple] = {}

    # validation ---------------------------------------------------------------------------------------------
    def _schema(self, node_id: str, node: dict):
        schema = self.schemas.get(node["class_type"])
        if schema is None:
            raise WorkflowError(
                f"node {node_id}: {node['class_type']!r} is neither a Qwen-Image 2.1 node nor a core node this runner "
                f"implements ({', '.join(sorted(self.schemas))}).")
        return schema

    def _needed(self, nodes: dict) -> list[str]:
        """Nodes that lead to an output node, in dependency order (ComfyUI runs nothing else)."""
        outputs = [i for i, node in nodes.items() if self._schema(i, node).is_output_node]
        if not outputs:
            raise WorkflowError("the workflow has no output node (SaveImage, PreviewImage or MaskPreview), so ComfyUI "
                                "would run nothing.")
        untaken = core_standins.untaken_inputs(nodes)
        needed, stack = set(), list(outputs)
        while stack:
            node_id = stack.pop()
            if node_id in needed:
                continue
            needed.add(node_id)
            for name, value in nodes[node_id].get("inputs", {}).items():
                if _is_link(value) and untaken.get(node_id) != name:  # a switch's other branch never runs
                    source = str(value[0])
                    if source not in nodes:
                        raise WorkflowError(f"node {node_id} ({nodes[node_id]['class_type']}): input {name!r} links to "
                                            f"node {source}, which is not in the workflow.")
                    stack.append(source)
        users = {i: [] for i in needed}
        waiting = {i: 0 for i in needed}
        for node_id in needed:
            for name, value in nodes[node_id].get("inputs", {}).items():
                if _is_link(value) and untaken.get(node_id) != name:
                    users[str(value[0])].append(node_id)
                    waiting[node_id] += 1
        ready = [(_node_order_key(i), i) for i, count in waiting.items() if count == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            _, node_id = heapq.heappop(ready)
            order.append(node_id)
            for user in users[node_id]:
                waiting[user] -= 1
                if waiting[user] == 0:
                    heapq.heappush(ready, (_node_order_key(user), user))
        if len(order) != len(needed):
            raise WorkflowError("the links form a cycle through nodes " + ", ".join(sorted(set(needed) - set(order))))
        return order

    def validate(self, nodes: dict, order: list[str], notes: list[str]) -> None:
        """Everything ComfyUI checks before running, all problems reported at once."""
        problems = []
        untaken = _upstream(nodes, [nodes[i]["inputs"][name] for i, name in core_standins.untaken_inputs(nodes).items()
                                    if i in order and _is_link(nodes[i]["inputs"].get(name))]) - set(order)
        for node_id, node in nodes.items():
            if node_id in untaken:
                notes.append(f"node {node_id} ({node['class_type']}) feeds only a switch's branch that is off, so it "
                             "does not run (ComfyUI's switch is lazy; ComfyUI still checks its inputs, this runner "
                             "does not)")
            elif node_id not in order:
                notes.append(f"node {node_id} ({node['class_type']}) leads to no output node; ComfyUI would skip it")
        for node_id in order:
            node, schema = nodes[node_id], self._schema(node_id, nodes[node_id])
            where = f"node {node_id} ({node['class_type']})"
            values = node.get("inputs", {})
            known = {port.id for port in schema.inputs}
            extra = sorted(set(values) - known)
            if extra and node["class_type"] in self.classes:
                notes.append(f"{where}: inputs {extra} are not in the schema; ComfyUI ignores them")
            widgets, before = {}, len(problems)
            for port in schema.inputs:
                name = port.id
                if name not in values:
                    if not port.optional:
                        problems.append(f"{where}: required input {name!r} is missing")
                    continue
                value = values[name]
                if _is_link(value):
                    problems.extend(self._check_link(nodes, where, name, port, value))
                else:
                    problem = self._check_widget(port, value)
                    if problem:
                        problems.append(f"{where}: {name} = {value!r}: {problem}")
                    else:
                        widgets[name] = value
            cls = self.classes.get(node["class_type"])
            if cls is not None and len(problems) == before:
                try:  # ComfyUI calls it with the widget values; a linked argument it declares means: skip
                    inspect.signature(cls.validate_inputs).bind(**widgets)
                except TypeError:
                    continue
                verdict = cls.validate_inputs(**widgets)
                if verdict is not True:
                    problems.append(f"{where}: {verdict}")
        if problems:
            raise WorkflowError("invalid workflow:\n  " + "\n  ".join(problems))

    def _check_link(self, nodes, where, name, port, value) -> list[str]:
        source, slot = str(value[0]), value[1]
        outputs = self._schema(source, nodes[source]).outputs
        if not 0 <= slot < len(outputs):
            return [f"{where}: input {name!r} reads output {slot} of node {source} ({nodes[source]['class_type']}), "
                    f"which has {len(outputs)} outputs"]
        got, wanted = _io_type(outputs[slot]), _io_type(port)
        if got != wanted and "*" not in (got, wanted):
            return [f"{where}: input {name!r} wants {wanted} but node {source} ({nodes[source]['class_type']}) "
                    f"output {slot} is {got}"]
        return []

    @staticmethod
    def _check_widget(port, value) -> str | None:
        """What ComfyUI checks of one widget value: its type (here), then its combo list and min/max through the
        nodes' own check (nodes/validation.py, what the loaders and samplers run), worded for this runner."""
        kind = _io_type(port)
        if kind in ("INT", "FLOAT") and (isinstance(value, bool) or not isinstance(value, (int, float))
                                         or (kind == "INT" and not float(value).is_integer())):
            return f"expected {kind}"
        if kind == "BOOLEAN" and not isinstance(value, bool):
            return "expected true or false"
        if kind == "STRING" and not isinstance(value, str):
            return "expected a string"
        if kind not in ("COMBO", "INT", "FLOAT") or _widget_fits(port, value):
            return None
        if kind == "COMBO":
            choices = list(widget_option(port, "options") or ())
            shown = ", ".join(map(str, choices[:8])) + (" ..." if len(choices) > 8 else "")
            return f"not among the choices ({shown})"
        return f"outside [{widget_option(port, 'min')}, {widget_option(port, 'max')}]"

    # execution ----------------------------------------------------------------------------------------------
    def _inputs(self, nodes, node_id, schema, outputs) -> dict:
        values = nodes[node_id].get("inputs", {})
        kwargs = {}
        for port in schema.inputs:
            if port.id in values:
                value = values[port.id]
                if _is_link(value):
                    if str(value[0]) not in outputs:  # a switch's branch that is off: never evaluated
                        continue
                    value = outputs[str(value[0])][value[1]]
                    if value is None:  # an optional output left empty upstream: as if unconnected
                        continue
                elif _io_type(port) == "INT" and isinstance(value, float):
                    value = int(value)
                kwargs[port.id] = value
            elif port.default is not None:
                kwargs[port.id] = port.default
        return kwargs

    def _quick_overrides(self, class_type: str, kwargs: dict) -> list[str]:
        """Shrink the work (tiny mode, --quick); returns what was changed."""
        changed = []

        def cap(name, value):
            if kwargs.get(name) != value:
                changed.append(f"{name} {kwargs.get(name)} -> {value}")
                kwargs[name] = value

        if class_type in ("QI21Sampler", "QI21TurboSampler"):
            has_references = bool(getattr(kwargs.get("positive"), "ref_shapes", ()))
            for name in ("width", "height") if kwargs.get("latent_image") is None else ():  # a latent sets the size
                value = kwargs.get(name, 0)
                cap(name, (0 if has_references else QUICK_MAX_SIDE) if value == 0 else min(value, QUICK_MAX_SIDE))
            if class_type == "QI21Sampler":
                cap("steps", min(kwargs.get("steps", QUICK_MAX_STEPS), QUICK_MAX_STEPS))
        elif (class_type in LOADERS and kwargs.get("weight_dtype", "fp32") != "fp32"
              and bridge.compute_device().type == "cpu"):
            # CPUs without native bf16 run bf16 matmuls ~20x and convolutions (aten::_slow_conv2d_forward) ~15x
            # slower than fp32, and the loaders' "default" keeps the files' bf16
            cap("weight_dtype", "fp32")
        elif class_type == "QI21Reference" and isinstance(kwargs.get("image"), torch.Tensor):
            height, width = kwargs["image"].shape[-3:-1]
            smallest = QUICK_REFERENCE_RESOLUTION
            while smallest < 4096 and math.prod(reference_size(width, height, smallest)) < MIN_VLM_PIXELS:
                smallest += 32
            resolution = kwargs.get("resolution", 1024)
            if resolution == 0 or resolution > smallest:
                cap("resolution", smallest)
        return changed

    def _execute(self, node_id: str, node: dict, kwargs: dict, workflow: dict, folder: Path, result: WorkflowResult):
        class_type = node["class_type"]
        if class_type == "LoadImage":
            result.loaded.append(input_file_name(kwargs["image"]))
            return load_image(self.input_dir / result.loaded[-1])
        if class_type in core_standins.RUNS:
            output = core_standins.RUNS[class_type](**kwargs)
            if class_type == "PreviewAny":
                result.notes.append(f"node {node_id} (PreviewAny) shows {output[0][:80]!r}")
            return output
        if class_type == "SetLatentNoiseMask":
            return set_latent_noise_mask(**kwargs)
        if class_type == "ManualSigmas":
            return manual_sigmas(**kwargs)
        if class_type == "SaveLatent":
            result.images += save_latent(kwargs["samples"], folder, kwargs.get("filename_prefix", "latents/ComfyUI"))
            return ()
        if class_type in ("SaveImage", "PreviewImage", "MaskPreview"):
            prefix = kwargs.get("filename_prefix", "ComfyUI") if class_type == "SaveImage" else f"preview_{node_id}"
            images = kwargs["mask"] if class_type == "MaskPreview" else kwargs["images"]
            if class_type == "MaskPreview":  # as ComfyUI shows a MASK: grey levels, 1 (transparent) = white
                images = images.reshape(-1, 1, *images.shape[-2:]).movedim(1, -1).expand(-1, -1, -1, 3)
            result.images += save_images(images, folder, prefix, workflow)
            return ()
        cache_key = self._loader_key(class_type, kwargs) if class_type in LOADERS else None
        if cache_key in self.loader_cache:
            return self.loader_cache[cache_key]
        output = self.classes[class_type].execute(**kwargs)
        args = tuple(output) if isinstance(output, tuple) else tuple(getattr(output, "args", ()) or ())
        reports = (getattr(output, "ui", None) or {}).get("qi21_report")
        if reports is not None:
            path = folder / f"qi21_report_{node_id}.json"
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(reports, indent=2) + "\n", encoding="utf-8")
            result.reports.append((node_id, reports, path))
        if cache_key is not None:
            self.loader_cache[cache_key] = args
        return args

    def run(self, path: Path) -> WorkflowResult:
        result = WorkflowResult(path.stem)
        start = time.perf_counter()
        current = None
        try:
            nodes = load_workflow(path)
            order = self._needed(nodes)
            enhancer = sorted({nodes[i]["class_type"] for i in order} & core_standins.PROMPT_ENHANCER)
            if enhancer:  # a language model writes its prompt: only ComfyUI loads one (tests/test_comfyui_server.py)
                result.skipped = (f"its prompt enhancer is switched on: {', '.join(enhancer)} run a language model "
                                  "(the PE file) that only ComfyUI loads; switch it off to run it here")
                result.seconds = time.perf_counter() - start
                return result
            self.validate(nodes, order, result.notes)
            self._keep_loaded(nodes, order, path.stem)
            folder = self.out_dir / path.stem
            outputs: dict[str, tuple] = {}
            for node_id in order:
                current = node_id
                node = nodes[node_id]
                kwargs = self._inputs(nodes, node_id, self.schemas[node["class_type"]], outputs)
                if self.quick:
                    changed = self._quick_overrides(node["class_type"], kwargs)
                    if changed:
                        result.notes.append(f"node {node_id} ({node['class_type']}): {', '.join(changed)} (quick run)")
                if self.overrides is not None:
                    changed = self.overrides(path.stem, node["class_type"], kwargs)
                    if changed:
                        result.notes.append(f"node {node_id} ({node['class_type']}): {', '.join(changed)} "
                                            "(rewritten for this run)")
                if node["class_type"] == "QI21TextEncode" and isinstance(kwargs.get("prompt"), str):
                    result.prompts.append(kwargs["prompt"])
                result.references += node["class_type"] == "QI21Reference"
                tick = time.perf_counter()
                outputs[node_id] = self._execute(node_id, node, kwargs, nodes, folder, result)
                if self.verbose:
                    self.log(f"    node {node_id:>3} {node['class_type']:<22} {time.perf_counter() - tick:7.2f} s")
            result.ok = True
        except Exception as error:  # one broken workflow must not stop the others
            where = f"node {current} ({nodes[current]['class_type']}): " if current is not None else ""
            reason = str(error) if isinstance(error, WorkflowError) else f"{type(error).__name__}: {error}"
            result.error = where + reason
            result.details = None if isinstance(error, WorkflowError) else traceback.format_exc()
        result.seconds = time.perf_counter() - start
        return result

    def _keep_loaded(self, nodes: dict, order: list[str], workflow: str) -> None:
        """Drop the loaded models this workflow does not use (real weights are tens of GB); keep the others."""
        wanted = set()
        for node_id in order:
            class_type = nodes[node_id]["class_type"]
            if class_type in LOADERS:  # loaders take widget values, so their inputs are known up front
                try:
                    kwargs = self._inputs(nodes, node_id, self.schemas[class_type], {})
                except KeyError:  # a linked loader input: its output is not reused
                    continue
                if self.quick:
                    self._quick_overrides(class_type, kwargs)  # the key the loader will be cached under
                if self.overrides is not None:
                    self.overrides(workflow, class_type, kwargs)
                wanted.add(self._loader_key(class_type, kwargs))
        for key in list(self.loader_cache):
            if key not in wanted:
                del self.loader_cache[key]

    def _loader_key(self, class_type: str, kwargs: dict) -> tuple:
        """A loader's output is reused while its inputs and its file's fingerprint (`fingerprint_inputs`: size,
        mtime, digest) are the same, as ComfyUI's node cache does: a file replaced on disk is loaded again."""
        fingerprint = self.classes[class_type].fingerprint_inputs(**kwargs)
        return class_type, json.dumps(kwargs, sort_keys=True, default=str), fingerprint


def _upstream(nodes: dict, links: list) -> set[str]:
    """The ids of the nodes these links read, and of everything those read."""
    seen, stack = set(), [str(link[0]) for link in links]
    while stack:
        node_id = stack.pop()
        if node_id in nodes and node_id not in seen:
            seen.add(node_id)
            stack += [str(v[0]) for v in nodes[node_id].get("inputs", {}).values() if _is_link(v)]
    return seen


def _widget_fits(port, value) -> bool:
    """`widget_problem` of nodes/validation.py for one input of any schema (ours or a core node's here)."""
    one_input = SimpleNamespace(define_schema=lambda: SimpleNamespace(inputs=[port]))
    return widget_problem(one_input, **{port.id: value}) is True
