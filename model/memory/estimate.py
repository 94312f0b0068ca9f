"""How much memory a sampling run needs, predicted before anything is allocated, so a request that cannot fit is
refused with numbers instead of growing until the operating system kills the process.

This is a deliberately conservative estimate (it over- rather than under-counts) of the peak a run adds on top
of the resident weights: the noise and latent buffers, the prefix cache, and the largest transient of one DiT
forward (the prefill, which runs every prefix and target row through a block). Per block the live tensors are
the row buffer and its modulated copy, q/k in fp32 (they are normed and rotated in fp32), v and the attention
output, and the two halves of the SwiGLU hidden state.

The memory planner (`planner.py`) builds every DiT phase on this estimate (adding the weights on the device, the
target attention's K/V concatenation off the CPU and a fixed allowance for workspaces), and the samplers refuse a
run that fits no plan through it (`planner.PlanError`).
"""

import functools
from dataclasses import dataclass

import torch
from torch import nn

from ..transformer.dit import DiTConfig
from ..vae.autoencoder import QwenImage21VAEConfig, VAETiling
from .weights import LayeredWeights, module_tensors, tensor_bytes

GIB = 1024**3
FP32 = 4


@dataclass(frozen=True)
class RunEstimate:
    latents: int  # noise, latents in two dtypes, the step's velocity and denoised estimate
    cache: int  # the prefix cache (0 with prefix_cache off)
    step: int  # the largest transient of one forward
    rows: int  # rows of the largest forward (prefixes + samples x target tokens)

    @property
    def total(self) -> int:
        return self.latents + self.cache + self.step


def estimate_run(config: DiTConfig, prefix_tokens: list[int], target_tokens: int, batch: int, cfg: bool,
                 itemsize: int, prefix_cache: bool = True) -> RunEstimate:
    """Bytes a run adds on top of the weights; `prefix_tokens` lists each distinct prompt's prefix length."""
    samples = batch * (2 if cfg else 1)
    rows = sum(prefix_tokens) + samples * target_tokens
    width, hidden = config.width, config.mlp_hidden
    per_row = width * (4 * itemsize + 2 * 2 * FP32) + 2 * hidden * itemsize  # see the module docstring
    step = rows * per_row
    latents = batch * config.in_channels * target_tokens * (6 * FP32 + 2 * itemsize)
    cache = 2 * config.num_layers * config.num_heads * config.head_dim * sum(prefix_tokens) * itemsize
    return RunEstimate(latents, cache if prefix_cache else 0, step, rows)


#: A decode's peak above the VAE's weights, in values per output pixel per full-resolution channel: 9 x the
#: released 144, as measured on an H200 in bf16 (benchmarks/gpu_check.py, planner section: 0.63 / 2.53 / 10.13 GiB
#: at 512 / 1024 / 2048 px, proportional to the pixels; a CPU holds ~5 x, the convolutions' buffers differ). The
#: encoder about 4 x its width per input pixel (CPU-measured).
DECODE_VALUES_PER_BASE_CHANNEL = 9



ENCODE_VALUES_PER_BASE_CHANNEL = 4



# -- the text encoder ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EncoderDims:
    """The shapes of a Qwen3-VL text encoder that its memory depends on (defaults: the released 8B)."""

    hidden: int = 4096
    intermediate: int = 12288
    layers: int = 36
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 151936
    vision_hidden: int = 1152
    vision_intermediate: int = 4304
    vision_depth: int = 27
    deepstack: int = 3  # mergers besides the main one, each feeding one early decoder layer

    @classmethod
    def of(cls, model: nn.Module) -> "EncoderDims":
        """The dims of a transformers Qwen3-VL model (`text_encoder.model`)."""
        text, vision = model.config.text_config, model.config.vision_config
        return cls(text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.num_attention_heads,
                   text.num_key_value_heads, getattr(text, "head_dim", text.hidden_size // text.num_attention_heads),
                   text.vocab_size, vision.hidden_size, vision.intermediate_size, vision.depth,
                   len(getattr(vision, "deepstack_visual_indexes", ()) or ()))



def synthetic_encoder_weights(dims: EncoderDims | None = None, itemsize: int = 2) -> LayeredWeights:
    """`LayeredWeights` of a Qwen3-VL of `dims` (decoder layers streamable; embeddings and vision tower not)."""
    dims = dims or EncoderDims()
    h, kv = dims.hidden, dims.kv_heads * dims.head_dim
    attn = h * dims.heads * dims.head_dim * 2 + h * kv * 2 + 2 * dims.head_dim
    layer = (attn + 3 * h * dims.intermediate + 2 * h) * itemsize
    v = dims.vision_hidden
    vision_block = 3 * v * v + v * v + 2 * v * dims.vision_intermediate + 4 * v
    merged = 4 * v  # 2x2 patches merged
    mergers = (1 + dims.deepstack) * (merged * merged + merged * h)
    vision = dims.vision_depth * vision_block + mergers + 3 * 2 * 16 * 16 * v + 48 * 48 * v
    other = (dims.vocab * h + h + vision) * itemsize
    return LayeredWeights((layer,) * dims.layers, other, f"{8 * itemsize}-bit")



def encode_transient(dims: EncoderDims, tokens: int, patches: int, itemsize: int) -> int:
    """Activations of one encoding: the decoder over `tokens` (residual, norm, q/k/v/o, the SwiGLU halves), the
    vision tower over `patches` 16x16 patches, the deepstack features waiting for their layers, fp32 outputs."""
    lm = tokens * (6 * dims.hidden + 3 * dims.intermediate) * itemsize
    vision = patches * (6 * dims.vision_hidden + 2 * dims.vision_intermediate) * itemsize
    deepstack = dims.deepstack * (patches // 4) * dims.hidden * itemsize
    return max(lm, vision) + deepstack + tokens * dims.hidden * 4



# -- the VAE ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VAEShape:
    """The VAE as the planner sees it: stored bytes, config (widths, tiling) and compute itemsize."""

    weight_bytes: int
    config: QwenImage21VAEConfig = QwenImage21VAEConfig()
    itemsize: int = 2
    tiling: VAETiling = VAETiling()

    @classmethod
    def of(cls, vae: nn.Module, tiling: VAETiling | None = None) -> "VAEShape":
        return cls(tensor_bytes(module_tensors(vae)), vae.config, vae.dtype.itemsize, tiling or VAETiling())

    @classmethod
    def released(cls, itemsize: int = 2) -> "VAEShape":
        """The released VAE (its parameters counted on the meta device once) in a `itemsize`-byte dtype."""
        return cls(_released_vae_parameters() * itemsize, QwenImage21VAEConfig(), itemsize)


@functools.cache
def _released_vae_parameters() -> int:
    # every sampler run plans with it: built once, not once per run (a meta VAE is ~10 ms of module construction)
    from ..vae.autoencoder import QwenImage21VAE

    with torch.device("meta"):
        return sum(p.numel() for p in QwenImage21VAE().parameters())



def decode_transient(vae: VAEShape, batch: int, grid: tuple[int, int], tiled: bool) -> int:
    """Device bytes a decode adds to the VAE's weights: the decoder's peak activations (over the whole image, or
    one tile), the fp32 blend accumulators of a tiled decode, the output and its fp32 copy."""
    f = vae.config.spatial_compression
    pixels = grid[0] * grid[1] * f * f
    per_pixel = DECODE_VALUES_PER_BASE_CHANNEL * vae.config.decoder_base_dim * vae.itemsize
    out = batch * vae.config.out_channels * pixels * (vae.itemsize + 4)
    if not tiled:
        return batch * pixels * per_pixel + out
    tile = min(vae.tiling.tile, grid[0]) * min(vae.tiling.tile, grid[1]) * f * f
    accumulators = batch * vae.config.out_channels * pixels * 4 + pixels * 4
    return batch * tile * per_pixel + accumulators + out
