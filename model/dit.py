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
- [q; k; v] and [gate; up] are single weights run as two GEMMs each, so every output is a dense buffer: on
  an H200 the gapped halves of one fused output cost more in slow strided kernels than the fusion saved
  (measured with benchmarks/bench_gpu.py, see the README).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import ATTENTION_BACKENDS, flex_block_mask, prefix_attention_flex, prefix_attention_sdpa, target_attention
from .layout import SequenceLayout
from .prefix_cache import PrefixKVCache
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


class Linear(nn.Module):
    """Bias-free linear whose weight may be stored in a narrower dtype (fp8) than the compute dtype."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows(x, 0, self.weight.shape[0])

    def rows(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Output features `[start, end)` only: one GEMM over a contiguous block of weight rows."""
        weight = self.weight[start:end]
        return F.linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype))


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


class Block(nn.Module):
    """One single-stream block. It owns no modulation: all blocks read the model's one shared table."""

    def __init__(self, config: DiTConfig, device=None, dtype=None):
        super().__init__()
        width, hidden = config.width, config.mlp_hidden
        self.qkv = Linear(width, 3 * width, device=device, dtype=dtype)  # rows: [q; k; v]
        self.norm_q = nn.Parameter(torch.ones(config.head_dim, device=device, dtype=dtype), requires_grad=False)
        self.norm_k = nn.Parameter(torch.ones(config.head_dim, device=device, dtype=dtype), requires_grad=False)
        self.to_out = Linear(width, width, device=device, dtype=dtype)
        self.gate_up = Linear(width, 2 * hidden, device=device, dtype=dtype)  # rows: [gate (SiLU); up]
        self.down = Linear(hidden, width, device=device, dtype=dtype)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        # [gate; up] stays one weight, used as two GEMMs: dense outputs keep SiLU and the product on fast
        # contiguous kernels (halves of one output are gapped views); in place, to skip two temporaries.
        hidden = self.gate_up.weight.shape[0] // 2
        up = self.gate_up.rows(x, hidden, 2 * hidden)
        return self.down(F.silu(self.gate_up.rows(x, 0, hidden), inplace=True).mul_(up))


@dataclass(frozen=True, eq=False)
class PrefixInputs:
    """One distinct prompt: text-encoder states `(L, context_dim)`, its layout, and its references' packed
    latents `(sum h*w, in_channels)` (None without references). Cached steps only read `layout`."""

    layout: SequenceLayout
    text: torch.Tensor | None = None
    references: torch.Tensor | None = None


class _Rows:
    """Where each kind of row sits in the ragged row buffer `[prefix 0 | prefix 1 | ... | targets]`."""

    def __init__(self, prefix_lens, samples: int, target_len: int, groups: list[list[int]], with_prefix: bool):
        self.prefix_spans = []
        start = 0
        for length in prefix_lens if with_prefix else ():
            self.prefix_spans.append((start, start + length))
            start += length
        self.target_start = start
        self.samples, self.target_len = samples, target_len
        self.groups = groups  # sample indices reading each prefix


class QwenImage21DiT(nn.Module):
    """The Qwen-Image 2.1 DiT. Parameter names are ours; `dit_loading` maps both file layouts onto them."""

    def __init__(self, config: DiTConfig = DiTConfig(), device=None, dtype=None, attention: str = "sdpa"):
        super().__init__()
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {attention!r}.")
        self.config = config
        self.attention = attention
        self.compute_dtype = dtype or torch.float32
        width = config.width
        self.time_embed = TimestepEmbedding(width, device=device, dtype=dtype)
        self.txt_in = TextProjection(config.context_in_dim, width, config.eps, device=device, dtype=dtype)
        self.img_in = Linear(config.in_channels, width, device=device, dtype=dtype)
        # one table for every block: rows [scale1; gate1; scale2; gate2], input silu(temb)
        self.modulation = Linear(width, 4 * width, device=device, dtype=dtype)
        self.blocks = nn.ModuleList(Block(config, device=device, dtype=dtype) for _ in range(config.num_layers))
        self.norm_out = Linear(width, width, device=device, dtype=dtype)  # final scale only, no shift
        self.proj_out = Linear(width, config.out_channels, device=device, dtype=dtype)

    # -- pieces ---------------------------------------------------------------------------------------------
    def _layer_norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), eps=self.config.eps)

    def _rope_tables(self, layout: SequenceLayout, device) -> dict:
        def build():
            axes, theta = self.config.axes_dims_rope, self.config.rope_theta
            prefix = rope_angles(layout.prefix_positions.to(device), axes, theta)
            target = rope_angles(layout.target_positions.to(device), axes, theta)
            return {"prefix": prefix, "target": target}

        return layout.memo(("rope", str(device), self.config.axes_dims_rope), build)

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

    def _modulate(self, x, scale, rows: _Rows, prefix_rows) -> torch.Tensor:
        """`x * (1 + scale)` with each row's own modulation row: `prefix_rows[g]` for prefix g, sample b's row
        for sample b's target rows."""
        out = torch.empty_like(x)
        for (start, end), row in zip(rows.prefix_spans, prefix_rows):
            torch.mul(x[start:end], 1 + scale[row], out=out[start:end])
        target = x[rows.target_start :].view(rows.samples, rows.target_len, -1)
        torch.mul(target, 1 + scale[: rows.samples, None], out=out[rows.target_start :].view_as(target))
        return out

    def _gated_add(self, x, gate, update, rows: _Rows, prefix_rows) -> None:
        """`x += tanh(gate) * update`, in place, with the same row selection as `_modulate`."""
        gate = gate.tanh()
        for (start, end), row in zip(rows.prefix_spans, prefix_rows):
            x[start:end] += gate[row] * update[start:end]
        target = x[rows.target_start :].view(rows.samples, rows.target_len, -1)
        target += gate[: rows.samples, None] * update[rows.target_start :].view_as(target)

    # -- the block ----------------------------------------------------------------------------------------
    def _block(self, index, x, mods, rows, prefix_rows, prefixes, cache, mode, rope, prefix_attn):
        config, block = self.config, self.blocks[index]
        heads, head_dim = config.num_heads, config.head_dim
        scale1, gate1, scale2, gate2 = mods.chunk(4, dim=-1)
        last = index == config.num_layers - 1

        h = self._modulate(self._layer_norm(x), scale1, rows, prefix_rows)
        width = config.width
        # One weight [q; k; v], two GEMMs: [q; k] and v land in separate dense buffers, so every later
        # elementwise kernel and the K/V concatenation run on contiguous memory (a single [q; k; v] output
        # leaves q, k and v as gapped views, which GPUs copy through slow strided kernels).
        qk = block.qkv.rows(h, 0, 2 * width).unflatten(-1, (2, heads, head_dim)).transpose(0, 1)  # (2, N, H, D)
        v = block.qkv.rows(h, 2 * width, 3 * width).unflatten(-1, (heads, head_dim))  # (N, H, D)
        qk = qk.to(torch.float32, memory_format=torch.contiguous_format)  # q and k normed and rotated together
        qk = head_rms_norm(qk, torch.stack([block.norm_q, block.norm_k])[:, None, None], config.eps).to(v.dtype)
        q, k = apply_rope(qk, rope[None, :, None]).unbind(0)  # (N, H, D) each, contiguous

        # The last block needs the prefix rows only as keys and values: drop them before anything else.
        first_out = rows.target_start if last else 0
        attn = torch.empty(x.shape[0] - first_out, heads, head_dim, dtype=v.dtype, device=v.device)
        prefix_kv = []
        for g, (start, end) in enumerate(rows.prefix_spans):
            if mode == "prefill":
                cache.store(g, index, k[start:end], v[start:end])
            prefix_kv.append((k[start:end], v[start:end]))
            if not last:
                attn[start:end] = prefix_attn(g, q[start:end], k[start:end], v[start:end])
        if mode == "cached":
            prefix_kv = [cache.layer(g, index) for g in range(len(rows.groups))]

        t0, samples, length = rows.target_start, rows.samples, rows.target_len
        q_t, k_t, v_t = (tensor[t0:].view(samples, length, heads, head_dim) for tensor in (q, k, v))
        attn_t = attn[t0 - first_out :].view(samples, length, heads, head_dim)
        for g, members in enumerate(rows.groups):
            if not members:
                continue
            pick = slice(members[0], members[-1] + 1) if members == list(range(members[0], members[-1] + 1)) else members
            attn_t[pick] = target_attention(q_t[pick], k_t[pick], v_t[pick], *prefix_kv[g])

        if last:
            x = x[t0:]
            rows = _Rows((), samples, length, rows.groups, with_prefix=False)
        attn_out = block.to_out(attn.flatten(1))
        self._gated_add(x, gate1, attn_out, rows, prefix_rows)
        mlp_out = block.mlp(self._modulate(self._layer_norm(x), scale2, rows, prefix_rows))
        self._gated_add(x, gate2, mlp_out, rows, prefix_rows)
        if x.dtype == torch.float16:
            x = x.clamp_(-65504, 65504)
        return x, rows

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
        Returns:
            `(B, T, out_channels)` in the compute dtype.
        """
        config = self.config
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
        if mode != "uncached":
            if not config.causal_condition:
                raise ValueError(
                    "the prefix KV cache needs causal_condition=True: only then are text and reference rows "
                    "modulated with t = 0 and independent of the step. Run this model with mode='uncached'."
                )
            if cache is None:
                raise ValueError(f"mode={mode!r} needs a PrefixKVCache to {'fill' if mode == 'prefill' else 'read'}.")
        elif cache is not None:
            raise ValueError("a cache was passed with mode='uncached'; use mode='prefill' to fill it.")

        samples, target_len = target.shape[:2]
        sample_prefix = self._sample_prefix(sample_prefix, len(prefixes), samples)
        for prefix in prefixes:
            if prefix.layout.target_len != target_len:
                raise ValueError(
                    f"target has {target_len} tokens but a layout was built for {prefix.layout.target_shape} "
                    f"({prefix.layout.target_len} tokens)."
                )
        groups = [[b for b, g in enumerate(sample_prefix) if g == index] for index in range(len(prefixes))]
        dtype, device = self.compute_dtype, target.device
        backend = attention or self.attention

        # Timestep rows: one per sample, plus the t = 0 row every prefix row reads under causal_condition.
        t = torch.as_tensor(timestep, device=device).reshape(-1).expand(samples).to(dtype)
        if config.causal_condition:
            t = torch.cat([t, t.new_zeros(1)])
            prefix_rows = [samples] * len(prefixes)
        else:
            if sample_prefix != list(range(samples)):
                raise ValueError("without causal_condition every sample needs its own prefix (prefix b for sample b).")
            prefix_rows = list(range(len(prefixes)))
        temb_act = F.silu(self.time_embed(t, dtype))
        mods = self.modulation(temb_act)  # (B + 1, 4 * width)
        final_scale = self.norm_out(temb_act)

        with_prefix = mode != "cached"
        rows = _Rows([p.layout.prefix_len for p in prefixes], samples, target_len, groups, with_prefix)
        tables = [self._rope_tables(p.layout, device) for p in prefixes]
        target_rope = torch.cat([tables[g]["target"] for g in sample_prefix])
        parts = [self.img_in(target.to(dtype)).flatten(0, 1)]
        rope_parts = [target_rope]  # (rows, head_dim / 2) complex, in row-buffer order
        if with_prefix:
            parts = [self._embed_prefix(p, dtype, device) for p in prefixes] + parts
            rope_parts = [table["prefix"] for table in tables] + rope_parts
        x = torch.cat(parts) if len(parts) > 1 else parts[0]
        rope = torch.cat(rope_parts) if len(rope_parts) > 1 else rope_parts[0]

        if mode == "prefill":
            cache.allocate(rows_prefix_lens(prefixes), config.num_layers, config.num_heads, config.head_dim, dtype, device)
        elif mode == "cached":
            cache.check_compatible(rows_prefix_lens(prefixes), config.num_layers, config.num_heads, config.head_dim)
        prefix_attn = self._prefix_attention(prefixes, backend, device) if with_prefix else None

        for index in range(config.num_layers):
            x, rows = self._block(index, x, mods, rows, prefix_rows, prefixes, cache, mode, rope, prefix_attn)

        x = x.view(samples, target_len, -1)
        x = self._layer_norm(x) * (1 + final_scale[:samples, None])
        return self.proj_out(x)

    def _prefix_attention(self, prefixes, backend, device):
        if backend == "flex":
            masks = [p.layout.memo(("flex", str(device)), lambda p=p: flex_block_mask(p.layout, device)) for p in prefixes]
            return lambda g, q, k, v: prefix_attention_flex(q, k, v, masks[g])
        if backend != "sdpa":
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {backend!r}.")
        return lambda g, q, k, v: prefix_attention_sdpa(q, k, v, prefixes[g].layout.segments)

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


def rows_prefix_lens(prefixes: list[PrefixInputs]) -> list[int]:
    return [p.layout.prefix_len for p in prefixes]
