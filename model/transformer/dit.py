"""The Qwen-Image 2.1 transformer (DiT): 7B, single stream, block-causal, with a prefix KV cache.

One sequence holds the prompt's text, the references' latent tokens in the text's image slots, and the
target's latent tokens at the end (see `layout.py`). What sets 2.1 apart:
- attention is `(q >= k) or same_image_block`, so the prefix (text + references) never reads the target;
- text and reference rows are modulated with t = 0 (`causal_condition`), so their keys and values do not
  depend on the step: the first step fills a `PrefixKVCache`, later steps run only the target rows.

Numerics follow diffusers 0.42.1 (`QwenImage21Transformer2DModel`), the reference, operation for operation.
What we do differently is where the work goes:
- rows are ragged: each distinct prompt's prefix appears once however many samples share it, so a batch of
  B seeds computes (and caches) its prefix once, and CFG's two prompts run in one forward without padding;
- the last block and the output head skip the prefix rows (only their keys and values are needed there);
- q and k are normed and rotated in one pass; RoPE tables and layouts are built once per run;
- [q; k; v] and [gate; up] are single weights run as two GEMMs each ([q; k] and v; gate and up), so every
  output is a dense buffer and every later elementwise kernel and the K/V concatenation run on contiguous
  memory: on an H200 the gapped views of one fused output cost more in slow strided kernels than the fusion
  saved (measured with benchmarks/bench_gpu.py, see docs/measurements.md).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from ..layers.linear import Linear
from .attention import (
    ATTENTION_BACKENDS,
    chunk_attention,
    flex_block_mask,
    prefix_attention_flex,
    prefix_attention_sdpa,
    target_attention,
)
from .layout import SequenceLayout
from .prefix_cache import LayerKV, PrefixKVCache
from .rope import apply_rope, rope_angles

TIMESTEP_DIM = 256  # sinusoid width fed to the timestep MLP
MODES = ("uncached", "prefill", "cached")


@dataclass(frozen=True)
class DiTConfig:
    """Architecture of the DiT; defaults are the released Qwen-Image 2.1 (Base and Turbo) values."""

    in_channels: int = 64  # latent channels, unpatched (patch_size 1)
    out_channels: int = 64
    num_layers: int = 32
    num_heads: int = 32
    head_dim: int = 128
    context_in_dim: int = 4096  # Qwen3-VL 8B hidden size
    mlp_ratio: int = 3  # SwiGLU hidden = 3 * width = 12288
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)  # frame, height, width
    rope_theta: float = 10000.0
    eps: float = 1e-6
    causal_condition: bool = True  # prefix modulated with t = 0; required by the prefix cache

    @property
    def width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def mlp_hidden(self) -> int:
        return self.width * self.mlp_ratio


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose file weight is `scale - 1`: applied as `x * rsqrt(mean(x^2) + eps) * (w + 1)` in fp32."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (self.weight.float() + 1)).to(x.dtype)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm of q/k: variance in fp32, weight used as stored (the reference's plain RMSNorm)."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        x = x.to(weight.dtype)
    return x * weight


def timestep_sinusoid(t: torch.Tensor) -> torch.Tensor:
    """`(B,)` t in [0, 1] -> `(B, 256)` fp32 `[cos | sin]` of `1000 t * 10000^(-k/128)` (cos first)."""
    half = TIMESTEP_DIM // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (1000.0 * t.float())[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TextProjection(nn.Module):
    """Qwen3-VL states -> DiT width: zero-centred RMSNorm, Linear, GELU (tanh), Linear."""

    def __init__(self, context_dim: int, width: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.text_norm = ZeroCenteredRMSNorm(context_dim, eps, device=device, dtype=dtype)
        self.in_layer = Linear(context_dim, width, device=device, dtype=dtype)
        self.out_layer = Linear(width, width, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.gelu(self.in_layer(self.text_norm(x)), approximate="tanh"))


class TimestepEmbedding(nn.Module):
    def __init__(self, width: int, device=None, dtype=None):
        super().__init__()
        self.linear_1 = Linear(TIMESTEP_DIM, width, device=device, dtype=dtype)
        self.linear_2 = Linear(width, width, device=device, dtype=dtype)

    def forward(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(timestep_sinusoid(t).to(dtype))))


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Affine-free LayerNorm over the width (the modulation supplies the scale)."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps)


@dataclass(frozen=True, eq=False)
class PrefixInputs:
    """One distinct prompt: text-encoder states `(L, context_dim)`, its layout, and its references' packed
    latents `(sum h*w, in_channels)` (None without references). Cached steps only read `layout`."""

    layout: SequenceLayout
    text: torch.Tensor | None = None
    references: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class Rows:
    """Everything a block needs to know about the ragged row buffer of one forward, built once per forward.

    The buffer is `[chunk 0 | chunk 1 | ... | sample 0's target | sample 1's target | ...]`. A chunk is the rows
    of one distinct prompt's prefix that this forward computes: all of them, or (a prefill with a planned cache)
    those after a leading run the cache already holds or another prompt of the batch computes. Each prompt's rows
    appear once however many samples read them. In cached steps the buffer holds the targets only.

    Attributes:
        mode: "uncached", "prefill" or "cached".
        prefix_spans: `(start, end)` of each chunk in the buffer; empty when the buffer holds targets only.
        prefix_lens: tokens of each prefix (also in cached steps, where the cache holds them).
        samples, target_len: the target rows are `samples` runs of `target_len` rows, after the chunks.
        readers: per prefix, the samples attending to it (a slice when they are consecutive, else a list).
        prefix_mod_rows: per chunk, its row of the modulation table (the t = 0 row under causal_condition).
        rope: `(rows, head_dim / 2)` complex rotations in buffer order.
        prefix_attention: `(c, q, k, v, kv=None) -> out` block-causal attention of chunk c (a whole prefix needs
            no `kv`); None in cached steps.
        chunk_groups: the prefix of each chunk.
        whole: per prefix, the chunk holding all its rows (its keys are read from the buffer), else None (read
            from the cache).
    """

    mode: str
    prefix_spans: tuple[tuple[int, int], ...]
    prefix_lens: tuple[int, ...]
    samples: int
    target_len: int
    readers: tuple
    prefix_mod_rows: tuple[int, ...]
    rope: torch.Tensor
    prefix_attention: Callable | None = None
    chunk_groups: tuple[int, ...] = ()
    whole: tuple = ()

    @property
    def target_start(self) -> int:
        return self.prefix_spans[-1][1] if self.prefix_spans else 0

    def targets_only(self) -> "Rows":
        """The same rows after the prefix rows were dropped from the buffer (the last block does this)."""
        return replace(self, prefix_spans=(), rope=self.rope[self.target_start :], prefix_attention=None,
                       chunk_groups=(), whole=())

    def modulate(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """`x * (1 + scale)` with each row's own modulation row (prefix g: its row; sample b's targets: row b)."""
        out = torch.empty_like(x)
        for (start, end), row in zip(self.prefix_spans, self.prefix_mod_rows):
            torch.mul(x[start:end], 1 + scale[row], out=out[start:end])
        target = x[self.target_start :].view(self.samples, self.target_len, -1)
        torch.mul(target, 1 + scale[: self.samples, None], out=out[self.target_start :].view_as(target))
        return out

    def gated_add(self, x: torch.Tensor, gate: torch.Tensor, update: torch.Tensor) -> None:
        """`x += tanh(gate) * update`, in place, with the same row selection as `modulate`."""
        gate = gate.tanh()
        for (start, end), row in zip(self.prefix_spans, self.prefix_mod_rows):
            x[start:end] += gate[row] * update[start:end]
        target = x[self.target_start :].view(self.samples, self.target_len, -1)
        target += gate[: self.samples, None] * update[self.target_start :].view_as(target)


class Block(nn.Module):
    """One single-stream block: modulation, block-causal attention over its rows, SwiGLU MLP, gated residuals.

    The modulation table is the model's (one for all blocks); each block gets its rows `(B + 1, 4 * width)`.
    Everything else a block reads is its own weights, the `Rows` of this forward and its layer of the prefix
    cache, so a block can be run, hooked, streamed or compiled alone.
    """

    def __init__(self, config: DiTConfig, device=None, dtype=None):
        super().__init__()
        width, hidden = config.width, config.mlp_hidden
        self.num_heads, self.head_dim, self.eps = config.num_heads, config.head_dim, config.eps
        self.qkv = Linear(width, 3 * width, device=device, dtype=dtype)  # rows: [q; k; v]
        self.norm_q = nn.Parameter(torch.ones(config.head_dim, device=device, dtype=dtype), requires_grad=False)
        self.norm_k = nn.Parameter(torch.ones(config.head_dim, device=device, dtype=dtype), requires_grad=False)
        self.to_out = Linear(width, width, device=device, dtype=dtype)
        self.gate_up = Linear(width, 2 * hidden, device=device, dtype=dtype)  # rows: [gate (SiLU); up]
        self.down = Linear(hidden, width, device=device, dtype=dtype)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        # two GEMMs over one [gate; up] weight (module docstring); SiLU and the product in place: no temporaries
        hidden = self.gate_up.weight.shape[0] // 2
        up = self.gate_up.rows(x, hidden, 2 * hidden)
        return self.down(F.silu(self.gate_up.rows(x, 0, hidden), inplace=True).mul_(up))

    def qkv_heads(self, h: torch.Tensor, rope: torch.Tensor):
        """Normed, rotated q and k and plain v, each `(N, heads, head_dim)` and contiguous."""
        width, heads = h.shape[-1], self.num_heads
        # two GEMMs over one [q; k; v] weight (module docstring): [q; k] and v in dense buffers
        qk = rearrange(self.qkv.rows(h, 0, 2 * width), "n (two h d) -> two n h d", two=2, h=heads, d=self.head_dim)
        v = rearrange(self.qkv.rows(h, 2 * width, 3 * width), "n (h d) -> n h d", h=heads, d=self.head_dim)
        qk = qk.to(torch.float32, memory_format=torch.contiguous_format)  # q and k normed and rotated together
        qk = head_rms_norm(qk, torch.stack([self.norm_q, self.norm_k])[:, None, None], self.eps).to(v.dtype)
        q, k = apply_rope(qk, rope[None, :, None]).unbind(0)  # (N, H, D) each
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        mods: torch.Tensor,
        rows: Rows,
        kv: LayerKV | None = None,
        drop_prefix: bool = False,
    ) -> torch.Tensor:
        """One block over the row buffer `x` `(rows, width)`.

        Args:
            mods: `(B + 1, 4 * width)` modulation rows `[scale1 | gate1 | scale2 | gate2]`.
            rows: the buffer's `Rows`.
            kv: this layer's view of the prefix cache: filled in a prefill, read in a cached step.
            drop_prefix: return the target rows only (the last block: nothing reads the prefix rows' outputs,
                only their keys and values were needed).
        Returns:
            the updated buffer, `(rows, width)`, or the target rows only with `drop_prefix`.
        """
        heads, head_dim = self.num_heads, self.head_dim
        scale1, gate1, scale2, gate2 = mods.chunk(4, dim=-1)
        if rows.mode != "uncached" and kv is None:
            raise ValueError(f"a {rows.mode} step needs this layer's prefix cache (kv).")

        q, k, v = self.qkv_heads(rows.modulate(layer_norm(x, self.eps), scale1), rows.rope)
        t0 = rows.target_start
        first_out = t0 if drop_prefix else 0
        attn = torch.empty(x.shape[0] - first_out, heads, head_dim, dtype=v.dtype, device=v.device)
        for c, (start, end) in enumerate(rows.prefix_spans):
            if rows.mode == "prefill":  # every chunk's keys first: a later chunk may read an earlier one's
                kv.store(rows.chunk_groups[c], k[start:end], v[start:end])
        if not drop_prefix:
            for c, (start, end) in enumerate(rows.prefix_spans):
                attn[start:end] = rows.prefix_attention(c, q[start:end], k[start:end], v[start:end], kv)
        prefix_kv = []
        for g in range(len(rows.prefix_lens)):
            chunk = rows.whole[g] if rows.whole else None
            if chunk is not None:
                start, end = rows.prefix_spans[chunk]
                prefix_kv.append((k[start:end], v[start:end]))
            elif rows.readers[g] is None:
                prefix_kv.append(None)
            else:
                parts = kv.read_parts(g)
                prefix_kv.append(([pk for pk, _ in parts], [pv for _, pv in parts]))

        samples, length = rows.samples, rows.target_len
        q_t, k_t, v_t = (tensor[t0:].view(samples, length, heads, head_dim) for tensor in (q, k, v))
        attn_t = attn[t0 - first_out :].view(samples, length, heads, head_dim)
        for g, pick in enumerate(rows.readers):
            if pick is not None:
                attn_t[pick] = target_attention(q_t[pick], k_t[pick], v_t[pick], *prefix_kv[g])

        if drop_prefix:
            x, rows = x[t0:], rows.targets_only()
        rows.gated_add(x, gate1, self.to_out(attn.flatten(1)))
        rows.gated_add(x, gate2, self.mlp(rows.modulate(layer_norm(x, self.eps), scale2)))
        if x.dtype == torch.float16:
            x = x.clamp_(-65504, 65504)
        return x


def _readers(sample_prefix: list[int], num_prefixes: int) -> tuple:
    """Per prefix, its samples as a slice when consecutive (a view, no gather), a list otherwise, None if none."""
    readers = []
    for g in range(num_prefixes):
        members = [b for b, p in enumerate(sample_prefix) if p == g]
        if not members:
            readers.append(None)
        elif members == list(range(members[0], members[-1] + 1)):
            readers.append(slice(members[0], members[-1] + 1))
        else:
            readers.append(members)
    return tuple(readers)


class QwenImage21DiT(nn.Module):
    """The Qwen-Image 2.1 DiT. Parameter names are ours; `loaders/dit_keys.py` maps both file layouts onto them.

    `forward` = `prepare` (embeddings, modulation rows, the `Rows` of this call) + each block + `final_layer`.
    """

    def __init__(self, config: DiTConfig = DiTConfig(), device=None, dtype=None, attention: str = "sdpa"):
        super().__init__()
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {attention!r}.")
        self.config = config
        self.attention = attention
        self.compute_dtype = dtype or torch.float32
        self.source = None  # what the loader read (loaders.dit_keys.DiTSource); None for a model built in code
        self.manager = None  # the host's memory-management handle (nodes/bridge.py keeps ComfyUI's patcher here)
        width = config.width
        self.time_embed = TimestepEmbedding(width, device=device, dtype=dtype)
        self.txt_in = TextProjection(config.context_in_dim, width, config.eps, device=device, dtype=dtype)
        self.img_in = Linear(config.in_channels, width, device=device, dtype=dtype)
        # one table for every block: rows [scale1; gate1; scale2; gate2], input silu(temb)
        self.modulation = Linear(width, 4 * width, device=device, dtype=dtype)
        self.blocks = nn.ModuleList(Block(config, device=device, dtype=dtype) for _ in range(config.num_layers))
        self.norm_out = Linear(width, width, device=device, dtype=dtype)  # final scale only, no shift
        self.proj_out = Linear(width, config.out_channels, device=device, dtype=dtype)

    # -- forward --------------------------------------------------------------------------------------------
    def forward(
        self,
        target: torch.Tensor,
        timestep: torch.Tensor | float,
        prefixes: list[PrefixInputs],
        sample_prefix: list[int] | None = None,
        cache: PrefixKVCache | None = None,
        mode: str = "uncached",
        attention: str | None = None,
        after_block: Callable[[int], None] | None = None,
        control=None,
    ) -> torch.Tensor:
        """Velocity for the target rows.

        Args:
            target: `(B, T, in_channels)` packed (row-major) normalised target latents.
            timestep: `(B,)` or scalar t in [0, 1] (the sigma as the reference pipeline rounds it).
            prefixes: the distinct prompts of the batch (their layouts must share the target size).
            sample_prefix: index into `prefixes` for each sample; default: all samples read prefix 0 when
                there is one prefix, else sample b reads prefix b.
            cache: the `PrefixKVCache` to fill (`mode="prefill"`) or read (`mode="cached"`).
            mode: "uncached" (no cache), "prefill" (full sequence, fills `cache`) or "cached" (target rows only).
            attention: prefill backend for this call, "sdpa" or "flex"; default: the model's.
            after_block: called with each block's index after it ran (interrupt checks inside a step).
            control: a second stream added to this one (`controlnet.ControlStream`): `start(x, mods, rows, cache)`
                sees the embedded rows before block 0, `after_base_block(index, x)` returns each block's output with
                the control's skip added; its blocks' prefix K/V are `control.cache_layers` more layers of `cache`.
        Returns:
            `(B, T, out_channels)` in the compute dtype.
        """
        extra = control.cache_layers if control is not None else 0
        x, mods, final_scale, rows = self.prepare(target, timestep, prefixes, sample_prefix, cache, mode, attention,
                                                  extra_cache_layers=extra)
        if control is not None:
            control.start(x, mods, rows, cache)
        last = len(self.blocks) - 1
        for index, block in enumerate(self.blocks):
            x = block(x, mods, rows, cache.layer_kv(index) if cache is not None else None, drop_prefix=index == last)
            if control is not None:
                x = control.after_base_block(index, x)
            if after_block is not None:
                after_block(index)
        return self.final_layer(x, final_scale, rows)

    def prepare(self, target, timestep, prefixes, sample_prefix=None, cache=None, mode="uncached", attention=None,
                extra_cache_layers: int = 0):
        """Everything before the first block: `(x, mods, final_scale, rows)`.

        `x` is the row buffer `(rows, width)`, `mods` the modulation rows `(B + 1, 4 * width)` every block
        reads, `final_scale` the output head's `(B + 1, width)`, `rows` the buffer's `Rows`. A prefill
        allocates `cache` (with `extra_cache_layers` after the blocks' own: a control stream's); a cached step
        checks it was filled for these prefixes and layers.
        """
        config = self.config
        self._check_mode(mode, cache)
        samples, target_len = target.shape[:2]
        sample_prefix = self._sample_prefix(sample_prefix, len(prefixes), samples)
        for prefix in prefixes:
            if prefix.layout.target_len != target_len:
                raise ValueError(
                    f"target has {target_len} tokens but a layout was built for {prefix.layout.target_shape} "
                    f"({prefix.layout.target_len} tokens)."
                )
        dtype, device = self.compute_dtype, target.device

        # Timestep rows: one per sample, plus the t = 0 row every prefix row reads under causal_condition.
        t = torch.as_tensor(timestep, device=device).reshape(-1).expand(samples).to(dtype)
        if config.causal_condition:
            t = torch.cat([t, t.new_zeros(1)])
            prefix_mod_rows = (samples,) * len(prefixes)
        else:
            if sample_prefix != list(range(samples)):
                raise ValueError("without causal_condition every sample needs its own prefix (prefix b for sample b).")
            prefix_mod_rows = tuple(range(len(prefixes)))
        temb_act = F.silu(self.time_embed(t, dtype))
        mods = self.modulation(temb_act)  # (B + 1, 4 * width)
        final_scale = self.norm_out(temb_act)

        prefix_lens = tuple(p.layout.prefix_len for p in prefixes)
        cache_layers = config.num_layers + int(extra_cache_layers)
        if mode == "prefill":
            cache.allocate(prefix_lens, cache_layers, config.num_heads, config.head_dim, dtype, device)
            chunks = cache.computed  # (group, first row, end): the rows this prefill computes
        elif mode == "cached":
            cache.check_compatible(prefix_lens, cache_layers, config.num_heads, config.head_dim)
            chunks = ()
        else:
            chunks = tuple((g, 0, length) for g, length in enumerate(prefix_lens))
        spans, start = [], 0
        for _, first, end in chunks:
            spans.append((start, start + end - first))
            start += end - first
        x = self.img_in(target.to(dtype)).flatten(0, 1)
        if chunks:
            embedded = [self._embed_prefix(prefixes[g], dtype, device)[first:end] for g, first, end in chunks]
            x = torch.cat(embedded + [x])
        whole = [None] * len(prefixes)
        for c, (g, first, _) in enumerate(chunks):
            if first == 0:
                whole[g] = c
        rows = Rows(
            mode=mode,
            prefix_spans=tuple(spans),
            prefix_lens=prefix_lens,
            samples=samples,
            target_len=target_len,
            readers=_readers(sample_prefix, len(prefixes)),
            prefix_mod_rows=tuple(prefix_mod_rows[g] for g, _, _ in chunks),
            rope=self._rope(prefixes, sample_prefix, chunks, device),
            prefix_attention=(
                self._prefix_attention(prefixes, chunks, attention or self.attention, device) if chunks else None
            ),
            chunk_groups=tuple(g for g, _, _ in chunks),
            whole=tuple(whole),
        )
        return x, mods, final_scale, rows

    def final_layer(self, x: torch.Tensor, final_scale: torch.Tensor, rows: Rows) -> torch.Tensor:
        """Target rows `(B * T, width)` -> velocity `(B, T, out_channels)`: scaled LayerNorm, projection."""
        x = x.view(rows.samples, rows.target_len, -1)
        x = layer_norm(x, self.config.eps) * (1 + final_scale[: rows.samples, None])
        return self.proj_out(x)

    # -- pieces ---------------------------------------------------------------------------------------------
    def _check_mode(self, mode: str, cache) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
        if mode == "uncached":
            if cache is not None:
                raise ValueError("a cache was passed with mode='uncached'; use mode='prefill' to fill it.")
            return
        if not self.config.causal_condition:
            raise ValueError(
                "the prefix KV cache needs causal_condition=True: only then are text and reference rows "
                "modulated with t = 0 and independent of the step. Run this model with mode='uncached'."
            )
        if cache is None:
            raise ValueError(f"mode={mode!r} needs a PrefixKVCache to {'fill' if mode == 'prefill' else 'read'}.")

    def _rope(self, prefixes, sample_prefix, chunks, device) -> torch.Tensor:
        """The rotations of every buffer row, `(rows, head_dim / 2)` complex; built once per run and reused
        by every step (layouts live for a run, so the memo sits on the first prefix's layout)."""
        axes, theta = self.config.axes_dims_rope, self.config.rope_theta
        layouts = tuple(p.layout for p in prefixes)

        def table(layout, part):
            positions = layout.prefix_positions if part == "prefix" else layout.target_positions
            key = ("rope", part, str(device), axes)
            return layout.memo(key, lambda: rope_angles(positions.to(device), axes, theta))

        def build():
            parts = [table(layouts[g], "prefix")[first:end] for g, first, end in chunks]
            parts += [table(layouts[g], "target") for g in sample_prefix]
            # the value keeps the layouts alive, so the identity check below can never match a reused id
            return layouts, torch.cat(parts) if len(parts) > 1 else parts[0]

        key = ("rows_rope", str(device), axes, tuple(map(id, layouts)), tuple(sample_prefix), tuple(chunks))
        kept_layouts, rope = layouts[0].memo(key, build)
        if any(a is not b for a, b in zip(kept_layouts, layouts)):
            rope = build()[1]
        return rope

    def _embed_prefix(self, prefix: PrefixInputs, dtype, device) -> torch.Tensor:
        """`(P, width)` prefix rows: projected text in its rows, projected reference latents in theirs."""
        layout = prefix.layout
        if prefix.text is None:
            raise ValueError("a prefill or uncached step needs the prompt's text states (PrefixInputs.text).")
        rows = torch.empty(layout.prefix_len, self.config.width, dtype=dtype, device=device)
        text = prefix.text.to(device=device, dtype=dtype)[layout.text_src.to(device)]
        rows[layout.text_dst.to(device)] = self.txt_in(text)
        if layout.ref_tokens:
            if prefix.references is None or prefix.references.shape[0] != layout.ref_tokens:
                got = None if prefix.references is None else tuple(prefix.references.shape)
                raise ValueError(f"the layout places {layout.ref_tokens} reference latent tokens, got {got}.")
            rows[layout.ref_dst.to(device)] = self.img_in(prefix.references.to(device=device, dtype=dtype))
        return rows

    def _prefix_attention(self, prefixes, chunks, backend, device):
        """`(c, q, k, v, kv) -> out` for chunk c. A whole prefix runs on `backend`; a chunk after a reused leading
        run reads that run's keys and values from the cache (`kv`) and runs segment-wise on SDPA."""
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {backend!r}.")
        masks = {}
        if backend == "flex":
            key = ("flex", str(device))
            for g, first, _ in chunks:
                if first == 0:
                    layout = prefixes[g].layout
                    masks[g] = layout.memo(key, lambda layout=layout: flex_block_mask(layout, device))

        def attend(c, q, k, v, kv=None):  # kv: only a chunk after a held run reads it
            g, first, _ = chunks[c]
            segments = prefixes[g].layout.segments
            if first:
                return chunk_attention(q, k, v, kv.read_parts(g, first), segments, first)
            if g in masks:
                return prefix_attention_flex(q, k, v, masks[g])
            return prefix_attention_sdpa(q, k, v, segments)

        return attend

    @staticmethod
    def _sample_prefix(sample_prefix, num_prefixes: int, samples: int) -> list[int]:
        if num_prefixes == 0:
            raise ValueError("at least one prefix (the prompt) is needed.")
        if sample_prefix is None:
            if num_prefixes == 1:
                return [0] * samples
            if num_prefixes != samples:
                raise ValueError(f"{num_prefixes} prefixes for {samples} samples: pass sample_prefix.")
            return list(range(samples))
        sample_prefix = [int(g) for g in sample_prefix]
        if len(sample_prefix) != samples or not all(0 <= g < num_prefixes for g in sample_prefix):
            raise ValueError(f"sample_prefix must give each of the {samples} samples a prefix in [0, {num_prefixes}).")
        return sample_prefix
