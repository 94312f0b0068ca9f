"""ComfyUI's per-layer quantized checkpoints (int8 ConvRot, fp8, W4A8, ConvRot W4A4, NVFP4, MXFP8): reading and
checking them. What each format is and how it runs: layers/formats.py.

What is on disk (docs/checkpoints.md, "Quantized files"): next to each quantized Linear `L` the file holds
`L.weight` in the format's storage dtype, its scales (`L.weight_scale`, `L.input_scale`, NVFP4's
`L.weight_scale_2`, W4A8's `L.weight_s_rel` / `L.weight_s_channel` / `L.weight_codebook`), and a description of the
layer: a `L.comfy_quant` tensor of UTF-8 JSON bytes, or the same JSON under `layers` in the header metadata
`_quantization_metadata`. Legacy scaled-fp8 files instead carry a `scaled_fp8` marker tensor and
`L.scale_weight` / `L.scale_input`.

`plan_quantization` reads the descriptions (small JSON blobs; no weight is read) and checks every quantized
layer from the headers alone (the format's own `check`): a known format, every scale present with the shape and
dtype the format needs, nothing left over, a format comfy-kitchen can run here. Only then do the loaders read
weights. A quantized layer becomes a `QuantLinear` (a `Linear`, so LoRA adapters and the DiT's row-range calls
work unchanged) or, for a text encoder's token table, a `QuantEmbedding`. Each file tensor stays one segment of
its own, in its stored dtype and with its own scales (the fused [q; k; v] of the DiT is three file tensors, each
with its own scale), so the parameter bytes are the file's payload and nothing is upcast. comfy-kitchen itself is
imported lazily, only when a file has a format that needs it (fp8 does not).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..layers.formats import FLOATS, FORMATS, FP8_FORMATS, kitchen
from ..layers.kitchen import QuantEmbedding, QuantLinear
from ..layers.linear import Linear
from .finite import check_finite
from .safetensors_io import CheckpointError, TensorInfo, parse_json_object, shown

MAX_DESCRIPTION_BYTES = 64 * 1024  # a layer's JSON description is tens of bytes
# Per-layer keys of a quantized Linear, by role (every role any format has); the legacy scaled-fp8 names are aliases.
ROLES = tuple(dict.fromkeys(role for fmt in FORMATS.values() for role in (*fmt.required, *fmt.optional)))
ALIASES = {"scale_weight": "weight_scale", "scale_input": "input_scale"}
DESCRIPTION = "comfy_quant"
LEGACY_MARKER = "scaled_fp8"


# -- reading the descriptions -----------------------------------------------------------------------------------
def _role_of(key: str) -> tuple[str, str] | None:
    """(layer, role) of a quantization key `L.<role>` (aliases resolved), None for any other key."""
    layer, _, suffix = key.rpartition(".")
    if not layer:
        return None
    if suffix in ROLES:
        return layer, suffix
    if suffix in ALIASES:
        return layer, ALIASES[suffix]
    return None


def _is_marker(key: str) -> bool:
    return key == LEGACY_MARKER or key.endswith("." + LEGACY_MARKER)


def _descriptions(tensors: dict[str, TensorInfo], metadata: dict, read: Callable, where: str,
                  rename: Callable[[str], str]) -> dict[str, dict]:
    """{layer: description dict} from the header metadata, the `comfy_quant` tensors and the legacy marker."""
    found: dict[str, dict] = {}

    def add(layer: str, description, source: str) -> None:
        if not isinstance(description, dict) or not isinstance(description.get("format"), str):
            raise CheckpointError(f"{where}: {source} does not describe a quantized layer (a JSON object with a "
                                  "\"format\"); the file is damaged. Download it again.")
        if layer in found and found[layer].get("format") != description["format"]:
            raise CheckpointError(f"{where}: {layer} is described as {shown(found[layer]['format'])} and as "
                                  f"{shown(description['format'])}; the file contradicts itself. Download it again.")
        found[layer] = {**found.get(layer, {}), **description}

    if "_quantization_metadata" in metadata:
        data = parse_json_object(metadata["_quantization_metadata"].encode("utf-8"), where,
                                 "_quantization_metadata header entry", 8)
        layers = data.get("layers")
        if not isinstance(layers, dict):
            raise CheckpointError(f"{where}: the header's _quantization_metadata has no \"layers\" object; the file "
                                  "is damaged. Download it again.")
        for name, description in layers.items():
            add(rename(name), description, f"_quantization_metadata layer {shown(name)}")
    for key, info in tensors.items():
        if not key.endswith("." + DESCRIPTION):
            continue
        if info.dtype != "U8" or len(info.shape) != 1 or info.shape[0] > MAX_DESCRIPTION_BYTES:
            raise CheckpointError(f"{where}: {key} is {info.dtype} {list(info.shape)}; a layer description is a short "
                                  "1-D U8 tensor of JSON bytes. The file is damaged; download it again.")
        raw = bytes(read(key).numpy().tobytes())
        add(key[: -len(DESCRIPTION) - 1], parse_json_object(raw, where, f"{key} description", 8), key)
    markers = [key for key in tensors if _is_marker(key)]
    if markers and "_quantization_metadata" not in metadata:
        # ComfyUI's legacy scaled fp8: every layer with a scale_weight is fp8 in its weight's own dtype; a marker of
        # 2 elements asked for the matrix multiplication in full precision.
        full = math.prod(tensors[markers[0]].shape) == 2
        fp8 = {fmt.weight_dtypes[0] for fmt in FP8_FORMATS.values()}
        unscaled = sorted(key for key, info in tensors.items() if key.endswith(".weight") and info.dtype in fp8
                          and key[: -len(".weight")] + ".scale_weight" not in tensors)
        if unscaled:
            raise CheckpointError(f"{where}: {unscaled[0]} is a scaled-fp8 weight (the file has a {markers[0]} "
                                  f"marker) without its {unscaled[0][: -len('.weight')]}.scale_weight; the file is "
                                  "incomplete. Download it again.")
        for key in tensors:
            if key.endswith(".scale_weight"):
                layer = key[: -len(".scale_weight")]
                weight = tensors.get(layer + ".weight")
                fmt = next((name for name, f in FP8_FORMATS.items() if weight and weight.dtype in f.weight_dtypes),
                           f"scaled fp8 with a {weight.dtype if weight else 'missing'} weight")
                add(layer, {"format": fmt, "full_precision_matrix_mult": full}, key)
    return found


# -- checking a layer -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantLayer:
    """One quantized Linear (or embedding) of a file: its format, the file key of each role, options, and its
    logical `[out, in]` shape."""

    name: str
    fmt: str
    keys: dict
    options: dict
    shape: tuple[int, int]


class _Checker:
    """One layer's header checks for its format's `check` (formats.py); every message names the file, the key, the
    format and what to do."""

    def __init__(self, where: str, name: str, fmt: str, description: dict, tensors: dict, keys: dict, instead: str):
        self.where, self.name, self.fmt, self.instead = where, name, fmt, instead
        self.tensors, self.keys = tensors, keys
        params = description.get("params")
        self.description, self.params = description, params if isinstance(params, dict) else {}

    def fail(self, problem: str):
        raise CheckpointError(f"{self.where}: {problem}. The file is damaged or incomplete; download it again, or use "
                              f"{self.instead}.")

    def has(self, role: str) -> bool:
        return role in self.keys

    def info(self, role: str) -> TensorInfo:
        return self.tensors[self.keys[role]]

    def expect(self, role: str, dtypes: tuple[str, ...], shapes: tuple[tuple[int, ...], ...], what: str) -> None:
        info = self.info(role)
        if info.dtype not in dtypes or tuple(info.shape) not in shapes:
            self.fail(f"{self.keys[role]} is {info.dtype} {list(info.shape)}, but a {self.fmt} layer needs {what}")

    def option(self, key: str, default):
        return self.description.get(key, self.params.get(key, default))

    def int_option(self, key: str, default: int) -> int:
        value = self.option(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 1 << 20:
            raise CheckpointError(f"{self.where}: {self.name} has {key} = {shown(value)}; expected a positive integer. "
                                  "The file is damaged; download it again.")
        return value

    @staticmethod
    def show(value) -> str:
        """`value` for a message, cut short (a file's text can be long)."""
        return shown(value)


def _check_layer(layer: str, description: dict, keys: dict, tensors: dict, where: str, instead: str) -> QuantLayer:
    name = description["format"]
    spec = FORMATS[name]
    check = _Checker(where, layer, name, description, tensors, keys, instead)
    for role in spec.required:
        if role not in keys:
            check.fail(f"the {name} layer {layer} has no {layer}.{role}")
    extra = sorted(set(keys) - {"weight", *spec.required, *spec.optional})
    if extra:
        check.fail(f"{keys[extra[0]]} does not belong to a {name} layer")
    weight = check.info("weight")
    if weight.dtype not in spec.weight_dtypes or len(weight.shape) != 2:
        check.fail(f"{keys['weight']} is {weight.dtype} {list(weight.shape)}, but a {name} weight is a 2-D "
                   f"{' or '.join(spec.weight_dtypes)} tensor")
    rows, cols = weight.shape
    inputs = cols * spec.packed
    options = {"full_precision": bool(check.option("full_precision_matrix_mult", False)),
               **spec.check(check, rows, inputs)}
    return QuantLayer(layer, name, dict(keys), options, (rows, inputs))


# -- the plan -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantPlan:
    """The quantized layers of one checkpoint, checked; `layers` is keyed by the weight's file key."""

    where: str
    layers: dict
    consumed: frozenset  # scale, description and marker keys: not weights of the model
    markers: frozenset  # of those, the keys that are no model data (JSON descriptions, the scaled_fp8 marker)
    float_dtype: str  # the stored dtype of the file's unquantized weights (the "default" compute dtype)

    @property
    def formats(self) -> list[str]:
        return sorted({layer.fmt for layer in self.layers.values()})

    def logical(self, tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
        """`tensors` as the model sees them: scales and descriptions dropped, each quantized weight with its
        logical `[out, in]` shape and the file's float dtype (what the shape checks and config inference read)."""
        out = {}
        for key, info in tensors.items():
            if key in self.consumed:
                continue
            layer = self.layers.get(key)
            out[key] = info if layer is None else TensorInfo(self.float_dtype, layer.shape, info.file)
        return out

    def covers(self, keys) -> bool:
        return any(key in self.layers for key in keys)

    def check_targets(self, model: nn.Module, plan: dict, allow_embedding: str | None = None) -> None:
        """Refuse, before any weight is read, a quantized tensor that is not a Linear weight of `model` (`plan`:
        our parameter name -> file keys). `allow_embedding` names the one token table that may be quantized."""
        for name, keys in plan.items():
            keys = [keys] if isinstance(keys, str) else keys
            hits = [key for key in keys if key in self.layers]
            if not hits:
                continue
            path, _, attr = name.rpartition(".")
            module = model.get_submodule(path) if path else model
            if attr != "weight":
                raise CheckpointError(f"{self.where}: {hits[0]} is quantized ({self.layers[hits[0]].fmt}) but is "
                                      "not a Linear weight; this pack cannot run that file. Use the bf16 release.")
            if isinstance(module, (Linear, nn.Linear)):
                continue
            if path == allow_embedding and isinstance(module, nn.Embedding) \
                    and FORMATS[self.layers[hits[0]].fmt].embedding:
                continue
            raise CheckpointError(f"{self.where}: {hits[0]} is quantized as {self.layers[hits[0]].fmt}, which this "
                                  f"pack runs only for Linear layers (and int8/fp8 token tables); {path} is a "
                                  f"{type(module).__name__}. Use the bf16 release.")

    def fill_linear(self, model: nn.Module, name: str, keys, read: Callable, compute: torch.dtype, device,
                    bias_key: str | None = None) -> bool:
        """Replace the (meta) module owning parameter `name` with a `QuantLinear` (or `QuantEmbedding`) read from
        the file keys `keys` (rows in order); False when none of them is quantized. `read(key)` returns the stored
        tensor (a view of the file): each is copied once, in its own dtype, onto `device`."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        if not self.covers(keys):
            return False
        path = name.rpartition(".")[0]
        old = model.get_submodule(path)
        if isinstance(old, nn.Embedding):
            new = QuantEmbedding(old.num_embeddings, old.embedding_dim, compute, old.padding_idx, device)
            layer = self.layers[keys[0]]
            new.add_segment(layer.fmt, _read_roles(layer, read, device, self.where), layer.options)
        else:
            out_features, in_features = old.weight.shape
            new = QuantLinear(in_features, out_features, compute)
            for key in keys:
                layer = self.layers.get(key)
                if layer is None:
                    new.add_segment("float", {"weight": read(key).to(device=device, dtype=compute, copy=True)}, {})
                else:
                    new.add_segment(layer.fmt, _read_roles(layer, read, device, self.where), layer.options)
            if new.segments[-1].end != out_features:
                raise CheckpointError(f"{self.where}: {keys[0]} gives {new.segments[-1].end} rows, {path} needs "
                                      f"{out_features}.")
            if bias_key is not None:
                new.bias = nn.Parameter(read(bias_key).to(device=device, dtype=compute, copy=True),
                                        requires_grad=False)
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
        return True


def _read_roles(layer: QuantLayer, read: Callable, device, where: str) -> dict[str, torch.Tensor]:
    """Every tensor of a quantized layer in memory of its own on `device`, in its stored dtype (uint8 W4A8 group
    scales seen as the fp8 bytes they are); every float among them (scales, fp8 weights) checked for NaN/inf."""
    out = {}
    for role, key in layer.keys.items():
        tensor = read(key).to(device=device, copy=True)
        if role == "weight_s_rel" and tensor.dtype == torch.uint8:
            tensor = tensor.view(torch.float8_e4m3fn)
        check_finite(tensor, f"{key} ({layer.fmt} {role})", where)
        out[role] = tensor
    return out


def _check_runnable(formats: dict[str, str], where: str, instead: str) -> None:
    """Refuse formats this pack does not know, or that comfy-kitchen cannot run here (`formats`: format -> an
    example layer). comfy-kitchen is imported only when a format needs it."""
    for fmt, layer in formats.items():
        if fmt not in FORMATS:
            raise CheckpointError(
                f"{where}: {layer} is quantized as {shown(fmt)}, a format this pack does not know (it runs "
                f"{', '.join(FORMATS)}). Use {instead} instead."
            )
    needs = {fmt: layer for fmt, layer in formats.items() if FORMATS[fmt].needs_kitchen}
    if not needs:
        return
    ck = kitchen(f"{where} is a quantized checkpoint ({', '.join(sorted(needs))}); its layers")
    for fmt, layer in needs.items():
        try:
            ck.registry.get_capable_backend(FORMATS[fmt].kernel)
        except Exception as error:  # comfy-kitchen's NoCapableBackendError lists what each backend lacks
            hint = (" It needs a CUDA GPU of compute capability 7.5 or newer with comfy-kitchen's CUDA kernels."
                    if fmt == "convrot_w4a4" else "")
            raise CheckpointError(
                f"{where} is quantized as {fmt} (e.g. {layer}), and no comfy-kitchen backend available here runs "
                f"it ({error}).{hint} Use {instead} instead."
            ) from None


def plan_quantization(tensors: dict[str, TensorInfo], metadata: dict, read: Callable, where: str, instead: str,
                      rename: Callable[[str], str] = lambda name: name,
                      used: Callable[[str], bool] = lambda key: True) -> QuantPlan:
    """Every quantized layer of a checkpoint, checked from its headers before any weight is read.

    Args:
        tensors: the headers, by the loader's keys (a DiT's without `model.diffusion_model.`).
        metadata: the header metadata (`_quantization_metadata` may be there).
        read: key -> tensor, used only for the small `comfy_quant` JSON tensors.
        where: the file's name, for messages.
        instead: the files to suggest when this one cannot run ("qwen_image_2.1_bf16.safetensors").
        rename: metadata layer name -> the loader's key namespace.
        used: whether a weight key is loaded at all (a text encoder's LM head is not: its layer is accepted
            unchecked, and its keys are consumed).
    Raises:
        CheckpointError naming the file, the key and the format for anything wrong or not runnable here;
        ImportError (how to install it) when comfy-kitchen is missing.
    """
    descriptions = _descriptions(tensors, metadata, read, where, rename)
    roles: dict[str, dict[str, str]] = {}
    consumed, markers = set(), set()
    for key in tensors:
        if key.endswith("." + DESCRIPTION) or _is_marker(key):
            consumed.add(key)
            markers.add(key)
            continue
        found = _role_of(key)
        if found is None:
            continue
        layer, role = found
        if role in roles.setdefault(layer, {}):
            raise CheckpointError(f"{where}: both {roles[layer][role]} and {key} give {layer}'s {role}; the file is "
                                  "damaged. Download it again.")
        roles[layer][role] = key
        consumed.add(key)
    orphans = sorted(set(roles) - set(descriptions))
    if orphans:
        key = next(iter(roles[orphans[0]].values()))
        raise CheckpointError(
            f"{where}: {key} is a quantization scale, but the file describes no quantization for {orphans[0]} (no "
            f"{orphans[0]}.comfy_quant, no _quantization_metadata, no scaled_fp8 marker): this is not a complete "
            f"quantized checkpoint. Download it again, or use {instead}."
        )
    layers, formats = {}, {}
    for layer, description in sorted(descriptions.items()):
        weight_key = layer + ".weight"
        if weight_key not in tensors:
            raise CheckpointError(f"{where}: the file describes a quantized layer {shown(layer)} but has no "
                                  f"{shown(weight_key)}. "
                                  f"Download it again, or use {instead}.")
        if not used(weight_key):
            consumed.add(weight_key)
            continue
        fmt = description["format"]
        formats.setdefault(fmt, layer)
        if fmt in FORMATS:
            keys = {"weight": weight_key, **roles.get(layer, {})}
            layers[weight_key] = _check_layer(layer, description, keys, tensors, where, instead)
    _check_runnable(formats, where, instead)
    plain = [info.dtype for key, info in tensors.items()
             if key not in consumed and key not in layers and info.dtype in FLOATS]
    float_dtype = max(set(plain), key=plain.count) if plain else "BF16"
    return QuantPlan(where, layers, frozenset(consumed), frozenset(markers), float_dtype)
