"""What every reader of a DiT-shaped file shares: the key plan (file keys -> our parameters, fused or split
MLP), the config inferred from shapes alone, the shape check against that config, and Base/Turbo from a name.

The safetensors loader (`dit.py`), the GGUF loader (`gguf.py`) and the LoRA reader (`lora.py`) all build on these;
nothing here reads a file.
"""

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..transformer.dit import DiTConfig, QwenImage21DiT
from .checkpoint import CheckpointError, TensorInfo, count_indexed, identify_checkpoint, infos_of, shown
from .trained_for import TrainedFor

COMFY_PREFIX = "model.diffusion_model."
DETECT_KEYS = ("txt_in.text_norm.weight", "modulation.1.weight", "transformer_blocks.0.attn.norm_q.weight",
               "img_in.weight", "proj_out.weight")


@dataclass(frozen=True)
class DiTSource:
    """What was loaded: the path, its layout, the variant ("base", "turbo" or "unknown") and how we know."""

    path: Path
    layout: str  # "comfyui", "diffusers" or "gguf"
    variant: str
    variant_from: str
    # A diffusers folder's own Turbo grid (`sample_sigmas` of model_index.json, else of the scheduler config),
    # without the terminal 0; None when the files give none (single files, Base).
    sigmas: tuple[float, ...] | None = None
    quantized: tuple[str, ...] = ()  # the formats of a ComfyUI quantized file ("int8_tensorwise", ...)
    trained_for: TrainedFor | None = None  # the sizes / CFG the file says its model draws at (trained_for.py)


def file_plan(config: DiTConfig, fused_mlp: bool) -> dict[str, list[str]]:
    """Our parameter name -> the file keys concatenated (along rows) to make it."""
    plan = {
        "time_embed.linear_1.weight": ["time_text_embed.timestep_embedder.linear_1.weight"],
        "time_embed.linear_2.weight": ["time_text_embed.timestep_embedder.linear_2.weight"],
        "txt_in.text_norm.weight": ["txt_in.text_norm.weight"],
        "txt_in.in_layer.weight": ["txt_in.in_layer.weight"],
        "txt_in.out_layer.weight": ["txt_in.out_layer.weight"],
        "img_in.weight": ["img_in.weight"],
        "modulation.weight": ["modulation.1.weight"],
        "norm_out.weight": ["norm_out.linear.weight"],
        "proj_out.weight": ["proj_out.weight"],
    }
    for i in range(config.num_layers):
        src, dst = f"transformer_blocks.{i}.", f"blocks.{i}."
        plan[dst + "qkv.weight"] = [src + f"attn.to_{x}.weight" for x in "qkv"]
        plan[dst + "norm_q"] = [src + "attn.norm_q.weight"]
        plan[dst + "norm_k"] = [src + "attn.norm_k.weight"]
        plan[dst + "to_out.weight"] = [src + "attn.to_out.0.weight"]
        plan[dst + "gate_up.weight"] = (
            [src + "img_mlp.gate_up.weight"] if fused_mlp
            else [src + "img_mlp.gate_layer.weight", src + "img_mlp.proj.weight"]
        )
        plan[dst + "down.weight"] = [src + "img_mlp.out.weight"]
    return plan


def convert_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A file-layout state dict (diffusers or ComfyUI, any prefix) as our parameter names, in memory."""
    state_dict = {strip_prefix(k): v for k, v in state_dict.items()}
    config = infer_config(infos_of(state_dict))
    fused = "transformer_blocks.0.img_mlp.gate_up.weight" in state_dict
    return {name: torch.cat([state_dict[k] for k in keys]) for name, keys in file_plan(config, fused).items()}


def strip_prefix(key: str) -> str:
    return key.removeprefix(COMFY_PREFIX)


def infer_config(tensors: dict[str, TensorInfo], where: str = "checkpoint") -> DiTConfig:
    """The DiT config from tensor shapes alone (keys without prefix)."""
    missing = [key for key in DETECT_KEYS if key not in tensors]
    mlp_keys = ("transformer_blocks.0.img_mlp.gate_up.weight", "transformer_blocks.0.img_mlp.proj.weight")
    if missing or not any(key in tensors for key in mlp_keys):
        raise CheckpointError(
            f"{where} is {identify_checkpoint(tensors)}, not a Qwen-Image 2.1 DiT"
            + (f" (missing {', '.join(missing)})" if missing else "")
            + ". Put Qwen-Image 2.1 transformer files (qwen_image_2.1_bf16.safetensors or a diffusers "
            "Qwen-Image-2.1 folder) in models/diffusion_models."
        )
    # the shapes read below, by rank (a 5-D or 0-D img_in must be named, not fail to unpack)
    check_ranks(tensors, {key: (1 if key.endswith("norm.weight") or key.endswith("norm_q.weight") else 2)
                          for key in (*DETECT_KEYS, *mlp_keys) if key in tensors}, where)
    head_dim = tensors["transformer_blocks.0.attn.norm_q.weight"].shape[0]
    width, in_channels = tensors["img_in.weight"].shape
    layers = count_indexed(tensors, r"transformer_blocks\.(\d+)\.")
    if "transformer_blocks.0.img_mlp.gate_up.weight" in tensors:
        hidden = tensors["transformer_blocks.0.img_mlp.gate_up.weight"].shape[0] // 2
    else:
        hidden = tensors["transformer_blocks.0.img_mlp.proj.weight"].shape[0]
    if min(width, head_dim, hidden) <= 0 or width % head_dim or hidden % width or head_dim % 32:
        raise CheckpointError(
            f"{where}: width {width}, head size {head_dim} and MLP size {hidden} do not fit together."
        )
    # RoPE axes are not in the weights: the release splits its 128-dim heads 16/56/56, i.e. 1/8 + 7/16 + 7/16.
    rope_axes = (head_dim // 8, head_dim * 7 // 16, head_dim * 7 // 16)
    return DiTConfig(
        in_channels=in_channels,
        out_channels=tensors["proj_out.weight"].shape[0],
        num_layers=layers,
        num_heads=width // head_dim,
        head_dim=head_dim,
        context_in_dim=tensors["txt_in.text_norm.weight"].shape[0],
        mlp_ratio=hidden // width,
        axes_dims_rope=rope_axes,
    )


def variant_from_name(path: Path) -> tuple[str, str]:
    name = path.name.lower()
    if "turbo" in name:
        return "turbo", "file name"
    if re.search(r"qwen[-_ ]?image[-_ ]?2\.?1", name):
        return "base", "file name"
    return "unknown", "nothing in the files says"


def check_ranks(tensors: dict[str, TensorInfo], ranks: dict[str, int], where: str) -> None:
    """Refuse a tensor whose number of dimensions is not `ranks[key]`, before anything unpacks its shape."""
    for key, rank in ranks.items():
        shape = tuple(tensors[key].shape)
        if len(shape) != rank:
            raise CheckpointError(
                f"{where}: {shown(key)} has {len(shape)} dimensions {list(shape)[:8]}; in a Qwen-Image 2.1 DiT it has "
                f"{rank}. The file is damaged or from another model; download it again."
            )


def check_shapes(plan, tensors, config: DiTConfig, where: str) -> None:
    needed = {key for keys in plan.values() for key in keys}
    missing = sorted(needed - tensors.keys())
    if missing:
        raise CheckpointError(
            f"{where}: {len(missing)} DiT tensors are missing (e.g. {', '.join(missing[:3])}); the file is incomplete "
            "or from another model. Re-download it."
        )
    unexpected = sorted(tensors.keys() - needed)
    if unexpected:
        raise CheckpointError(
            f"{where}: {len(unexpected)} tensors that a Qwen-Image 2.1 DiT does not have "
            f"(e.g. {', '.join(shown(key, 60) for key in unexpected[:3])}); this is not a plain Qwen-Image 2.1 "
            "transformer."
        )
    with torch.device("meta"):
        reference = QwenImage21DiT(config).state_dict()
    check_ranks(tensors, {key: reference[name].dim() for name, keys in plan.items() for key in keys}, where)
    for name, keys in plan.items():
        rows = sum(tensors[k].shape[0] for k in keys)
        expected = tuple(reference[name].shape)
        got = (rows, *tensors[keys[0]].shape[1:])
        if got != expected or any(tensors[k].shape[1:] != tensors[keys[0]].shape[1:] for k in keys):
            raise CheckpointError(
                f"{where}: {keys[0]} has shape {tensors[keys[0]].shape}, expected rows of {expected}."
            )
