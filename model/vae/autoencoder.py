"""The Qwen-Image 2.1 VAE: 64 latent channels, RGBA pixels, 16x spatial compression, one frame at a time.

The released network is a Wan-2.2-style causal 3D VAE (diffusers `AutoencoderKLQwenImage21`, ComfyUI
`comfy/ldm/wan/vae2_2.py` with `temporal_kernel=1`). Qwen-Image only ever feeds it single images, and for one
frame every 3D piece collapses to a 2D one, which is all this file implements:

- causal convolutions have a temporal kernel of 1 in this release, so they are plain 2D convolutions (a video
  VAE with a longer kernel would read only its last temporal tap, as ComfyUI's single-frame fast path does);
- the `time_conv` layers of the resamplers never run on a first frame (both references skip them), so the
  model does not hold them at all;
- the parameter-free shortcuts still see time: `AvgDown3D` pads one zero frame in front and averages over it
  (halving the shortcut of the temporal blocks), and `DupUp3D` keeps only the second temporal copy
  (docs/checkpoints.md, "One frame through a 3D VAE"). `_avg_down` and `_add_dup_up_` reproduce exactly that;
- no feature cache: it only exists to carry frames into the next temporal chunk.

Parameter names are diffusers' (minus `time_conv`), so a diffusers state dict loads after reshapes only;
`loaders/vae.py` maps ComfyUI's Wan names onto them. References: diffusers 0.42.1
`autoencoder_kl_qwenimage21.py` (the numerical oracle of the tests) and ComfyUI `comfy/ldm/wan/vae2_2.py`.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .latents import LATENTS_MEAN, LATENTS_STD, LatentFormat


@dataclass(frozen=True)
class QwenImage21VAEConfig:
    """The VAE's shape; defaults are the released `vae/config.json` (docs/checkpoints.md)."""

    base_dim: int = 96  # encoder width at full resolution
    decoder_base_dim: int = 144  # decoder width at full resolution (the decoder is 1.5x wider)
    z_dim: int = 64  # latent channels; the encoder emits 2 * z_dim (mean, logvar)
    dim_mult: tuple[int, ...] = (1, 2, 4, 8, 8)  # one stage per entry, 2x down/up between stages
    num_res_blocks: int = 2  # per encoder stage; the decoder stages have one more
    # Which stage transitions also halve time (config.json spells it `temperal_downsample`). Unused for
    # computation in a video sense, but it changes the single-frame shortcuts (see `_avg_down`, `_add_dup_up_`).
    temporal_downsample: tuple[bool, ...] = (False, True, True, True)
    in_channels: int = 4  # RGBA
    out_channels: int = 4
    latents_mean: tuple[float, ...] = LATENTS_MEAN
    latents_std: tuple[float, ...] = LATENTS_STD

    def __post_init__(self):
        if self.num_res_blocks < 1:
            raise ValueError(f"num_res_blocks must be at least 1, got {self.num_res_blocks}.")
        if len(self.temporal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(
                f"temporal_downsample has {len(self.temporal_downsample)} entries; {len(self.dim_mult)} stages "
                f"need {len(self.dim_mult) - 1}."
            )
        if len(self.latents_mean) != self.z_dim or len(self.latents_std) != self.z_dim:
            raise ValueError(f"latents_mean/latents_std need {self.z_dim} values each (z_dim).")

    @property
    def spatial_compression(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)


@dataclass(frozen=True)
class VAETiling:
    """How large images are split. All sizes are in latent cells (16 px each at the released compression).

    Measured activation peaks of one pass (released widths): a decode holds ~1,300 values per output pixel on
    a GPU (~720 on a CPU), the encoder ~385 per input pixel. A 64-cell tile is 1024x1024 px, so ~2.5 GiB of bf16
    decode (measured on an H200; 3.2 GiB with the VAE's weights). The 16-cell (256 px)
    overlap is wide compared with the damage a tile edge does (zero padding where the image continues, and
    a mid-block attention that sees only its tile): blending drops the outer quarter of each overlap and
    ramps linearly across the middle half, so no output pixel leans on a tile edge. `auto_above` is where
    `tiled=None` starts tiling: 96x96 cells = 1536x1536 px (~5.7 GiB bf16 decode on a GPU), so the usual 1-2 MP
    outputs decode in one pass, exactly as the reference does.
    """

    tile: int = 64
    overlap: int = 16
    auto_above: int = 96 * 96  # latent cells (h * w)

    def __post_init__(self):
        if self.tile < 1 or not 0 <= self.overlap < self.tile:
            raise ValueError(
                f"tiling needs tile >= 1 and 0 <= overlap < tile, got tile={self.tile}, overlap={self.overlap}."
            )


# -- leaf modules ----------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Channel RMS norm: `F.normalize(x, dim=1) * sqrt(C) * gamma`, computed like diffusers.

    diffusers normalises half-precision input in fp32 and rounds the result back before the scale and gamma;
    we do the same but one channel slab at a time, so the fp32 copy never exceeds a slab (the full copy
    would be the largest tensor of a full-resolution decode). The per-pixel norm is the same either way.
    """

    _SLAB = 64  # channels per fp32 slab

    def __init__(self, dim: int):
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> same
        if x.dtype == torch.float32:
            y = F.normalize(x, dim=1)
        else:
            denom = torch.linalg.vector_norm(x, dim=1, keepdim=True, dtype=torch.float32).clamp_min_(1e-12)
            y = torch.empty_like(x)
            for c in range(0, x.shape[1], self._SLAB):
                y[:, c : c + self._SLAB] = x[:, c : c + self._SLAB].float() / denom
        return y.mul_(self.scale).mul_(self.gamma)


class ResidualBlock(nn.Module):
    """norm -> SiLU -> conv3x3, twice, plus a 1x1 shortcut when the width changes."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.norm1 = RMSNorm(in_dim)
        self.conv1 = nn.Conv2d(in_dim, out_dim, 3, padding=1)
        self.norm2 = RMSNorm(out_dim)
        self.conv2 = nn.Conv2d(out_dim, out_dim, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(in_dim, out_dim, 1) if in_dim != out_dim else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One step per line so each temporary is released as soon as the next exists; silu runs in place on
        # the norm output, a fresh tensor nobody else holds (no autograd: inference only).
        h = F.silu(self.norm1(x), inplace=True)
        h = self.conv1(h)
        h = F.silu(self.norm2(h), inplace=True)
        h = self.conv2(h)
        # the shortcut comes last so it is never alive next to the norm and conv temporaries
        return h.add_(x if self.conv_shortcut is None else self.conv_shortcut(x))


class AttentionBlock(nn.Module):
    """Single-head self-attention over all pixels of the (lowest-resolution) feature map, with a residual."""

    _SCORES = 1 << 26  # largest query-chunk x keys score matrix (64M entries) before queries are chunked

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        B, C, H, W = x.shape
        N = H * W
        qkv = self.to_qkv(self.norm(x)).reshape(B, 1, 3 * C, N).permute(0, 1, 3, 2).contiguous()  # (B, 1, N, 3C)
        q, k, v = qkv.chunk(3, dim=-1)  # (B, 1, N, C) each, channels [q | k | v] as the weights are laid out
        step = max(1, self._SCORES // N)
        if step >= N:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            # Query rows are independent, so chunking them is exact; it bounds the score matrix when a fused
            # kernel is unavailable (CUDA flash attention stops at head size 256; ours is 768-1152).
            out = torch.empty_like(q)
            for i in range(0, N, step):
                out[:, :, i : i + step] = F.scaled_dot_product_attention(q[:, :, i : i + step], k, v)
        del qkv, q, k, v
        out = out.squeeze(1).permute(0, 2, 1).reshape(B, C, H, W)
        return self.proj(out).add_(x)


class MidBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])
        self.attentions = nn.ModuleList([AttentionBlock(dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


class _NearestUp2x(nn.Module):
    """Nearest 2x upsampling. diffusers runs it in fp32 and casts back; a copy is exact in any dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=2.0, mode="nearest-exact")


class Resample(nn.Module):
    """2x spatial down (pad right/bottom, stride-2 conv) or up (nearest, conv); `resample.1` is the conv."""

    def __init__(self, dim: int, up: bool):
        super().__init__()
        if up:
            self.resample = nn.Sequential(_NearestUp2x(), nn.Conv2d(dim, dim, 3, padding=1))
        else:
            self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resample(x)


def _avg_down(x: torch.Tensor, out_dim: int, factor_t: int, factor_s: int) -> torch.Tensor:
    """`AvgDown3D` of one frame: space-to-depth, then the mean over groups of consecutive channels.

    With `factor_t = 2` the frame is preceded by a zero frame, so every channel c contributes
    `[zeros(fs^2), its fs^2 pixels]` to the grouped list: half the averaged values are zeros.
    """
    B, C, H, W = x.shape
    s = F.pixel_unshuffle(x, factor_s) if factor_s > 1 else x  # (B, C*fs^2, H/fs, W/fs), channel c*fs^2 + k
    h, w = s.shape[-2:]
    if factor_t > 1:
        s = s.view(B, C, 1, factor_s * factor_s, h, w)
        s = torch.cat([s.new_zeros(B, C, factor_t - 1, factor_s * factor_s, h, w), s], dim=2)
    group = C * factor_t * factor_s * factor_s // out_dim
    return s.reshape(B, out_dim, group, h, w).mean(dim=2)  # (B, out_dim, H/fs, W/fs)


def _add_dup_up_(out: torch.Tensor, x: torch.Tensor, factor_t: int) -> torch.Tensor:
    """`out += DupUp3D(x)` for a first frame: repeat channels, depth-to-space 2x, keep the last temporal copy.

    The repeated list holds, per output channel o, `factor_t` temporal copies of 4 sub-pixels; the first
    chunk keeps copy `factor_t - 1`. Picking those channels by index skips the copies we drop, and adding
    through a strided view of `out` skips the depth-to-space copy (the decoder's largest temporary).
    """
    B, C, h, w = x.shape
    out_dim = out.shape[1]
    repeats = out_dim * factor_t * 4 // C
    o = torch.arange(out_dim, device=x.device).repeat_interleave(4)
    k = torch.arange(4, device=x.device).repeat(out_dim)
    source = ((o * factor_t + factor_t - 1) * 4 + k) // repeats  # input channel behind each kept channel
    shortcut = x.index_select(1, source).view(B, out_dim, 2, 2, h, w)  # channel o*4 + 2i + j, as pixel_shuffle reads it
    out.view(B, out_dim, h, 2, w, 2).add_(shortcut.permute(0, 1, 4, 2, 5, 3))  # out[o, 2y+i, 2x+j] += ...
    return out


# -- stages ----------------------------------------------------------------------------------------------------
class DownBlock(nn.Module):
    """Residual blocks, an optional 2x downsample, plus the parameter-free `AvgDown3D` shortcut."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, temporal: bool, down: bool):
        super().__init__()
        dims = [in_dim] + [out_dim] * num_res_blocks
        self.resnets = nn.ModuleList(ResidualBlock(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.downsampler = Resample(out_dim, up=False) if down else None
        self.out_dim, self.factor_t, self.factor_s = out_dim, 2 if temporal else 1, 2 if down else 1
        if in_dim * self.factor_t * self.factor_s**2 % out_dim:
            raise ValueError(f"a {in_dim}->{out_dim} down stage cannot average its shortcut into groups.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for resnet in self.resnets:
            h = resnet(h)
        if self.downsampler is not None:
            h = self.downsampler(h)
        return h.add_(_avg_down(x, self.out_dim, self.factor_t, self.factor_s))


class UpBlock(nn.Module):
    """Residual blocks, then (except the last stage) a 2x upsample plus the `DupUp3D` shortcut."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, temporal: bool, up: bool):
        super().__init__()
        dims = [in_dim] + [out_dim] * num_res_blocks
        self.resnets = nn.ModuleList(ResidualBlock(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.upsampler = Resample(out_dim, up=True) if up else None
        self.out_dim, self.factor_t = out_dim, 2 if temporal else 1
        if up and out_dim * self.factor_t * 4 % in_dim:
            raise ValueError(f"a {in_dim}->{out_dim} up stage cannot duplicate its shortcut evenly.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for resnet in self.resnets:
            h = resnet(h)
        if self.upsampler is None:  # the last stage has no shortcut at all
            return h
        # x is kept (not its 2x shortcut) until the end: it is the smaller of the two; the low-resolution h
        # is released once upsampled, before the conv allocates its output
        up, conv = self.upsampler.resample
        h = up(h)
        h = conv(h)
        return _add_dup_up_(h, x, self.factor_t)


class Encoder(nn.Module):
    def __init__(self, c: QwenImage21VAEConfig):
        super().__init__()
        dims = [c.base_dim * m for m in (1, *c.dim_mult)]
        last = len(c.dim_mult) - 1
        self.conv_in = nn.Conv2d(c.in_channels, dims[0], 3, padding=1)
        self.down_blocks = nn.ModuleList(
            DownBlock(dims[i], dims[i + 1], c.num_res_blocks, temporal=i < last and c.temporal_downsample[i],
                      down=i < last)
            for i in range(len(c.dim_mult))
        )
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = nn.Conv2d(dims[-1], 2 * c.z_dim, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, in, H, W) -> (B, 2z, H/16, W/16)
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(F.silu(self.norm_out(x), inplace=True))


class Decoder(nn.Module):
    def __init__(self, c: QwenImage21VAEConfig):
        super().__init__()
        dims = [c.decoder_base_dim * m for m in (c.dim_mult[-1], *reversed(c.dim_mult))]
        temporal_up = tuple(reversed(c.temporal_downsample))
        last = len(c.dim_mult) - 1
        self.conv_in = nn.Conv2d(c.z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        self.up_blocks = nn.ModuleList(
            UpBlock(dims[i], dims[i + 1], c.num_res_blocks + 1, temporal=i < last and temporal_up[i], up=i < last)
            for i in range(len(c.dim_mult))
        )
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = nn.Conv2d(dims[-1], c.out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:  # (B, z, h, w) -> (B, out, 16h, 16w)
        x = self.mid_block(self.conv_in(z))
        *stages, last = self.up_blocks
        for block in stages:
            x = block(x)
        # The last stage has no shortcut, so its resnets run from here: rebinding x lets each full-resolution
        # input go as soon as the next exists (a call to the stage would keep its input alive throughout).
        for resnet in last.resnets:
            x = resnet(x)
        return self.conv_out(F.silu(self.norm_out(x), inplace=True))


# -- tiling ----------------------------------------------------------------------------------------------------
def _tile_spans(length: int, tile: int, overlap: int) -> list[tuple[int, int]]:
    """`[start, end)` spans of equal size `tile` covering `length`, neighbours sharing at least `overlap`."""
    if length <= tile:
        return [(0, length)]
    count = math.ceil((length - overlap) / (tile - overlap))
    # spread the slack evenly instead of leaving a sliver of a last tile
    starts = [round(i * (length - tile) / (count - 1)) for i in range(count)]
    return [(s, s + tile) for s in starts]


def _blend_ramp(spans: list[tuple[int, int]], i: int, scale: int, device) -> torch.Tensor:
    """Blend weight of tile i along one axis, `(scale * tile length,)` fp32.

    Across each overlap the weight is 0 over the outer quarter (the pixels a tile edge damages most), rises
    linearly over the middle half and is 1 beyond; a neighbour's weight is the mirror image, so the weights of
    the tiles covering any pixel sum to 1.
    """
    start, end = spans[i]
    pos = torch.arange((end - start) * scale, device=device, dtype=torch.float32) + 0.5
    weight = torch.ones_like(pos)
    for overlap_cells, distance in (
        (spans[i - 1][1] - start if i > 0 else 0, pos),  # from this tile's start edge
        (end - spans[i + 1][0] if i + 1 < len(spans) else 0, pos.flip(0)),  # from its end edge
    ):
        if overlap_cells > 0:
            width = overlap_cells * scale
            margin = width // 4
            weight *= ((distance - margin) / (width - 2 * margin)).clamp_(0.0, 1.0)
    return weight


def _run_tiled(fn, x: torch.Tensor, grid: tuple[int, int], scale_in: int, scale_out: int, out_channels: int,
               tiling: VAETiling) -> torch.Tensor:
    """`fn` applied tile by tile on a latent-cell grid and blended; only one tile's activations live at a time.

    Cells are `scale_in` pixels of `x` and `scale_out` pixels of the result. The result is accumulated in fp32
    (it has few channels: 4 for pixels, 64 for latents), then cast to `x`'s dtype.
    """
    rows, cols = (_tile_spans(n, tiling.tile, tiling.overlap) for n in grid)
    out = torch.zeros(x.shape[0], out_channels, grid[0] * scale_out, grid[1] * scale_out, device=x.device)
    total = torch.zeros(grid[0] * scale_out, grid[1] * scale_out, device=x.device)
    for i, (y0, y1) in enumerate(rows):
        wy = _blend_ramp(rows, i, scale_out, x.device)
        for j, (x0, x1) in enumerate(cols):
            weight = wy[:, None] * _blend_ramp(cols, j, scale_out, x.device)[None, :]
            tile = fn(x[..., y0 * scale_in : y1 * scale_in, x0 * scale_in : x1 * scale_in])
            window = (..., slice(y0 * scale_out, y1 * scale_out), slice(x0 * scale_out, x1 * scale_out))
            out[window] += tile.float() * weight
            total[window] += weight
            del tile
    return out.div_(total).to(x.dtype)


# -- the model -------------------------------------------------------------------------------------------------
class QwenImage21VAE(nn.Module):
    """Qwen-Image 2.1's VAE for single images: `encode` pixels to raw latents, `decode` them back.

    Inference only: parameters never require grad, so forgetting `torch.no_grad()` builds no graph (the
    caller still picks no_grad / inference_mode). The decoder's residual stream exceeds the fp16 range (reported
    as white or NaN blocks): use bf16 or fp32.
    """

    def __init__(self, config: QwenImage21VAEConfig = QwenImage21VAEConfig()):
        super().__init__()
        self.config = config
        self.source = None  # what it was loaded from (`loaders.vae.VAESource`); None when built in memory
        #: where encode/decode should run; None lets the caller pick (the ComfyUI nodes: their compute device). The
        #: VAE loader node sets it from its `device` input.
        self.preferred_device: torch.device | None = None
        self.encoder = Encoder(config)
        self.quant_conv = nn.Conv2d(2 * config.z_dim, 2 * config.z_dim, 1)
        self.post_quant_conv = nn.Conv2d(config.z_dim, config.z_dim, 1)
        self.decoder = Decoder(config)
        self.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.post_quant_conv.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.post_quant_conv.weight.device

    def _use_tiles(self, tiled: bool | None, grid: tuple[int, int], tiling: VAETiling) -> bool:
        return tiling.auto_above < grid[0] * grid[1] if tiled is None else bool(tiled)

    def encode(self, images: torch.Tensor, tiled: bool | None = None, tiling: VAETiling | None = None) -> torch.Tensor:
        """Raw latents `(B, z_dim, H/16, W/16)` in the model dtype: the posterior mean, as the pipeline uses.

        `images` is `(B, 4, H, W)` RGBA or `(B, 3, H, W)` RGB in [-1, 1]; RGB gets an opaque alpha (+1), as
        diffusers' RGBA conversion and ComfyUI's channel padding do. H and W must be multiples of 16.
        `tiled`: None tiles above `tiling.auto_above` latent cells, True/False force it.
        """
        c, f = self.config, self.config.spatial_compression
        if images.ndim != 4 or images.shape[1] not in (c.in_channels, c.in_channels - 1):
            raise ValueError(
                f"encode takes (B, {c.in_channels}, H, W) RGBA or (B, {c.in_channels - 1}, H, W) RGB images in "
                f"[-1, 1]; got shape {tuple(images.shape)}."
            )
        H, W = images.shape[-2:]
        if H % f or W % f:
            raise ValueError(
                f"encode needs height and width divisible by {f}; got {H}x{W}. Resize or crop to "
                f"{H // f * f}x{W // f * f} (the pipelines use multiples of 32)."
            )
        x = images.to(device=self.device, dtype=self.dtype)
        if x.shape[1] == c.in_channels - 1:
            x = torch.cat([x, x.new_ones(x.shape[0], 1, H, W)], dim=1)
        tiling = tiling or VAETiling()
        grid = (H // f, W // f)
        if self._use_tiles(tiled, grid, tiling):
            return _run_tiled(self._encode_mean, x, grid, f, 1, c.z_dim, tiling)
        return self._encode_mean(x)

    def _encode_mean(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)  # (B, 2z, h, w)
        z = self.config.z_dim
        # quant_conv is 1x1: its first z output channels (the mean) need only the first z rows of weights
        return F.conv2d(h, self.quant_conv.weight[:z], self.quant_conv.bias[:z])

    def decode(self, latents: torch.Tensor, tiled: bool | None = None, tiling: VAETiling | None = None) -> torch.Tensor:
        """Pixels `(B, 4, 16h, 16w)` RGBA in [-1, 1] (clamped like diffusers), model dtype, from raw latents."""
        c, f = self.config, self.config.spatial_compression
        if latents.ndim != 4 or latents.shape[1] != c.z_dim:
            raise ValueError(
                f"decode takes raw latents (B, {c.z_dim}, h, w); got shape {tuple(latents.shape)}. "
                "Denormalize model-space latents first (`latent_format.denormalize`)."
            )
        z = latents.to(device=self.device, dtype=self.dtype)
        tiling = tiling or VAETiling()
        grid = tuple(z.shape[-2:])
        if self._use_tiles(tiled, grid, tiling):
            out = _run_tiled(self._decode_raw, z, grid, 1, f, c.out_channels, tiling)
        else:
            out = self._decode_raw(z)
        return out.clamp_(-1.0, 1.0)

    def _decode_raw(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.post_quant_conv(z))

    @property
    def latent_format(self) -> LatentFormat:
        """This VAE's latent statistics (its config's `latents_mean` / `latents_std`)."""
        return LatentFormat(tuple(self.config.latents_mean), tuple(self.config.latents_std))

