"""LoRA for the Qwen-Image 2.1 DiT: the files people have, read in every common key format, run as exact
low-rank branches on a copy of the model that shares every weight with the original.

What a LoRA file holds, per targeted Linear `W` (out x in): a down matrix `A` (rank x in), an up matrix `B`
(out x rank) and optionally a scalar `alpha`. The layer becomes `W x + strength * alpha / rank * B (A x)`
(`alpha / rank` = 1 without alpha), computed as a branch in the compute dtype next to the frozen weight, so
bf16, fp16, fp32, fp8 and quantized weights all take it without requantization or a weight copy
(`Linear.adapters`, model/layers/linear.py). Full-weight patches in the same file (`.diff`, `.diff_b`,
`.set_weight`, as ComfyUI's LoRA extraction writes them) apply as ComfyUI applies them: `lora_patches.py`. Key
formats, the scale rule and what is refused: docs/lora.md.

Names: a file names diffusers' modules (`transformer_blocks.N.attn.to_q`, ...), in one of the formats of
`FORMATS`; `file_plan` (dit_keys.py) says which rows of which of our Linears each of them is, so separate
`to_q`/`to_k`/`to_v` or `gate_layer`/`proj` LoRAs land on the right rows of our fused `qkv` and `gate_up`.

`apply_lora(model, path, strength)` never changes `model`: it returns a copy whose module tree is new objects
holding the same Parameters (no weight is copied), with one more branch in the affected Linears' `adapters`,
`manager` None (the host's memory handle belongs to one model object) and `loras` recording what was applied
(the sampler's report and the prefix-cache key read it).
"""

import copy
import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..layers.linear import Linear
from ..layers.lora import LowRankBranch
from ..transformer.dit import DiTConfig, QwenImage21DiT
from .checkpoint import FILE_DTYPES, FP8_FILE_DTYPES, CheckpointError, WeightReader, read_header, shown
from .dit_keys import file_plan
from .finite import check_finite
from .lora_patches import PATCH_PARTS, WeightPatch, apply_patches, bias_note, patch_role, plan_patches


class LoraError(CheckpointError):
    """A LoRA file that cannot be applied to this model; the message names the file and what was expected."""


@dataclass(frozen=True)
class KeyFormat:
    """One way of naming a module: a prefix, then the module path with dots (or with underscores, kohya)."""

    name: str
    prefix: str
    dotted: bool


#: The key formats we read, tried in this order (the bare form last: its empty prefix matches everything).
FORMATS = (
    KeyFormat("diffusers / PEFT", "transformer.", True),
    KeyFormat("PEFT model", "base_model.model.", True),
    KeyFormat("ComfyUI", "diffusion_model.", True),
    KeyFormat("ComfyUI (checkpoint prefix)", "model.diffusion_model.", True),
    KeyFormat("kohya / musubi", "lora_unet_", False),
    KeyFormat("LyCORIS LoCon", "lycoris_", False),
    KeyFormat("bare module names", "", True),
)

#: What follows the module path: the tensor's role in a plain low-rank pair (diffusers / PEFT, kohya, old
#: diffusers attention processors, transformers' lora_linear_layer).
PARTS = {
    ".lora_A.weight": "down", ".lora_A.default.weight": "down", ".lora_A": "down", ".lora_down.weight": "down",
    ".lora.down.weight": "down", ".lora_linear_layer.down.weight": "down",
    ".lora_B.weight": "up", ".lora_B.default.weight": "up", ".lora_B": "up", ".lora_up.weight": "up",
    ".lora.up.weight": "up", ".lora_linear_layer.up.weight": "up",
    ".alpha": "alpha",
}
_PART_SUFFIXES = sorted(PARTS, key=len, reverse=True)  # longest first: ".lora_A.weight" before ".lora_A"
PATCH_ROLES = tuple(PATCH_PARTS.values())  # the roles of full-weight patch tensors (lora_patches.py)

#: Tensors that change what a pair means: applying the pair without them would be another LoRA, so a file with
#: them on a layer we would patch is refused.
REFUSED_PARTS = {
    ".dora_scale": "DoRA (dora_scale)", ".lora_magnitude_vector": "DoRA (lora_magnitude_vector)",
    ".lora_magnitude_vector.weight": "DoRA (lora_magnitude_vector)",
    ".lora_magnitude_vector.default.weight": "DoRA (lora_magnitude_vector)",
    ".lora_mid.weight": "LoCon with a Tucker core (lora_mid)", ".lora_B.bias": "a LoRA with a bias (lora_B.bias)",
}
#: Adapter kinds that are not plain low-rank: ignored (with a note) when the file also holds plain pairs.
OTHER_ADAPTERS = (
    (re.compile(r"\.hada_(w[12]_[ab]|t[12])$"), "LyCORIS LoHa (hada_*)"),
    (re.compile(r"\.lokr_(w[12](_[ab])?|t2)$"), "LyCORIS LoKr (lokr_*)"),
    (re.compile(r"\.(bias|reshape_weight)$"), "bias or reshape keys ComfyUI does not read either"),
)
TEXT_ENCODER = re.compile(r"^(lora_te\d?_|text_encoders?[._]|te\d?[._])")

#: LoRAs for other model families, recognised by module names the 2.1 DiT does not have (checked before
#: anything else, since their attention keys can look like ours). First match wins: Flux's double blocks
#: also have `add_q_proj`.
FOREIGN = (
    ("Flux", re.compile(r"(^|[._])(double_blocks|single_blocks|single_transformer_blocks|ff_context|"
                        r"norm1_context|context_embedder|x_embedder)([._]|$)")),
    ("Qwen-Image 1.x (double-stream blocks)", re.compile(r"(^|[._])(add_[qkv]_proj|to_add_out|txt_mlp|img_mod|"
                                                         r"txt_mod|txt_norm)([._]|$)|img_mlp[._]net[._]")),
    ("Stable Diffusion 1.x / SDXL (UNet)", re.compile(r"(^|[._])(input_blocks|output_blocks|middle_block|"
                                                      r"down_blocks|up_blocks|mid_block)[._]")),
)
_FLOAT_DTYPES = {**FILE_DTYPES, **FP8_FILE_DTYPES, "F64": torch.float64}
_ALPHA_INT_DTYPES = ("I64", "I32", "I16", "I8", "U8")  # some trainers store alpha as an integer
TARGETS_HINT = ("Qwen-Image 2.1 LoRAs target transformer_blocks.N.attn.to_q/to_k/to_v/to_out.0 and "
                "transformer_blocks.N.img_mlp.gate_layer/proj/out (or the fused img_mlp.gate_up)")


# -- where each file module lands ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """Rows `[start, end)` of our Linear `linear` (which has `in_features` inputs)."""

    linear: str
    start: int
    end: int
    in_features: int


@functools.lru_cache(maxsize=8)
def lora_targets(config: DiTConfig) -> dict[str, Target]:
    """File module name (diffusers' names, ComfyUI's fused `img_mlp.gate_up`, diffusers' fused `attn.to_qkv`) ->
    the rows of our Linear it is."""
    with torch.device("meta"):
        meta = QwenImage21DiT(config)
    targets = {}
    for fused in (False, True):
        for name, keys in file_plan(config, fused).items():
            path, _, attr = name.rpartition(".")
            module = meta.get_submodule(path) if path else None
            if attr != "weight" or not isinstance(module, Linear):
                continue  # norms: no Linear, nothing a low-rank pair could patch
            out_features, in_features = module.weight.shape
            rows = out_features // len(keys)
            for i, key in enumerate(keys):
                targets[key.removesuffix(".weight")] = Target(path, i * rows, (i + 1) * rows, in_features)
    for i in range(config.num_layers):
        targets[f"transformer_blocks.{i}.attn.to_qkv"] = Target(f"blocks.{i}.qkv", 0, 3 * config.width, config.width)
    return targets


@functools.lru_cache(maxsize=8)
def param_targets(config: DiTConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """File module name of each norm scale (`transformer_blocks.N.attn.norm_q`, `txt_in.text_norm`) -> (our
    parameter path, its shape): what a full-weight patch (`.diff`) of a 1-D weight lands on."""
    with torch.device("meta"):
        meta = QwenImage21DiT(config)
    params = dict(meta.named_parameters())
    targets = {}
    for name, keys in file_plan(config, fused_mlp=True).items():
        path, _, attr = name.rpartition(".")
        if not (attr == "weight" and isinstance(meta.get_submodule(path) if path else None, Linear)):
            targets[keys[0].removesuffix(".weight")] = (name, tuple(params[name].shape))
    return targets


@functools.lru_cache(maxsize=8)
def _underscored(config: DiTConfig) -> dict[str, str]:
    """kohya's flattened names (`transformer_blocks_0_attn_to_q`) -> the dotted name; built from the dotted
    names themselves, so no guessing which underscores were dots."""
    names = {}
    for dotted in (*lora_targets(config), *param_targets(config)):
        flat = dotted.replace(".", "_")
        if flat in names:
            raise RuntimeError(f"{dotted} and {names[flat]} flatten to the same kohya name")
        names[flat] = dotted
    return names


# -- reading a file ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoraPair:
    """One low-rank pair of a file, mapped onto our model: `scale * up @ down` is added to rows
    `[target.start, target.end)` of `target.linear`; `scale` = alpha / rank (strength not included)."""

    module: str  # the file's module name (diffusers naming), for messages
    target: Target
    down: torch.Tensor  # (rank, in_features), as stored (CPU)
    up: torch.Tensor  # (rows, rank)
    scale: float

    @property
    def rank(self) -> int:
        return self.down.shape[0]


@dataclass(frozen=True)
class LoraFile:
    """A parsed LoRA: its pairs, the key formats it used, and what was ignored (kind -> count)."""

    name: str
    pairs: tuple[LoraPair, ...]
    formats: tuple[str, ...]
    ignored: tuple[tuple[str, int], ...]
    patches: tuple[WeightPatch, ...] = ()  # full-weight patches (.diff, .set_weight), lora_patches.py
    extra_notes: tuple[str, ...] = ()  # what applies differently from the file's intent (bias deltas)

    def notes(self) -> list[str]:
        notes = list(self.extra_notes)
        if self.ignored:
            total = sum(count for _, count in self.ignored)
            kinds = ", ".join(f"{count} {kind}" for kind, count in self.ignored)
            patches = f" and {len(self.patches)} full-weight patch(es)" if self.patches else ""
            notes.insert(0, f"LoRA {self.name}: {total} of its keys were ignored ({kinds}); {len(self.pairs)} layer "
                            f"pair(s){patches} applied")
        return notes


def _classify(key: str) -> tuple[str, str | None, str | None]:
    """(module stem, role in a plain pair or a full-weight patch or None, adapter kind when neither or None)."""
    for suffix in _PART_SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], PARTS[suffix], None
    patch = patch_role(key)
    if patch is not None:
        return patch[0], patch[1], None
    for suffix, kind in REFUSED_PARTS.items():
        if key.endswith(suffix):
            return key[: -len(suffix)], None, kind
    for pattern, kind in OTHER_ADAPTERS:
        match = pattern.search(key)
        if match:
            return key[: match.start()], None, kind
    return key.rpartition(".")[0], None, None


def _module_of(stem: str, config: DiTConfig) -> tuple[str, str] | None:
    """(diffusers module name, format name) for a key stem in any of FORMATS, else None."""
    targets, params, flat = lora_targets(config), param_targets(config), _underscored(config)
    for fmt in FORMATS:
        if stem.startswith(fmt.prefix):
            rest = stem[len(fmt.prefix):]
            module = (rest if rest in targets or rest in params else None) if fmt.dotted else flat.get(rest)
            if module is not None:
                return module, fmt.name
    return None


def _block_index(stem: str) -> int | None:
    match = re.search(r"transformer_blocks[._](\d+)[._]", stem)
    return int(match.group(1)) if match else None


def _sample(keys, count: int = 5) -> str:
    keys = sorted(keys)
    more = f" (and {len(keys) - count} more)" if len(keys) > count else ""
    return ", ".join(shown(key, 80) for key in keys[:count]) + more


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """A Linear pair's matrix shape; LoCon writes them as 1x1 convolutions `[a, b, 1, 1]`."""
    if len(shape) == 2:
        return shape
    if len(shape) == 4 and shape[2:] == (1, 1):
        return shape[:2]
    return None


def formats_text() -> str:
    """The key formats we read, for messages and docs."""
    names = "; ".join(f"{f.name} ({f'{f.prefix!r}' if f.prefix else 'no prefix'}"
                      f"{'' if f.dotted else ', module path with underscores'})" for f in FORMATS)
    return (f"{names}; each layer as lora_A/lora_B (.weight or .default.weight) or lora_down/lora_up, with an "
            "optional .alpha")


def _check_family(keys, where: str) -> None:
    for family, pattern in FOREIGN:
        example = next((key for key in sorted(keys) if pattern.search(key)), None)
        if example is not None:
            raise LoraError(f"{where} is a LoRA for {family}, not for Qwen-Image 2.1 (e.g. key {shown(example)}). "
                            f"{TARGETS_HINT}; pick a LoRA made for Qwen-Image 2.1.")


def read_lora(path, config: DiTConfig, name: str | None = None) -> LoraFile:
    """Read a LoRA file for a DiT of `config`: every key classified from the header first, every shape checked,
    and only then the matched tensors read (into memory of their own, on the CPU). Raises LoraError naming the
    file when it is for another model, matches nothing, or has a pair that does not fit its layer."""
    path = Path(path)
    where = name or path.name
    headers, _ = read_header(path)  # refuses pickles, damaged and truncated files by name
    _check_family(headers, where)

    groups: dict[str, dict[str, str]] = {}  # module -> role -> file key
    formats, ignored, unmatched, refused = [], {}, [], []

    def ignore(kind: str) -> None:
        ignored[kind] = ignored.get(kind, 0) + 1

    for key in headers:
        if TEXT_ENCODER.match(key):
            ignore("text-encoder keys")
            continue
        stem, role, kind = _classify(key)
        found = _module_of(stem, config)
        if role is None:  # not a tensor of a plain pair
            if found is not None and kind in REFUSED_PARTS.values():
                refused.append(f"{key} is {kind}: not a plain low-rank pair, and the pair without it would be "
                               "another LoRA")
            elif found is not None and kind is not None:
                ignore(kind)
            else:
                unmatched.append(key)
            continue
        if found is None:
            block = _block_index(stem)
            if block is not None and block >= config.num_layers:
                refused.append(f"{shown(key)} targets transformer block {block}, but the model has {config.num_layers}")
            else:
                unmatched.append(key)
            continue
        module, fmt = found
        if fmt not in formats:
            formats.append(fmt)
        roles = groups.setdefault(module, {})
        if role in roles:
            refused.append(f"{module} has two {role} tensors ({roles[role]!r} and {key!r}): mixed key layouts")
            continue
        roles[role] = key

    targets, params = lora_targets(config), param_targets(config)
    plan, patch_plan = [], []
    for module, roles in groups.items():
        patch_roles = {role: roles.pop(role) for role in PATCH_ROLES if role in roles}
        if patch_roles:
            linear = targets.get(module)
            weight, bias = plan_patches(module, patch_roles, headers, linear, None if linear else params[module][1],
                                        _FLOAT_DTYPES, refused)
            patch_plan.append((module, weight, bias))
            if not {"down", "up"} & roles.keys():
                roles.pop("alpha", None)  # an alpha beside a full patch scales nothing (ComfyUI reads it, unused)
            if weight is not None and {"down", "up"} & roles.keys():  # ComfyUI: the full patch replaces the pair
                ignore("low-rank pairs replaced by a full-weight patch of the same module (as in ComfyUI)")
                roles.clear()
            if not roles:
                continue
        if module not in targets:
            refused.append(f"{module} is a norm scale (1-D): a low-rank pair cannot patch it (a .diff can)")
            continue
        if "down" not in roles or "up" not in roles:
            if set(roles) == {"alpha"}:
                ignore("alphas without a pair")
            else:
                have = " and ".join(roles[r] for r in sorted(roles))
                refused.append(f"{module}: only {have}; a LoRA layer needs both its down (lora_A) and up (lora_B)")
            continue
        target = targets[module]
        down, up = (_matrix_shape(headers[roles[r]].shape) for r in ("down", "up"))
        rows = target.end - target.start
        if down is not None and up is not None and 0 in (down[0], up[1]):
            refused.append(f"{module}: down {list(headers[roles['down']].shape)} and up "
                           f"{list(headers[roles['up']].shape)} have rank 0: the pair adds nothing and alpha / rank "
                           "is undefined")
            continue
        if down is None or up is None or down[1] != target.in_features or up[0] != rows or up[1] != down[0]:
            refused.append(f"{module}: down {list(headers[roles['down']].shape)} and up "
                           f"{list(headers[roles['up']].shape)}, expected [rank, {target.in_features}] and "
                           f"[{rows}, rank] with the same rank")
            continue
        for role in roles:
            info = headers[roles[role]]
            allowed = (*_FLOAT_DTYPES, *_ALPHA_INT_DTYPES) if role == "alpha" else _FLOAT_DTYPES
            if info.dtype not in allowed or (role == "alpha" and math.prod(info.shape) != 1):
                refused.append(f"{roles[role]} is {info.dtype} {list(info.shape)}, expected a "
                               f"{'number' if role == 'alpha' else 'float matrix'}")
        plan.append((module, target, roles))

    if refused:
        details = "; ".join(refused[:3]) + (f"; and {len(refused) - 3} more" if len(refused) > 3 else "")
        raise LoraError(f"{where} does not fit this Qwen-Image 2.1 model ({config.num_layers} blocks, width "
                        f"{config.width}, MLP {config.mlp_hidden}): {details}. Nothing was applied; use a LoRA made "
                        "for this model.")
    if unmatched:
        ignored = {f"keys that name no Linear of the Qwen-Image 2.1 DiT (e.g. {_sample(unmatched, 2)})":
                   len(unmatched), **ignored}
    if not plan and not patch_plan:
        raise LoraError(f"{where}: none of its {len(headers)} keys is a LoRA layer of the Qwen-Image 2.1 DiT (e.g. "
                        f"{_sample(headers)}). Formats read: {formats_text()}. {TARGETS_HINT}.")

    pairs = []
    with WeightReader(headers) as reader:
        for module, target, roles in plan:
            down, up = (_load_matrix(reader, headers, roles[r]) for r in ("down", "up"))
            alpha = reader.read(roles["alpha"]).float().item() if "alpha" in roles else None
            if alpha is not None and not math.isfinite(alpha):
                raise LoraError(f"{where}: {roles['alpha']} is {alpha}; the file is damaged.")
            scale = 1.0 if alpha is None else alpha / down.shape[0]
            _check_pair(where, module, roles, down, up, scale)
            pairs.append(LoraPair(module, target, down, up, scale))
        patches, nonzero_bias, biases = [], [], 0
        for module, weight, bias in patch_plan:
            if weight is not None:
                role, key = weight
                tensor = _load_tensor(reader, headers, key)
                if not torch.isfinite(tensor).all():
                    raise LoraError(f"{where}: {key} holds NaN or infinite values; the file is damaged.")
                target, param = targets.get(module), params.get(module, (None,))[0]
                patches.append(WeightPatch(module, "set" if role == "set" else "diff", tensor,
                                           target=target, param=None if target else param))
            if bias is not None:  # no bias in the model (nor in ComfyUI's): read only to say whether it matters
                biases += 1
                if _load_tensor(reader, headers, bias).abs().max() != 0:
                    nonzero_bias.append(bias)
    note = bias_note(where, nonzero_bias, biases)
    return LoraFile(where, tuple(pairs), tuple(formats), tuple(ignored.items()), tuple(patches),
                    () if note is None else (note,))


def _load_tensor(reader: WeightReader, headers, key: str) -> torch.Tensor:
    dtype = _FLOAT_DTYPES[headers[key].dtype]
    keep = dtype if dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32
    return reader.load(key, keep, "cpu")


#: The largest entry `alpha / rank * up @ down` may have. The DiT's weights are O(1) (0.02 to 2 in the release), so a
#: delta 10^4 times larger drives the activations to inf within a few blocks: that is a damaged file (an alpha of
#: 1e30), not a strong LoRA (real ones stay below 1). Strength, at most 10, comes on top.
MAX_DELTA = 1e4


def _peak(tensor: torch.Tensor) -> float:
    low, high = torch.aminmax(tensor.float() if tensor.dtype == torch.float64 else tensor)
    return max(-float(low), float(high))


def _check_pair(where: str, module: str, roles: dict, down: torch.Tensor, up: torch.Tensor, scale: float) -> None:
    """Both matrices finite, and the scaled product within MAX_DELTA: a bound from the two peaks first (two
    reductions), the exact product only when the bound is exceeded."""
    for role, matrix in (("down", down), ("up", up)):
        check_finite(matrix, roles[role], where, "; nothing was applied", LoraError)
    bound = abs(scale) * down.shape[0] * _peak(down) * _peak(up)
    if bound <= MAX_DELTA:
        return
    largest = float((up.float() @ down.float()).abs().amax()) * abs(scale)
    if not largest <= MAX_DELTA:  # also NaN: inf * 0
        alpha = f" (alpha {roles['alpha']!r})" if "alpha" in roles else ""
        raise LoraError(f"{where}: {module}'s scaled product alpha / rank * up @ down{alpha} reaches {largest:.3g}, "
                        f"beyond {MAX_DELTA:g} (the DiT's own weights are below 2); it would turn the image into "
                        "inf/NaN. The file is damaged; nothing was applied.")


def _load_matrix(reader: WeightReader, headers, key: str) -> torch.Tensor:
    tensor = _load_tensor(reader, headers, key)
    return tensor.reshape(tensor.shape[:2])  # LoCon's [a, b, 1, 1] -> [a, b]


# -- applying --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AppliedLora:
    """What a model copy records per applied LoRA (the report's `loras`, the prefix-cache key, the notes)."""

    name: str
    strength: float
    notes: tuple[str, ...] = ()


def clone_tree(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object for `module` and every submodule; parameters and buffers are the same objects (moving
    either tree moves both), and every container (parameters, buffers, hooks, submodules) is the copy's own."""
    new = copy.copy(module)
    state = vars(new)
    for attr, value in vars(module).items():
        if isinstance(value, (dict, set, list)):
            state[attr] = copy.copy(value)
    state["_modules"] = type(module._modules)(
        (name, None if child is None else clone_tree(child)) for name, child in module._modules.items())
    return new


def attach_lora(model: QwenImage21DiT, path, strength: float = 1.0,
                name: str | None = None) -> tuple[QwenImage21DiT, AppliedLora]:
    """(`model` with the LoRA in `path` at `strength` as a new model object sharing every weight with `model`, which
    is never changed; what to record of it). Everything is read and checked before the copy is made. The mechanism
    only: `features/lora.apply_lora` records it on the copy's options record."""
    strength = float(strength)
    if not math.isfinite(strength):
        raise ValueError(f"LoRA strength must be a finite number, got {strength}.")
    lora = read_lora(path, model.config, name)
    by_linear: dict[str, list[LoraPair]] = {}
    for pair in lora.pairs:
        by_linear.setdefault(pair.target.linear, []).append(pair)
    new = clone_tree(model)
    if strength != 0.0:  # strength 0 is the model itself: recorded, but nothing applied (ComfyUI's LoRA nodes too)
        apply_patches(new, lora.patches, strength)  # sets first: they replace what earlier LoRAs did there
        for path_, pairs in by_linear.items():
            linear = new.get_submodule(path_)
            linear.adapters = (*linear.adapters, LowRankBranch(pairs, strength))
    new.manager = None  # the host's memory handle (ComfyUI's patcher) belongs to the original object
    return new, AppliedLora(lora.name, strength, tuple(lora.notes()))
