"""Load the Qwen-Image 2.1 VAE from the files users have.

Two layouts of the same 238 tensors (CHECKPOINTS.md 3.2-3.3):
- ComfyUI single file `qwen_image_2.1_vae_bf16.safetensors`: Wan-2.2 names (`encoder.conv1`,
  `encoder.downsamples.{i}.downsamples.{j}.residual.{0,2,3,6}`, `decoder.middle.1`, `decoder.head.2`, `conv1`,
  `conv2`, ...) and 5-D causal-conv weights `[O, I, 1, kh, kw]`.
- diffusers folder (`Qwen-Image-2.1/vae/` with `config.json` + `diffusion_pytorch_model.safetensors`, or
  a bare diffusers-named file): our own parameter names, 4-D convolutions.

Headers decide everything first (what the file is, its layout, its config, every shape), so a wrong,
truncated or pickled file is refused before a weight is allocated. The model is then built on the meta
device and each tensor is read lazily (`safe_open`), converted and placed, so only one model copy exists.
The six `time_conv` weights are read from the header (they say which stages are temporal, which changes the
single-frame shortcuts) but never loaded: a single frame never runs them.
"""

import json
import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .safetensors_io import CheckpointError, TensorInfo, identify_checkpoint, read_headers, read_sharded_index
from .vae import QwenImage21VAE, QwenImage21VAEConfig

WEIGHT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Full-checkpoint prefixes some files keep (ComfyUI strips the same ones).
PREFIXES = ("first_stage_model.", "vae.")
# One row per layout; every key of a row must be present (ComfyUI detects the Wan file by the first two).
DETECT = {
    "comfyui": ("decoder.middle.0.residual.0.gamma", "decoder.upsamples.0.upsamples.0.residual.2.weight",
                "encoder.conv1.weight", "conv2.weight"),
    # Qwen-Image 1.x's diffusers VAE shares the mid block names; its stages hold no `resnets`/`upsampler`.
    "diffusers": ("decoder.mid_block.resnets.0.norm1.gamma", "decoder.up_blocks.0.upsampler.resample.1.weight",
                  "encoder.down_blocks.0.resnets.0.conv1.weight", "encoder.conv_in.weight", "post_quant_conv.weight"),
}
# Wan/ComfyUI name -> diffusers name, first matching prefix rule wins. Indices follow ComfyUI's
# `nn.Sequential`s: a Down/Up_ResidualBlock holds its residual blocks, then (if any) one `Resample`, which
# is the entry whose keys continue with `resample.` / `time_conv.`; `middle` is [resnet, attention, resnet];
# `head` is [RMS_norm, SiLU, conv].
COMFY_PREFIX_RULES = (
    (r"(encoder|decoder)\.conv1\.", r"\1.conv_in."),
    (r"conv1\.", "quant_conv."),
    (r"conv2\.", "post_quant_conv."),
    (r"(encoder|decoder)\.head\.0\.", r"\1.norm_out."),
    (r"(encoder|decoder)\.head\.2\.", r"\1.conv_out."),
    (r"(encoder|decoder)\.middle\.0\.", r"\1.mid_block.resnets.0."),
    (r"(encoder|decoder)\.middle\.1\.", r"\1.mid_block.attentions.0."),
    (r"(encoder|decoder)\.middle\.2\.", r"\1.mid_block.resnets.1."),
    (r"encoder\.downsamples\.(\d+)\.downsamples\.\d+\.(?=resample\.|time_conv\.)",
     r"encoder.down_blocks.\1.downsampler."),
    (r"encoder\.downsamples\.(\d+)\.downsamples\.(\d+)\.", r"encoder.down_blocks.\1.resnets.\2."),
    (r"decoder\.upsamples\.(\d+)\.upsamples\.\d+\.(?=resample\.|time_conv\.)", r"decoder.up_blocks.\1.upsampler."),
    (r"decoder\.upsamples\.(\d+)\.upsamples\.(\d+)\.", r"decoder.up_blocks.\1.resnets.\2."),
)
# Inside a ComfyUI ResidualBlock: residual = [RMS_norm, SiLU, conv, RMS_norm, SiLU, Dropout, conv].
COMFY_RESIDUAL_RULES = (
    (".residual.0.", ".norm1."), (".residual.2.", ".conv1."), (".residual.3.", ".norm2."), (".residual.6.", ".conv2."),
    (".shortcut.", ".conv_shortcut."),
)
RELEASE_FILE = "qwen_image_2.1_vae_bf16.safetensors"


@dataclass(frozen=True)
class VAESource:
    """What was loaded: the path, its layout ("comfyui" or "diffusers") and where the config came from."""

    path: Path
    layout: str
    config_from: str  # "config.json" or "tensor shapes"


def comfy_to_diffusers_key(key: str) -> str | None:
    """The diffusers name of a Wan/ComfyUI VAE key, or None when no rule knows it."""
    for pattern, replacement in COMFY_PREFIX_RULES:
        renamed, hits = re.subn("^" + pattern, replacement, key, count=1)
        if hits:
            for old, new in COMFY_RESIDUAL_RULES:
                renamed = renamed.replace(old, new)
            return renamed
    return None


def _strip_prefix(keys) -> dict[str, str]:
    """{bare key: key in the file}, with a full-checkpoint prefix removed when every key carries it."""
    keys = list(keys)
    for prefix in PREFIXES:
        if keys and all(key.startswith(prefix) for key in keys):
            return {key[len(prefix):]: key for key in keys}
    return {key: key for key in keys}


def _describe(keys) -> str:
    """What a file that is not the Qwen-Image 2.1 VAE holds, as precisely as its keys tell."""
    keys = set(keys)
    if "decoder.middle.0.residual.0.gamma" in keys or "decoder.up_blocks.0.upsamplers.0.resample.1.weight" in keys:
        return "the 16-channel Wan 2.1 / Qwen-Image 1.x VAE (no residual up/down stages)"
    if any(".norm1.weight" in key for key in keys) and any(key.startswith("decoder.") for key in keys):
        return "a GroupNorm VAE (Stable Diffusion / Flux style)"
    return identify_checkpoint(keys)


def _detect_layout(bare: dict[str, str], where: str) -> str:
    for layout, required in DETECT.items():
        if all(key in bare for key in required):
            return layout
    raise CheckpointError(
        f"{where} is {_describe(bare)}, not the Qwen-Image 2.1 VAE. Use {RELEASE_FILE} "
        "(models/vae) or a diffusers Qwen-Image-2.1 folder (its vae/ subfolder)."
    )


def _canonical(bare: dict[str, str], layout: str, where: str) -> dict[str, str]:
    """{diffusers name: key in the file} for every tensor, refusing names no rule knows."""
    if layout == "diffusers":
        return dict(bare)
    names, unknown = {}, []
    for key, file_key in bare.items():
        name = comfy_to_diffusers_key(key)
        if name is None:
            unknown.append(key)
        else:
            names[name] = file_key
    if unknown:
        raise CheckpointError(
            f"{where}: {len(unknown)} tensors that the Qwen-Image 2.1 VAE does not have (e.g. "
            f"{', '.join(sorted(unknown)[:3])}); this is not a plain {RELEASE_FILE}."
        )
    return names


def _count(names, pattern: str) -> int:
    found = {int(m.group(1)) for name in names if (m := re.match(pattern, name))}
    return max(found) + 1 if found else 0


def infer_config(shapes: dict[str, tuple[int, ...]], where: str = "checkpoint") -> QwenImage21VAEConfig:
    """The VAE config from diffusers-named tensor shapes alone; which stages are temporal comes from
    which resamplers carry a `time_conv` (diffusers creates one exactly for those)."""
    try:
        base_dim, in_channels = shapes["encoder.conv_in.weight"][:2]
        z_dim = shapes["post_quant_conv.weight"][0]
        decoder_base_dim = shapes["decoder.norm_out.gamma"][0]
        out_channels = shapes["decoder.conv_out.weight"][0]
        stages = _count(shapes, r"encoder\.down_blocks\.(\d+)\.")
        dim_mult = tuple(
            shapes[f"encoder.down_blocks.{i}.resnets.0.conv1.weight"][0] // base_dim for i in range(stages)
        )
        num_res_blocks = _count(shapes, r"encoder\.down_blocks\.0\.resnets\.(\d+)\.")
    except KeyError as error:
        raise CheckpointError(f"{where}: the VAE tensor {error} is missing; the file is incomplete. Re-download it.")
    temporal = tuple(f"encoder.down_blocks.{i}.downsampler.time_conv.weight" in shapes for i in range(stages - 1))
    temporal_up = tuple(f"decoder.up_blocks.{i}.upsampler.time_conv.weight" in shapes for i in range(stages - 1))
    if temporal_up != temporal[::-1]:
        raise CheckpointError(
            f"{where}: the encoder's temporal stages {temporal} do not mirror the decoder's {temporal_up}; "
            "the file mixes two different VAEs."
        )
    if in_channels != 4 or out_channels != 4:
        hint = " (a patchified Wan 2.2 video VAE)" if in_channels == 12 else ""
        raise CheckpointError(
            f"{where}: a VAE with {in_channels} input and {out_channels} output channels{hint}; the Qwen-Image 2.1 "
            f"VAE is RGBA (4 and 4). Use {RELEASE_FILE}."
        )
    config = QwenImage21VAEConfig(
        base_dim=base_dim,
        decoder_base_dim=decoder_base_dim,
        z_dim=z_dim,
        dim_mult=dim_mult,
        num_res_blocks=num_res_blocks,
        temporal_downsample=temporal,
        in_channels=in_channels,
        out_channels=out_channels,
        # the published statistics are for 64 channels; a resized test model gets neutral ones
        **({} if z_dim == 64 else {"latents_mean": (0.0,) * z_dim, "latents_std": (1.0,) * z_dim}),
    )
    return config


def _config_from_json(path: Path, inferred: QwenImage21VAEConfig) -> QwenImage21VAEConfig:
    """`vae/config.json` cross-checked with the shapes; it adds the latent statistics."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: unreadable config ({error}).")
    name = data.get("_class_name", "AutoencoderKLQwenImage21")
    if name != "AutoencoderKLQwenImage21":
        raise CheckpointError(f"{path} describes a {name}, not an AutoencoderKLQwenImage21 (the Qwen-Image 2.1 VAE).")
    unsupported = {
        "is_residual": (data.get("is_residual", True), True),
        "attn_scales": (list(data.get("attn_scales", [])), []),
        "patch_size": (data.get("patch_size") or 1, 1),
    }
    for field, (value, wanted) in unsupported.items():
        if value != wanted:
            raise CheckpointError(f"{path}: {field} = {value!r}; the Qwen-Image 2.1 VAE has {wanted!r}.")
    json_names = {"temporal_downsample": "temperal_downsample"}  # diffusers' spelling
    for field in ("base_dim", "decoder_base_dim", "z_dim", "dim_mult", "num_res_blocks", "temporal_downsample",
                  "in_channels", "out_channels"):
        key = json_names.get(field, field)
        if data.get(key) is None:
            continue
        ours = getattr(inferred, field)
        theirs = tuple(data[key]) if isinstance(ours, tuple) else data[key]
        if theirs != ours:
            raise CheckpointError(f"{path}: {key} = {data[key]} but the weights have {ours}.")
    mean, std = data.get("latents_mean", inferred.latents_mean), data.get("latents_std", inferred.latents_std)
    if len(mean) != inferred.z_dim or len(std) != inferred.z_dim:
        raise CheckpointError(f"{path}: latents_mean/latents_std need {inferred.z_dim} values each.")
    return replace(inferred, latents_mean=tuple(float(v) for v in mean), latents_std=tuple(float(v) for v in std))


def resolve_source(path) -> tuple[list[Path], Path | None]:
    """Weight files to read and the config.json, if any, for a file, a `vae/` folder or a model root."""
    path = Path(path)
    if path.is_file():
        return [path], None
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or folder.")
    folder = path / "vae" if (path / "vae").is_dir() else path
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    files = read_sharded_index(indexes[0]) if indexes else sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{folder}: no .safetensors weights found. Expected a diffusers Qwen-Image-2.1 vae/ folder "
            "(config.json + diffusion_pytorch_model.safetensors)."
        )
    if len(files) > 1 and not indexes:
        raise CheckpointError(f"{folder}: {len(files)} .safetensors files and no index; expected one VAE file.")
    config_path = folder / "config.json"
    return files, (config_path if config_path.is_file() else None)


def _plan(model: QwenImage21VAE, names: dict[str, str], tensors: dict[str, TensorInfo], where: str) -> dict[str, str]:
    """{our parameter: key in the file}, with every shape checked (5-D Wan convs by their spatial part)."""
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    usable = {name: key for name, key in names.items() if ".time_conv." not in name}
    missing = sorted(expected.keys() - usable.keys())
    unexpected = sorted(usable.keys() - expected.keys())
    if missing or unexpected:
        detail = (f"missing {', '.join(missing[:3])}" if missing else "") + ("; " if missing and unexpected else "") + (
            f"unexpected {', '.join(unexpected[:3])}" if unexpected else "")
        raise CheckpointError(
            f"{where}: the tensors do not form one Qwen-Image 2.1 VAE ({len(missing)} missing, {len(unexpected)} "
            f"unexpected: {detail}). The file is incomplete or from another model; re-download it."
        )
    for name, key in usable.items():
        shape = tensors[key].shape
        if len(shape) == 5:  # Wan causal conv [O, I, T, kh, kw]
            if shape[2] != 1:
                raise CheckpointError(
                    f"{where}: {key} has temporal kernel {shape[2]} (shape {list(shape)}); the Qwen-Image 2.1 VAE "
                    "has 1. This is a video VAE such as Wan 2.2's, not Qwen-Image 2.1's."
                )
            shape = shape[:2] + shape[3:]
        if name.endswith(".gamma") and all(size == 1 for size in shape[1:]):
            shape = shape[:1] + (1, 1)  # stored as [C, 1, 1, 1] (resnets, heads) or [C, 1, 1] (attention)
        if shape != expected[name]:
            raise CheckpointError(
                f"{where}: {key} has shape {list(tensors[key].shape)}, expected {list(expected[name])}."
            )
    return usable


def _convert(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if tensor.ndim == 5:
        tensor = tensor[:, :, -1]  # temporal kernel 1 (checked): the single tap
    if name.endswith(".gamma"):
        tensor = tensor.reshape(-1, 1, 1)
    return tensor


def _resolve_dtype(weight_dtype, file_dtype: str, where: str) -> torch.dtype:
    if isinstance(weight_dtype, torch.dtype):
        dtype = weight_dtype
    elif weight_dtype == "default":
        # the file's own dtype, except fp16, which this VAE overflows in: bf16 keeps its range
        dtype = torch.float32 if file_dtype in ("F32", str(torch.float32)) else torch.bfloat16
    elif weight_dtype in WEIGHT_DTYPES:
        dtype = WEIGHT_DTYPES[weight_dtype]
    else:
        raise ValueError(
            f"weight_dtype must be 'default', one of {tuple(WEIGHT_DTYPES)} or a torch dtype; got {weight_dtype!r}."
        )
    if dtype not in WEIGHT_DTYPES.values():
        raise ValueError(f"weight_dtype {dtype} is not supported for the VAE; use bf16 or fp32.")
    if dtype == torch.float16:
        warnings.warn(
            f"{where}: the Qwen-Image 2.1 VAE decoder overflows fp16 (white or NaN blocks in the image); "
            "use bf16 or fp32.",
            stacklevel=3,
        )
    return dtype


def _build(tensors: dict[str, TensorInfo], read, config_path: Path | None, weight_dtype, device, where: str,
           path: Path) -> QwenImage21VAE:
    bare = _strip_prefix(tensors)
    layout = _detect_layout(bare, where)
    names = _canonical(bare, layout, where)
    shapes = {name: tensors[key].shape for name, key in names.items()}
    if layout == "comfyui":
        shapes = {name: (s[:2] + s[3:] if len(s) == 5 else s) for name, s in shapes.items()}
    config = infer_config(shapes, where)
    if config_path is not None:
        config = _config_from_json(config_path, config)
    dtype = _resolve_dtype(weight_dtype, tensors[names["post_quant_conv.weight"]].dtype, where)
    with torch.device("meta"):
        model = QwenImage21VAE(config)
    plan = _plan(model, names, tensors, where)
    state = {}
    for name, key in plan.items():
        # copy=True: safetensors hands out views of its memory map, and a model living on a mapping breaks
        # (SIGBUS, or silently changed weights) when the file is replaced while ComfyUI runs
        state[name] = _convert(read(key), name).to(device=device, dtype=dtype, copy=True)
    model.load_state_dict(state, strict=True, assign=True)
    del state
    model.requires_grad_(False)
    model.source = VAESource(path, layout, "config.json" if config_path is not None else "tensor shapes")
    return model.eval()


def load_vae(path, weight_dtype="default", device="cpu") -> QwenImage21VAE:
    """Load the Qwen-Image 2.1 VAE from ComfyUI's single file or a diffusers folder; `model.source` says which.

    `path`: a `.safetensors` file (ComfyUI or diffusers names), a diffusers `vae/` folder, or the model root
    above it. `weight_dtype`: "default" (the file's dtype; fp16 files load as bf16), "bf16", "fp16" (warns:
    the decoder overflows it), "fp32", or a torch dtype. `device`: where the weights go, one tensor at a time.
    Nothing is unpickled: pickles are recognised by their first bytes and refused.
    """
    files, config_path = resolve_source(path)
    tensors, _ = read_headers(files)
    where = Path(path).name
    from safetensors import safe_open

    handles = {}

    def read(key: str) -> torch.Tensor:
        file = tensors[key].file
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return handles[file].get_tensor(key)

    try:
        return _build(tensors, read, config_path, weight_dtype, device, where, Path(path))
    finally:
        handles.clear()


def vae_from_state_dict(state_dict: dict[str, torch.Tensor], weight_dtype="fp32", device="cpu",
                        config_path: Path | None = None) -> QwenImage21VAE:
    """The VAE from a state dict already in memory, in either layout (ComfyUI hands its loaders these).

    The weights are copied (the model never aliases the caller's tensors), so two copies exist until the
    caller drops its dict; for files, `load_vae` reads tensor by tensor instead.
    """
    tensors = {k: TensorInfo(str(v.dtype), tuple(v.shape), Path("<memory>")) for k, v in state_dict.items()}
    return _build(tensors, state_dict.__getitem__, config_path, weight_dtype, device, "state dict", Path("<memory>"))
