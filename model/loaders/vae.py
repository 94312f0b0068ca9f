"""Load the Qwen-Image 2.1 VAE from the files users have.

Two layouts of the same 238 tensors (docs/checkpoints.md):
- ComfyUI single file `qwen_image_2.1_vae_bf16.safetensors`: Wan-2.2 names (`encoder.conv1`,
  `encoder.downsamples.{i}.downsamples.{j}.residual.{0,2,3,6}`, `decoder.middle.1`, `decoder.head.2`, `conv1`,
  `conv2`, ...) and 5-D causal-conv weights `[O, I, 1, kh, kw]`.
- diffusers folder (`Qwen-Image-2.1/vae/` with `config.json` + `diffusion_pytorch_model.safetensors`, or
  a bare diffusers-named file): our own parameter names, 4-D convolutions.

Headers decide everything first (what the file is, its layout, its config, every shape), so a wrong,
truncated or pickled file is refused before a weight is allocated. The model is then built on the meta
device and each tensor is read lazily (safetensors' `safe_open`, in `checkpoint.WeightReader`), converted and
placed, so only one model copy exists. Finding the files, JSON, dtype choice and tensor reading are the shared
`checkpoint.py`; this module owns the VAE's detection, the Wan-to-diffusers key map and config inference.
The six `time_conv` weights are read from the header (they say which stages are temporal, which changes the
single-frame shortcuts) but never loaded: a single frame never runs them.
"""

import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..vae.autoencoder import QwenImage21VAE, QwenImage21VAEConfig
from .checkpoint import (
    FILE_DTYPES,
    FLOAT_DTYPES,
    MEMORY,
    CheckpointError,
    TensorInfo,
    WeightReader,
    check_dtypes,
    choose_dtype,
    count_indexed,
    find_weights,
    identify_checkpoint,
    infos_of,
    read_json,
    read_weight_headers,
    rename_keys,
)

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


def _bare(key: str) -> str:
    """The key without a full-checkpoint prefix."""
    for prefix in PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


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


def infer_config(shapes: dict[str, tuple[int, ...]], where: str = "checkpoint") -> QwenImage21VAEConfig:
    """The VAE config from diffusers-named tensor shapes alone; which stages are temporal comes from
    which resamplers carry a `time_conv` (diffusers creates one exactly for those)."""
    try:
        base_dim, in_channels = shapes["encoder.conv_in.weight"][:2]
        z_dim = shapes["post_quant_conv.weight"][0]
        decoder_base_dim = shapes["decoder.norm_out.gamma"][0]
        out_channels = shapes["decoder.conv_out.weight"][0]
        stages = count_indexed(shapes, r"encoder\.down_blocks\.(\d+)\.")
        dim_mult = tuple(
            shapes[f"encoder.down_blocks.{i}.resnets.0.conv1.weight"][0] // base_dim for i in range(stages)
        )
        num_res_blocks = count_indexed(shapes, r"encoder\.down_blocks\.0\.resnets\.(\d+)\.")
    except KeyError as error:
        raise CheckpointError(
            f"{where}: the VAE tensor {error} is missing; the file is incomplete. Re-download it."
        ) from None
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
    data = read_json(path, "VAE config.json")
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


def _dtype(weight_dtype, file_dtype: str, where: str) -> torch.dtype:
    dtype = choose_dtype(weight_dtype, file_dtype, FLOAT_DTYPES, "VAE")
    if weight_dtype in (None, "default") and dtype == torch.float16:
        dtype = torch.bfloat16  # an fp16 file: the decoder overflows fp16 and bf16 keeps its range
    if dtype == torch.float16:
        warnings.warn(
            f"{where}: the Qwen-Image 2.1 VAE decoder overflows fp16 (white or NaN blocks in the image); "
            "use bf16 or fp32.",
            stacklevel=3,
        )
    return dtype


def _build(tensors: dict[str, TensorInfo], reader: WeightReader, config_path: Path | None, weight_dtype, device,
           where: str, path: Path) -> QwenImage21VAE:
    bare = rename_keys(tensors, _bare, where)
    layout = _detect_layout(bare, where)
    names = _canonical(bare, layout, where)
    shapes = {name: tensors[key].shape for name, key in names.items()}
    if layout == "comfyui":
        shapes = {name: (s[:2] + s[3:] if len(s) == 5 else s) for name, s in shapes.items()}
    config = infer_config(shapes, where)
    if config_path is not None:
        config = _config_from_json(config_path, config)
    with torch.device("meta"):
        model = QwenImage21VAE(config)
    plan = _plan(model, names, tensors, where)
    check_dtypes(tensors, dict.fromkeys(plan.values(), tuple(FILE_DTYPES)), where, "VAE")
    dtype = _dtype(weight_dtype, tensors[names["post_quant_conv.weight"]].dtype, where)
    # each tensor is converted straight into memory of its own (`WeightReader.load` copies): only one model copy
    state = {name: _convert(reader.load(key, dtype, device), name) for name, key in plan.items()}
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
    weights = find_weights(path, "vae", "a diffusers Qwen-Image-2.1 vae/ folder (config.json + "
                                        "diffusion_pytorch_model.safetensors)")
    tensors, _ = read_weight_headers(weights)
    with WeightReader(tensors) as reader:
        return _build(tensors, reader, weights.config, weight_dtype, device, Path(path).name, Path(path))


def vae_from_state_dict(state_dict: dict[str, torch.Tensor], weight_dtype="fp32", device="cpu",
                        config_path: Path | None = None) -> QwenImage21VAE:
    """The VAE from a state dict already in memory, in either layout (ComfyUI hands its loaders these).

    The weights are copied (the model never aliases the caller's tensors), so two copies exist until the
    caller drops its dict; for files, `load_vae` reads tensor by tensor instead.
    """
    tensors = infos_of(state_dict)
    return _build(tensors, WeightReader(tensors, state_dict), config_path, weight_dtype, device, "state dict", MEMORY)
