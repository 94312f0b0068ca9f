"""Full-weight patches in LoRA files, applied as ComfyUI applies them: `.diff` (a weight delta of any shape),
`.diff_b` (a bias delta), `.set_weight` (a replacement weight), and LyCORIS' `.w_norm` / `.b_norm` (read by ComfyUI
as a weight and a bias delta). ComfyUI's own LoRA extraction writes them next to low-rank pairs: `.diff` for 1-D
weights (the norm scales) and for layers extracted in full, `.diff_b` for biases.

The rules, from ComfyUI (`comfy/lora.py` `load_lora` and `calculate_weight`; `comfy_extras/nodes_lora_extract.py`):
- `.diff`: `W + strength * diff`, the delta shaped exactly like the weight it patches (1-D included).
- `.set_weight`: the weight becomes the tensor; strength does not scale it (a strength of 0 skips the LoRA, as the
  LoRA nodes do for every patch).
- One file module with several patches: set wins over diff, diff over w_norm, and any of them over a low-rank
  pair of the same module (ComfyUI keeps one patch per module and file, the later kind replacing the earlier).
- `.diff_b` / `.b_norm` patch `<module>.bias`. Qwen-Image 2.1 has no bias anywhere (diffusers'
  `QwenImage21Transformer2DModel` and ComfyUI's `comfy/ldm/qwen_image21` both build every Linear with
  `bias=False`), so ComfyUI finds no such weight and applies nothing ("NOT LOADED"); we do the same and say so in
  the report when the delta is not zero (ComfyUI's extraction of a 2.1 model writes none).

How each lands here, on every weight format (`loaders/lora.py` `apply_lora` calls `apply_patches`):
- a `.diff` on a Linear becomes a `DeltaBranch` (layers/lora.py): a dense delta GEMM next to the frozen weight, so
  bf16, fp8, GGUF and comfy-kitchen weights are neither copied nor requantized. Cost: one dense matrix of the
  patched rows in the compute dtype on the device, and one more GEMM of that size per call. The community Turbo
  extract that patches `img_in` (64 inputs), `proj_out` (64 outputs) and the timestep embedder's `linear_1` (256
  inputs) in full costs 3.0 MiB in bf16 for the three (the DiT: 13.3 GiB) and 0.5 M multiply-adds per latent
  token (`linear_1` runs once per step), against about 7 G per token in the 32 blocks.
- a `.diff` or `.set_weight` on a norm scale patches a copy of that small tensor in the model copy (the original
  model keeps its own), in fp32 then rounded to the stored dtype, as ComfyUI merges.
- a `.set_weight` on a Linear makes that one layer a plain dense Linear in the model copy: the old layer's
  weight (dequantized), plus the branches earlier LoRAs put on it, with the set rows replaced; one dense copy of
  that layer in its float dtype (the compute dtype for a quantized layer).
"""

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..layers.linear import Linear
from ..layers.lora import DeltaBranch
from .deferred import file_weights

#: Suffix -> role of a full-weight patch tensor.
PATCH_PARTS = {".diff": "diff", ".diff_b": "diff_b", ".set_weight": "set", ".w_norm": "w_norm", ".b_norm": "b_norm"}
WEIGHT_ROLES = ("set", "diff", "w_norm")  # precedence: the first present wins, as in ComfyUI
BIAS_ROLES = ("diff_b", "b_norm")


@dataclass(frozen=True)
class WeightPatch:
    """One full-weight patch mapped onto our model: `kind` "diff" (added times strength) or "set" (replaces), on
    rows `[target.start, target.end)` of a Linear (`target`) or on a whole parameter (`param`, a norm scale)."""

    module: str  # the file's module name (diffusers naming), for messages
    kind: str
    tensor: torch.Tensor  # as stored (CPU), shaped like the rows / the parameter it patches
    target: object = None  # loaders.lora.Target for a Linear
    param: str | None = None  # our parameter path for a norm scale

    @property
    def delta(self) -> torch.Tensor:  # what DeltaBranch reads
        return self.tensor


def patch_role(key: str) -> tuple[str, str] | None:
    """(module stem, role) when `key` is a full-weight patch tensor, else None."""
    for suffix, role in PATCH_PARTS.items():
        if key.endswith(suffix):
            return key[: -len(suffix)], role
    return None


def plan_patches(module: str, roles: dict[str, str], headers, linear_target, param_shape, float_dtypes, refused):
    """Check one module's patch tensors (role -> file key) against its layer; returns (weight role and key or None,
    bias key or None). `linear_target` is the module's Target on a Linear, else `param_shape` the norm's shape.
    Problems are appended to `refused`."""
    weight_role = next((r for r in WEIGHT_ROLES if r in roles), None)
    bias_role = next((r for r in BIAS_ROLES if r in roles), None)
    if linear_target is not None:
        rows = linear_target.end - linear_target.start
        weight_shape, bias_shape = (rows, linear_target.in_features), (rows,)
    else:
        weight_shape, bias_shape = tuple(param_shape), tuple(param_shape)
    for role, expected in ((weight_role, weight_shape), (bias_role, bias_shape)):
        if role is None:
            continue
        info = headers[roles[role]]
        if info.dtype not in float_dtypes or tuple(info.shape) != expected:
            refused.append(f"{roles[role]} is {info.dtype} {list(info.shape)}, expected a float tensor of shape "
                           f"{list(expected)} (the {'bias' if role in BIAS_ROLES else 'weight'} of {module})")
    return (None if weight_role is None else (weight_role, roles[weight_role]),
            None if bias_role is None else roles[bias_role])


def bias_note(name: str, nonzero: list[str], total: int) -> str | None:
    """The report's note for bias deltas that could not apply (None when every one is zero: nothing is lost)."""
    if not nonzero:
        return None
    example = ", ".join(nonzero[:2]) + (f" (and {len(nonzero) - 2} more)" if len(nonzero) > 2 else "")
    return (f"LoRA {name}: {len(nonzero)} of its {total} bias deltas (.diff_b) are not zero ({example}), but "
            "Qwen-Image 2.1 has no biases, so they are not applied; ComfyUI does not apply them either")


# -- applying to a model copy -------------------------------------------------------------------------------------
def apply_patches(model: nn.Module, patches, strength: float) -> None:
    """Apply a file's full-weight patches to `model`, a fresh copy from `apply_lora` (its modules are its own, its
    parameters shared with the original until replaced here). Sets first (they replace what came before), then
    the norm deltas, then one DeltaBranch per Linear."""
    _read_what_patches_merge_with(model, patches)
    for patch in patches:
        if patch.kind == "set" and patch.target is not None:
            _set_linear_rows(model, patch)
    deltas: dict[str, list[WeightPatch]] = {}
    for patch in patches:
        if patch.param is not None:
            _patch_param(model, patch, strength)
        elif patch.kind == "diff":
            deltas.setdefault(patch.target.linear, []).append(patch)
    for path, items in deltas.items():
        linear = model.get_submodule(path)
        linear.adapters = (*linear.adapters, DeltaBranch(items, strength))


def _read_what_patches_merge_with(model: nn.Module, patches) -> None:
    """A deferred model's weights wait on its file as placeholders (deferred.py): the ones a patch merges with (a
    norm's delta, a Linear whose rows are set) are read first, onto the host, or the merge would start from the
    placeholder's zeros and the base weight would be lost."""
    weights = file_weights(model)
    if weights is None or not weights.waiting:
        return
    params = []
    for patch in patches:
        if patch.param is not None and patch.kind != "set":
            owner_path, _, name = patch.param.rpartition(".")
            params.append(model.get_submodule(owner_path)._parameters[name])
        elif patch.kind == "set" and patch.target is not None:
            params.extend(model.get_submodule(patch.target.linear).parameters())
    weights.materialize(lambda param: "cpu", only={id(param) for param in params})


def _patch_param(model: nn.Module, patch: WeightPatch, strength: float) -> None:
    owner_path, _, name = patch.param.rpartition(".")
    owner = model.get_submodule(owner_path)
    old = owner._parameters[name]
    value = patch.tensor.to(device=old.device, dtype=torch.float32)
    merged = value if patch.kind == "set" else old.detach().float() + strength * value
    owner._parameters[name] = nn.Parameter(merged.to(old.dtype), requires_grad=False)


def _set_linear_rows(model: nn.Module, patch: WeightPatch) -> None:
    parent_path, _, name = patch.target.linear.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    old = getattr(parent, name)
    out_features, device = old.out_features, _device_of(old)
    weight = old.weight_rows(0, out_features, torch.float32).to(device=device, copy=True)
    for adapter in old.adapters:  # earlier LoRAs on this layer: folded in, as ComfyUI's merged weight holds them
        term = adapter.dense(0, out_features, device) if hasattr(adapter, "dense") else None
        if term is None and not hasattr(adapter, "dense"):
            raise TypeError(f"{patch.module}: an adapter of type {type(adapter).__name__} cannot be folded into a "
                            ".set_weight patch")
        if term is not None:
            weight += term
    weight[patch.target.start:patch.target.end] = patch.tensor.to(device=device, dtype=torch.float32)
    stored = getattr(old, "weight", None)
    dtype = (stored.dtype if type(old) is Linear and stored.dtype in (torch.float32, torch.float16, torch.bfloat16)
             else getattr(model, "compute_dtype", torch.float32))
    dense = Linear(weight.shape[1], out_features, device="meta", dtype=dtype)
    dense.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    setattr(parent, name, dense)


def _device_of(module: nn.Module) -> torch.device:
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")
