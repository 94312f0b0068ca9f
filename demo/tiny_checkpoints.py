"""A tiny random Qwen-Image 2.1 model set, written in every file layout the loaders accept.

`write_tiny_checkpoints(root)` fills a ComfyUI-style models folder with the released file names and layouts
(docs/checkpoints.md describes each), so the loaders, the nodes and the headless demo can run end to
end without the 30 GB of real weights:

    diffusion_models/qwen_image_2.1_bf16.safetensors        bare keys, fused img_mlp.gate_up = [gate; up]
    diffusion_models/qwen_image_2.1_turbo_bf16.safetensors  the same under `model.diffusion_model.`
    text_encoders/qwen3vl_8b_bf16.safetensors               model.layers.* / model.embed_tokens.* / model.norm.*
                                                            / model.visual.* / lm_head.weight
    text_encoders/qwen3vl_8b_bf16_tokenizer/                vocab.json + merges.txt + tokenizer_config.json
    vae/qwen_image_2.1_vae_bf16.safetensors                 Wan 2.2 names, causal convs 5-D [O, I, 1, kh, kw]
    loras/p_q_image_2.1_8_steps_v0.1_comfyui_bf16.safetensors   a rank-4 LoRA on every block (ComfyUI keys + alpha)
    loras/qwen_image_2.1_turbo_lora_avg_rank_178_bf16.safetensors  Turbo - Base extracted as ComfyUI's LoRA
                                                            extraction writes it (rank 8, .diff for the norms and
                                                            for img_in, proj_out and the timestep linear_1)
    model_patches/qwen_image_2.1_fun_controlnet_union_bf16.safetensors
                                                            a 1-block Fun ControlNet (Comfy-Org's fused layout)
    diffusers/Qwen-Image-2.1/                               model_index.json, scheduler/, transformer/ (2 shards
                                                            + index), vae/, text_encoder/ (2 shards + index),
                                                            processor/ (tokenizer.json + preprocessor_config.json)
    diffusers/Qwen-Image-2.1-Turbo/                         the same with `sample_sigmas`, Turbo's scheduler and
                                                            one text_encoder/model.safetensors

The model keeps the released structure at toy size and is consistent across components: the DiT has 2 blocks
of 2 heads x 32 (RoPE axes 4/14/14, the released 1/8 + 7/16 + 7/16 split), SwiGLU ratio 3 and text width 16 =
the text encoder's hidden size; the VAE keeps 64 latent channels, 16x compression, RGBA and the released stage
plan (temporal stages 1-3, hence the `time_conv` weights) at widths 4/6; Qwen3-VL has 3 decoder layers of
width 16 (2 query heads, 1 KV head of 8) and a 27-block vision tower of width 64 with 16 heads and the 8B's
DeepStack layers 8/16/24. Values no tensor shape reveals (rope theta, eps, M-RoPE split, vision heads,
DeepStack layers, RoPE axes) follow the rules the loaders apply to a single file, so every layout of a
component loads to the same config. The embedding and LM head keep Qwen's 151936 rows, because the tokenizer's
special tokens keep their real ids (151643...): three copies of those and of the 151k-entry vocabulary
are most of the ~55 MB the set takes.

Weights are drawn from a seeded generator: matrices N(0, 1/fan_in), norm scales 1 + N(0, 0.1^2) (the DiT's
zero-centred text norm stores scale - 1), biases N(0, 0.05^2). Base and Turbo DiTs differ (Turbo is a
distillate); the text encoder and the VAE are the same in every file, as in the release. Storage follows the
release: bf16 everywhere except the diffusers VAE, which is fp32 holding the same bf16-representable values, so
every layout of a component holds bit-identical weights (load both at the same weight_dtype to compare).

Only runtime dependencies are used (torch, safetensors, transformers, tokenizers): never diffusers. Import this
module as part of the pack (`qi21.demo.tiny_checkpoints`, once demo/pack_import.py has registered the repository
under that name).
"""

import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from ..model.encoders import transformers_compat as compat
from ..model.loaders.text_encoder import MAX_POSITIONS, RMS_NORM_EPS, ROPE_THETA, VISION_HEADS
from ..model.sampling.schedule import TURBO_SIGMAS
from ..model.transformer.dit import DiTConfig, QwenImage21DiT
from ..model.vae.autoencoder import QwenImage21VAE, QwenImage21VAEConfig
from .tiny_tokenizer import QWEN_VOCAB_ROWS, write_processor, write_qwen2_tokenizer

#: The tiny DiT. Text width = the tiny text encoder's hidden size.
TINY_DIT = DiTConfig(num_layers=2, num_heads=2, head_dim=32, context_in_dim=16, mlp_ratio=3, axes_dims_rope=(4, 14, 14))
#: The tiny VAE: the released stages, 64 latent channels and 16x compression, 4/6 channels wide.
TINY_VAE = QwenImage21VAEConfig(base_dim=4, decoder_base_dim=6, z_dim=64, dim_mult=(1, 2, 4, 8, 8), num_res_blocks=2,
                                temporal_downsample=(False, True, True, True))

#: Released file names and diffusers repository names (docs/checkpoints.md).
DIT_FILE, TURBO_DIT_FILE = "qwen_image_2.1_bf16.safetensors", "qwen_image_2.1_turbo_bf16.safetensors"
TEXT_ENCODER_FILE = "qwen3vl_8b_bf16.safetensors"
VAE_FILE = "qwen_image_2.1_vae_bf16.safetensors"
SPEED_LORA_FILE = "p_q_image_2.1_8_steps_v0.1_comfyui_bf16.safetensors"  # the speed-LoRA workflow's file
TURBO_LORA_FILE = "qwen_image_2.1_turbo_lora_avg_rank_178_bf16.safetensors"  # the Turbo-LoRA workflow's file
#: Layers the tiny Turbo LoRA stores in full (`.diff`), as one community Turbo extract does.
TURBO_LORA_FULL = ("img_in", "proj_out", "time_text_embed.timestep_embedder.linear_1")
CONTROLNET_FILE = "qwen_image_2.1_fun_controlnet_union_bf16.safetensors"  # Comfy-Org's name for the control net
BASE_REPO, TURBO_REPO = "Qwen-Image-2.1", "Qwen-Image-2.1-Turbo"
COMFY_DIT_PREFIX = "model.diffusion_model."  # seen in the wild; the Turbo file uses it to cover that layout
SAFETENSORS_METADATA = {"format": "pt"}  # what transformers and diffusers write

#: `model_index.json` of the diffusers repositories (docs/checkpoints.md); Turbo adds `sample_sigmas`.
MODEL_INDEX = {
    "_class_name": "QwenImage21Pipeline",
    "_diffusers_version": "0.42.1",
    "processor": ["transformers", "Qwen3VLProcessor"],
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
    "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage21"],
}
#: `scheduler/scheduler_config.json` of Base (docs/schedule.md); Turbo turns the shifts off.
BASE_SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.42.1", "num_train_timesteps": 1000,
    "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 0.9, "base_image_seq_len": 256,
    "max_image_seq_len": 8192, "shift_terminal": 0.02, "time_shift_type": "exponential", "invert_sigmas": False,
    "stochastic_sampling": False, "use_karras_sigmas": False, "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
}
TURBO_SCHEDULER = dict(BASE_SCHEDULER, use_dynamic_shifting=False, shift=1.0, shift_terminal=None)


# -- random weights -------------------------------------------------------------------------------------------
def _random(shape, kind: str, generator: torch.Generator) -> torch.Tensor:
    """fp32 values that are exactly representable in bf16, so every file layout holds the same numbers.

    kind: "matrix" N(0, 1/fan_in) (fan_in = all dims but the first), "scale" 1 + N(0, 0.1^2),
    "scale-1" N(0, 0.1^2) (a zero-centred norm's stored `scale - 1`), "bias" N(0, 0.05^2), "embedding" N(0, 1).
    """
    values = torch.randn(shape, generator=generator, dtype=torch.float32)
    if kind == "matrix":
        values /= math.sqrt(math.prod(shape[1:]))
    elif kind == "scale":
        values = 1 + 0.1 * values
    elif kind == "scale-1":
        values *= 0.1
    elif kind == "bias":
        values *= 0.05
    elif kind != "embedding":
        raise ValueError(f"unknown weight kind {kind!r}")
    return values.bfloat16().float()


def _meta_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}


# -- DiT (docs/checkpoints.md) -------------------------------------------------------------------------------
#: Our parameter names -> diffusers names (rows split in order where one of ours fuses several).
DIT_TOP_LEVEL = {
    "time_embed.linear_1.weight": "time_text_embed.timestep_embedder.linear_1.weight",
    "time_embed.linear_2.weight": "time_text_embed.timestep_embedder.linear_2.weight",
    "txt_in.text_norm.weight": "txt_in.text_norm.weight",
    "txt_in.in_layer.weight": "txt_in.in_layer.weight",
    "txt_in.out_layer.weight": "txt_in.out_layer.weight",
    "img_in.weight": "img_in.weight",
    "modulation.weight": "modulation.1.weight",
    "norm_out.weight": "norm_out.linear.weight",
    "proj_out.weight": "proj_out.weight",
}
DIT_BLOCK = {
    "qkv.weight": ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight"),
    "norm_q": ("attn.norm_q.weight",),
    "norm_k": ("attn.norm_k.weight",),
    "to_out.weight": ("attn.to_out.0.weight",),
    "gate_up.weight": ("img_mlp.gate_layer.weight", "img_mlp.proj.weight"),  # gate (SiLU branch) first
    "down.weight": ("img_mlp.out.weight",),
}


def dit_state_dict(config: DiTConfig = TINY_DIT, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random DiT with our architecture (`QwenImage21DiT(config)`), in diffusers' layout (split MLP, fp32)."""
    with torch.device("meta"):
        shapes = _meta_shapes(QwenImage21DiT(config))
    generator = torch.Generator().manual_seed(seed)
    ours = {}
    for name, shape in shapes.items():
        kind = "scale-1" if name == "txt_in.text_norm.weight" else "scale" if len(shape) == 1 else "matrix"
        ours[name] = _random(shape, kind, generator)
    return dit_to_diffusers(ours)


def dit_to_diffusers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our DiT parameter names (`QwenImage21DiT.state_dict()`) -> diffusers' layout, fused rows split in order."""
    out = {}
    for name, tensor in state.items():
        if name in DIT_TOP_LEVEL:
            targets = (DIT_TOP_LEVEL[name],)
        else:
            match = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
            if match is None or match.group(2) not in DIT_BLOCK:
                raise KeyError(f"the DiT has a parameter {name!r} that no file layout names; update DIT_BLOCK")
            targets = tuple(f"transformer_blocks.{match.group(1)}.{part}" for part in DIT_BLOCK[match.group(2)])
        for target, part in zip(targets, tensor.chunk(len(targets))):
            out[target] = part.contiguous()
    return out


def diffusers_to_dit(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`dit_to_diffusers` backwards: diffusers' DiT keys -> our parameter names, split rows fused again."""
    blocks = sorted({int(k.split(".")[1]) for k in state if k.startswith("transformer_blocks.")})
    out = {ours: state[theirs] for ours, theirs in DIT_TOP_LEVEL.items()}
    for i in blocks:
        for ours, parts in DIT_BLOCK.items():
            out[f"blocks.{i}.{ours}"] = torch.cat([state[f"transformer_blocks.{i}.{part}"] for part in parts])
    return out


def lora_state_dict(config: DiTConfig = TINY_DIT, seed: int = 0, rank: int = 4) -> dict[str, torch.Tensor]:
    """A random LoRA on every block's attention and MLP in ComfyUI's format (`diffusion_model.` + the module name,
    `lora_down`/`lora_up`, `alpha` = rank), small enough to leave the images sane."""
    generator = torch.Generator().manual_seed(seed)
    width, hidden = config.width, config.mlp_hidden
    modules = (("attn.to_q", width, width), ("attn.to_k", width, width), ("attn.to_v", width, width),
               ("attn.to_out.0", width, width), ("img_mlp.gate_layer", width, hidden),
               ("img_mlp.proj", width, hidden), ("img_mlp.out", hidden, width))
    out = {}
    for i in range(config.num_layers):
        for module, fan_in, fan_out in modules:
            stem = f"diffusion_model.transformer_blocks.{i}.{module}"
            out[stem + ".lora_down.weight"] = torch.randn(rank, fan_in, generator=generator) / math.sqrt(fan_in)
            out[stem + ".lora_up.weight"] = 0.1 * torch.randn(fan_out, rank, generator=generator) / math.sqrt(rank)
            out[stem + ".alpha"] = torch.tensor(float(rank))
    return out


def controlnet_state_dict(config: DiTConfig = TINY_DIT, seed: int = 0, blocks: int = 1) -> dict[str, torch.Tensor]:
    """A random Fun ControlNet Union for a DiT of `config` in Comfy-Org's layout (bare keys, fused
    `img_mlp.gate_up`), with a small `after_proj` so the control steers without swamping the tiny DiT."""
    generator = torch.Generator().manual_seed(seed)
    width, hidden, head_dim = config.width, config.mlp_hidden, config.head_dim
    out = {"control_img_in.weight": _random((width, 129), "matrix", generator),
           "control_img_in.bias": _random((width,), "bias", generator)}
    for i in range(blocks):
        p = f"control_blocks.{i}."
        for name in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"):
            out[p + name + ".weight"] = _random((width, width), "matrix", generator)
        out[p + "attn.norm_q.weight"] = _random((head_dim,), "scale", generator)
        out[p + "attn.norm_k.weight"] = _random((head_dim,), "scale", generator)
        out[p + "img_mlp.gate_up.weight"] = _random((2 * hidden, width), "matrix", generator)
        out[p + "img_mlp.out.weight"] = _random((width, hidden), "matrix", generator)
        for proj in ("after_proj",) + (("before_proj",) if i == 0 else ()):
            out[p + proj + ".weight"] = (0.3 * _random((width, width), "matrix", generator)).bfloat16().float()
            out[p + proj + ".bias"] = _random((width,), "bias", generator)
    return out


def extracted_lora_state_dict(base: dict[str, torch.Tensor], other: dict[str, torch.Tensor], rank: int,
                              full=(), prefix: str = "diffusion_model.") -> dict[str, torch.Tensor]:
    """`other - base` (two state dicts with the same keys, e.g. ComfyUI's DiT layout) as ComfyUI's LoRA extraction
    writes it ("standard" type, bias_diff on): each 2-D weight as a rank-`rank` `lora_up` (U times the singular
    values) / `lora_down` (V^T) pair from the SVD of its difference, each 1-D weight and each module in `full` as
    a `.diff`, each bias as a `.diff_b`; every tensor in fp16, no alpha (scale 1). Unlike ComfyUI the factors
    are not clamped at a quantile, so the pairs are the plain truncated SVD."""
    out = {}
    for key, value in base.items():
        module, _, kind = key.rpartition(".")
        diff = other[key].float() - value.float()
        if kind == "bias":
            out[f"{prefix}{module}.diff_b"] = diff.half()
        elif diff.ndim < 2 or module in full:
            out[f"{prefix}{module}.diff"] = diff.half()
        else:
            u, s, vh = torch.linalg.svd(diff, full_matrices=False)
            r = min(rank, *diff.shape)
            out[f"{prefix}{module}.lora_up.weight"] = (u[:, :r] * s[:r]).half().contiguous()
            out[f"{prefix}{module}.lora_down.weight"] = vh[:r].half().contiguous()
    return out


def comfy_dit_state_dict(diffusers_sd: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """ComfyUI's single-file layout: each block's `img_mlp.gate_up` = cat[gate_layer; proj], other keys as is."""
    out = {}
    for key, tensor in diffusers_sd.items():
        if key.endswith("img_mlp.proj.weight"):
            continue
        if key.endswith("img_mlp.gate_layer.weight"):
            block = key[: -len("gate_layer.weight")]
            key, tensor = block + "gate_up.weight", torch.cat([tensor, diffusers_sd[block + "proj.weight"]])
        out[prefix + key] = tensor
    return out


def dit_config_json(config: DiTConfig) -> dict:
    """`transformer/config.json` for `config`."""
    return {
        "_class_name": "QwenImage21Transformer2DModel", "_diffusers_version": "0.42.1", "patch_size": 1,
        "in_channels": config.in_channels, "out_channels": config.out_channels, "num_layers": config.num_layers,
        "attention_head_dim": config.head_dim, "num_attention_heads": config.num_heads,
        "context_in_dim": config.context_in_dim, "mlp_ratio": config.mlp_ratio,
        "axes_dims_rope": list(config.axes_dims_rope), "eps": config.eps, "causal_condition": config.causal_condition,
    }


# -- VAE (docs/checkpoints.md) -------------------------------------------------------------------------------
def vae_state_dict(config: QwenImage21VAEConfig = TINY_VAE, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random VAE with our architecture (`QwenImage21VAE(config)`) in diffusers' layout (`vae_to_diffusers`)."""
    with torch.device("meta"):
        shapes = _meta_shapes(QwenImage21VAE(config))
    shapes.update(_time_conv_shapes(shapes, config))
    generator = torch.Generator().manual_seed(seed)
    ours = {}
    for name, shape in sorted(shapes.items()):
        kind = "scale" if name.endswith(".gamma") else "bias" if name.endswith(".bias") else "matrix"
        ours[name] = _random(shape, kind, generator)
    return vae_to_diffusers(ours, config)


def _time_conv_shapes(shapes: dict[str, tuple], config: QwenImage21VAEConfig) -> dict[str, tuple]:
    """The `time_conv` weights diffusers has for the temporal stages (encoder `[C, C, 1, 1]`, decoder `[2C, C, 1,
    1]`); a single frame never runs them, so our VAE has none."""
    stages, out = len(config.dim_mult) - 1, {}
    for i, temporal in enumerate(config.temporal_downsample):
        if temporal:
            channels = shapes[f"encoder.down_blocks.{i}.downsampler.resample.1.weight"][0]
            out[f"encoder.down_blocks.{i}.downsampler.time_conv.weight"] = (channels, channels, 1, 1)
            out[f"encoder.down_blocks.{i}.downsampler.time_conv.bias"] = (channels,)
        if config.temporal_downsample[stages - 1 - i]:  # the decoder mirrors the encoder
            channels = shapes[f"decoder.up_blocks.{i}.upsampler.resample.1.weight"][1]
            out[f"decoder.up_blocks.{i}.upsampler.time_conv.weight"] = (2 * channels, channels, 1, 1)
            out[f"decoder.up_blocks.{i}.upsampler.time_conv.bias"] = (2 * channels,)
    return out


def vae_to_diffusers(state: dict[str, torch.Tensor], config: QwenImage21VAEConfig) -> dict[str, torch.Tensor]:
    """Our VAE parameters (`QwenImage21VAE.state_dict()`, whose names are diffusers') in diffusers' layout:
    resnet/head gammas `[C, 1, 1, 1]`, attention gammas `[C, 1, 1]`, and zero `time_conv` weights where `state`
    has none (unused by a single frame, present in the release)."""
    out = {}
    for name, tensor in sorted(state.items()):
        if name.endswith(".gamma"):
            tensor = tensor.reshape((-1, 1, 1) if ".attentions." in name else (-1, 1, 1, 1))
        out[name] = tensor.contiguous()
    for name, shape in _time_conv_shapes({k: tuple(v.shape) for k, v in state.items()}, config).items():
        out.setdefault(name, torch.zeros(shape))
    return out


#: diffusers part of a resnet -> its index in ComfyUI's `residual` Sequential (norm, SiLU, conv, norm, SiLU,
#: dropout, conv), or `shortcut`.
WAN_RESIDUAL = {"norm1": "residual.0", "conv1": "residual.2", "norm2": "residual.3", "conv2": "residual.6",
                "conv_shortcut": "shortcut"}


def wan_vae_key(name: str, num_res_blocks: int) -> str:
    """ComfyUI's Wan 2.2 name (docs/checkpoints.md) for a diffusers VAE key."""
    side, _, rest = name.partition(".")
    if side in ("quant_conv", "post_quant_conv"):
        return {"quant_conv": "conv1", "post_quant_conv": "conv2"}[side] + "." + rest
    head = {"conv_in": "conv1", "norm_out": "head.0", "conv_out": "head.2"}
    block, _, rest = rest.partition(".")
    if block in head:
        return f"{side}.{head[block]}.{rest}"
    if block == "mid_block":  # middle = [resnet 0, attention, resnet 1]
        kind, index, rest = rest.split(".", 2)
        if kind == "attentions":
            return f"{side}.middle.1.{rest}"
        part, _, leaf = rest.partition(".")
        return f"{side}.middle.{2 * int(index)}.{WAN_RESIDUAL[part]}.{leaf}"
    stage = {"down_blocks": "downsamples", "up_blocks": "upsamples"}[block]
    index, kind, rest = rest.split(".", 2)
    if kind in ("downsampler", "upsampler"):  # the resampler follows the stage's resnets
        slot = num_res_blocks if side == "encoder" else num_res_blocks + 1
        return f"{side}.{stage}.{index}.{stage}.{slot}.{rest}"
    resnet, part, leaf = rest.split(".", 2)
    return f"{side}.{stage}.{index}.{stage}.{resnet}.{WAN_RESIDUAL[part]}.{leaf}"


def comfy_vae_state_dict(diffusers_sd: dict[str, torch.Tensor], num_res_blocks: int) -> dict[str, torch.Tensor]:
    """ComfyUI's single file: Wan names, and the causal 3D convolutions' weights 5-D `[O, I, 1, kh, kw]`
    (conv_in/out, resnet convs and shortcuts, time_conv, quant convs); `resample.1`, `to_qkv`, `proj` stay 2D."""
    out = {}
    for name, tensor in diffusers_sd.items():
        causal = (name.endswith(".weight") and tensor.ndim == 4
                  and not re.search(r"resample\.1\.|to_qkv\.|\.proj\.", name))
        out[wan_vae_key(name, num_res_blocks)] = tensor.unsqueeze(2) if causal else tensor
    return out


def vae_config_json(config: QwenImage21VAEConfig) -> dict:
    """`vae/config.json` for `config`."""
    return {
        "_class_name": "AutoencoderKLQwenImage21", "_diffusers_version": "0.42.1", "base_dim": config.base_dim,
        "decoder_base_dim": config.decoder_base_dim, "z_dim": config.z_dim, "dim_mult": list(config.dim_mult),
        "num_res_blocks": config.num_res_blocks, "attn_scales": [],
        "temperal_downsample": list(config.temporal_downsample), "dropout": 0.0, "is_residual": True,
        "in_channels": config.in_channels, "out_channels": config.out_channels, "patch_size": None,
        "latents_mean": list(config.latents_mean), "latents_std": list(config.latents_std),
        "scale_factor_spatial": config.spatial_compression, "scale_factor_temporal": 8,
    }


# -- text encoder (docs/checkpoints.md) ----------------------------------------------------------------------
def tiny_text_encoder_config() -> Qwen3VLConfig:
    """A tiny Qwen3-VL whose unseen values are the ones `loaders/text_encoder.py` assumes for a single file.

    M-RoPE split [2, 1, 1] is the released [24, 20, 20] scaled to head_dim 8 (`_scaled_mrope`); a 27-block tower
    gets the 8B's DeepStack layers. One VLM token is still 32x32 px (patch 16, merge 2).
    """
    text = dict(vocab_size=QWEN_VOCAB_ROWS, hidden_size=TINY_DIT.context_in_dim, intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=8, attention_bias=False,
                rms_norm_eps=RMS_NORM_EPS, max_position_embeddings=MAX_POSITIONS,
                **compat.text_rope_settings(ROPE_THETA, [2, 1, 1]))
    vision = dict(depth=27, hidden_size=64, intermediate_size=48, num_heads=VISION_HEADS,
                  out_hidden_size=TINY_DIT.context_in_dim, in_channels=3, patch_size=16, temporal_patch_size=2,
                  spatial_merge_size=2, num_position_embeddings=64, deepstack_visual_indexes=[8, 16, 24])
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


def text_encoder_state_dict(config: Qwen3VLConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """transformers' `Qwen3VLForConditionalGeneration` names (LM head included), random fp32 weights."""
    with torch.device("meta"):
        shapes = _meta_shapes(Qwen3VLForConditionalGeneration(config))
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        if len(shape) == 1:
            kind = "scale" if name.endswith(".weight") else "bias"
        else:
            kind = "embedding" if "embed_tokens" in name else "matrix"
        out[name] = _random(shape, kind, generator)
    return out


def comfy_text_encoder_key(key: str) -> str:
    """transformers' key -> ComfyUI's single-file key: the language model flattened under `model.`."""
    return "model." + key[len("model.language_model."):] if key.startswith("model.language_model.") else key


# -- files ----------------------------------------------------------------------------------------------------
def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _save(tensors: dict[str, torch.Tensor], path: Path, dtype: torch.dtype) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(path), metadata=SAFETENSORS_METADATA)
    return path


def _save_sharded(tensors: dict[str, torch.Tensor], folder: Path, stem: str, dtype: torch.dtype,
                  shards: int = 2) -> Path:
    """`{stem}-0000k-of-0000n.safetensors` + `{stem}.safetensors.index.json`, as `save_pretrained` shards."""
    names = sorted(tensors)
    size = math.ceil(len(names) / shards)
    weight_map, total = {}, 0
    for k in range(shards):
        file = f"{stem}-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[k * size: (k + 1) * size]}
        _save(part, folder / file, dtype)
        weight_map.update({name: file for name in part})
        total += sum(t.numel() * dtype.itemsize for t in part.values())
    index = folder / f"{stem}.safetensors.index.json"
    _write_json(index, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return index


@dataclass(frozen=True)
class ModelWeights:
    """DiTs and VAE to write instead of random ones (the trained toy, demo/toy_model.py), in diffusers' layout."""

    dit_config: DiTConfig
    vae_config: QwenImage21VAEConfig
    base_dit: dict
    turbo_dit: dict
    vae: dict


def write_tiny_checkpoints(root: Path, seed: int = 0, weights: ModelWeights | None = None) -> dict[str, Path]:
    """Write the tiny random model set under `root` (a ComfyUI models folder); returns where everything is.

    Keys of the result: "root"; the single files "dit", "turbo_dit", "text_encoder", "tokenizer", "vae", "lora",
    "turbo_lora", "controlnet"; the diffusers repositories "diffusers_base", "diffusers_turbo". Existing files are
    overwritten. The same seed gives the same weights. `weights` replaces the random DiTs and VAE in every layout
    (the LoRAs and the control net are then random ones of that DiT's size; the text encoder is always this one).
    """
    root = Path(root)
    bf16 = torch.bfloat16
    dit_config, vae_config = (weights.dit_config, weights.vae_config) if weights else (TINY_DIT, TINY_VAE)
    base_dit = weights.base_dit if weights else dit_state_dict(TINY_DIT, seed)
    turbo_dit = weights.turbo_dit if weights else dit_state_dict(TINY_DIT, seed + 1)  # a distilled set of weights
    vae = weights.vae if weights else vae_state_dict(TINY_VAE, seed + 2)
    te_config = tiny_text_encoder_config()
    text_encoder = text_encoder_state_dict(te_config, seed + 3)

    paths = {
        "root": root,
        "dit": _save(comfy_dit_state_dict(base_dit), root / "diffusion_models" / DIT_FILE, bf16),
        "turbo_dit": _save(comfy_dit_state_dict(turbo_dit, COMFY_DIT_PREFIX),
                           root / "diffusion_models" / TURBO_DIT_FILE, bf16),
        "text_encoder": _save({comfy_text_encoder_key(k): v for k, v in text_encoder.items()},
                              root / "text_encoders" / TEXT_ENCODER_FILE, bf16),
        "vae": _save(comfy_vae_state_dict(vae, vae_config.num_res_blocks), root / "vae" / VAE_FILE, bf16),
        "lora": _save(lora_state_dict(dit_config, seed + 4), root / "loras" / SPEED_LORA_FILE, bf16),
        "turbo_lora": _save(extracted_lora_state_dict(*({k: v.to(bf16) for k, v in comfy_dit_state_dict(sd).items()}
                                                        for sd in (base_dit, turbo_dit)), 8, TURBO_LORA_FULL),
                            root / "loras" / TURBO_LORA_FILE, torch.float16),  # the files' bf16 values, in fp16
        "controlnet": _save(controlnet_state_dict(dit_config, seed + 5), root / "model_patches" / CONTROLNET_FILE,
                            bf16),
    }
    tokenizer = root / "text_encoders" / (Path(TEXT_ENCODER_FILE).stem + "_tokenizer")  # found by find_tokenizer_dir
    shutil.rmtree(tokenizer, ignore_errors=True)
    paths["tokenizer"] = write_qwen2_tokenizer(tokenizer)

    te_json = te_config.to_dict()
    te_json.update(architectures=["Qwen3VLForConditionalGeneration"], dtype="bfloat16")
    for key, repo, dit, sigmas, scheduler in (
        ("diffusers_base", BASE_REPO, base_dit, None, BASE_SCHEDULER),
        ("diffusers_turbo", TURBO_REPO, turbo_dit, TURBO_SIGMAS, TURBO_SCHEDULER),
    ):
        folder = root / "diffusers" / repo
        shutil.rmtree(folder, ignore_errors=True)
        index = dict(MODEL_INDEX, **({"sample_sigmas": list(sigmas)} if sigmas else {}))
        _write_json(folder / "model_index.json", index)
        _write_json(folder / "scheduler" / "scheduler_config.json", scheduler)
        _write_json(folder / "transformer" / "config.json", dit_config_json(dit_config))
        _save_sharded(dit, folder / "transformer", "diffusion_pytorch_model", bf16)
        _write_json(folder / "vae" / "config.json", vae_config_json(vae_config))
        _save(vae, folder / "vae" / "diffusion_pytorch_model.safetensors", torch.float32)  # the release's VAE is fp32
        _write_json(folder / "text_encoder" / "config.json", te_json)
        if sigmas:  # Turbo ships its (identical) text encoder as one file, Base sharded
            _save(text_encoder, folder / "text_encoder" / "model.safetensors", bf16)
        else:
            _save_sharded(text_encoder, folder / "text_encoder", "model", bf16)
        write_processor(tokenizer, folder / "processor")
        paths[key] = folder
    return paths
