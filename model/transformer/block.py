"""One block of the Qwen-Image 2.1 DiT, the row buffer it runs over (`Rows`) and the DiT's config: the part a
second stream of the same blocks (the Fun ControlNet, controlnet.py) shares with the DiT (dit.py).

This is the inference block: it writes into preallocated buffers and updates the row buffer in place. Training
(demo/train_toy.py) switches a model to training.py's subclasses, which compute the same sums out of place."""

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from ..layers.linear import Linear
from ..prefix_cache.layout import LayerKV
from .attention import block_causal_attention, prefix_attention_flex, target_attention
from .rope import apply_rope


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


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm of q/k in fp32, weight used as stored (the reference's plain RMSNorm). `F.rms_norm` is one
    kernel where the reference's `x * rsqrt(mean(x^2) + eps)` is four, with the same fp32 values."""
    x = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        x = x.to(weight.dtype)
    return x * weight


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Affine-free LayerNorm over the width (the modulation supplies the scale)."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps)


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
        rope: `(rows, head_dim / 2, 2)` fp32 `[cos, sin]` rotations in buffer order (`rope.rope_rotations`).
        chunk_groups: the prefix of each chunk.
        whole: per prefix, the chunk holding all its rows (its keys are read from the buffer), else None (read
            from the cache).
        chunk_segments: per chunk, its prefix's segments as an `attention.segment_table` (the sdpa backend).
        chunk_first: per chunk, the prefix rows before it (read from the cache), 0 for a whole prefix.
        chunk_masks: per chunk, its flex block mask (a whole prefix on the flex backend), else None; empty when
            no chunk has one.
        target_attention: the target rows' attention (`attention.target_attention`'s signature); a parallel run
            puts its own here (model/parallel/ulysses.py: all-to-alls around this rank's heads).
        prefix_split: None, or a parallel run's `(chunk_attention, c, q, k, v, kv) -> out` around a prefill chunk's
            attention (ulysses.py: this rank's heads, then gathered).

    Everything a block reads here is tensors, ints and tuples of them (and one module-level function), no closures
    and no layouts, so a compiled block guards on nothing that changes with the prompt (`compiled.py`).
    """

    mode: str
    prefix_spans: tuple[tuple[int, int], ...]
    prefix_lens: tuple[int, ...]
    samples: int
    target_len: int
    readers: tuple
    prefix_mod_rows: tuple[int, ...]
    rope: torch.Tensor
    chunk_groups: tuple[int, ...] = ()
    whole: tuple = ()
    chunk_segments: tuple[torch.Tensor, ...] = ()
    chunk_first: tuple[int, ...] = ()
    chunk_masks: tuple = ()
    target_attention: Callable = target_attention
    prefix_split: Callable | None = None

    @property
    def target_start(self) -> int:
        return self.prefix_spans[-1][1] if self.prefix_spans else 0

    def targets_only(self) -> "Rows":
        """The same rows after the prefix rows were dropped from the buffer (the last block does this)."""
        return replace(self, prefix_spans=(), rope=self.rope[self.target_start :], chunk_groups=(), whole=(),
                       chunk_segments=(), chunk_first=(), chunk_masks=())

    def chunks(self, x: torch.Tensor, prefix: bool = True) -> tuple[torch.Tensor, ...]:
        """The buffer `x` as views: each chunk's rows, then the target rows (only those with `prefix=False`, a buffer
        after the last block dropped the rest). One split rather than a slice per chunk: under autograd every slice
        gets a zero-filled gradient of the whole buffer. A buffer of target rows only is returned as it is (a cached
        step launches no split)."""
        if not prefix or not self.prefix_spans:
            return (x,)
        return x.split([end - start for start, end in self.prefix_spans] + [x.shape[0] - self.target_start])

    def prefix_keys(self, g: int, chunk_k, chunk_v, kv=None) -> tuple:
        """Prefix g's keys and values for the target rows: its whole chunk's (`chunk_k[c]`, `chunk_v[c]`, from
        `chunks`), or the parts the cache holds (`attention.target_attention`'s forms)."""
        chunk = self.whole[g] if self.whole else None
        if chunk is not None:
            return chunk_k[chunk], chunk_v[chunk]
        parts = kv.read_parts(g)
        return [pk for pk, _ in parts], [pv for _, pv in parts]

    def prefix_attention(self, c: int, q, k, v, kv=None) -> torch.Tensor:
        """Block-causal attention of chunk c's rows `(n, heads, head_dim)` (`chunk_attention`), through
        `prefix_split` when a parallel run set one."""
        if self.prefix_split is not None:
            return self.prefix_split(self.chunk_attention, c, q, k, v, kv)
        return self.chunk_attention(c, q, k, v, kv)

    def chunk_attention(self, c: int, q, k, v, kv=None) -> torch.Tensor:
        """A whole prefix over itself, a chunk after a reused leading run over that run's keys and values (read from
        `kv`, this layer's cache) and itself."""
        if self.chunk_masks and self.chunk_masks[c] is not None:
            return prefix_attention_flex(q, k, v, self.chunk_masks[c])
        k, v = self.with_context(c, k, v, kv)
        return block_causal_attention(q, k, v, self.chunk_segments[c])

    def with_context(self, c: int, k, v, kv=None) -> tuple:
        """Chunk c's keys and values after those of the leading run the cache holds before it (none: as they are)."""
        first = self.chunk_first[c]
        if first:
            context = kv.read_parts(self.chunk_groups[c], first)
            k = torch.cat([part_k for part_k, _ in context] + [k])
            v = torch.cat([part_v for _, part_v in context] + [v])
        return k, v

    def modulate(self, x: torch.Tensor, factor: torch.Tensor, prefix: bool = True) -> torch.Tensor:
        """`x * factor` (`factor` = 1 + scale) with each row's own modulation row (prefix g: its row; sample b's
        targets: row b). `prefix=False`: `x` holds the target rows only (the last block after dropping the rest)."""
        out = torch.empty_like(x)
        t0 = self.target_start if prefix else 0
        if prefix:
            for (start, end), row in zip(self.prefix_spans, self.prefix_mod_rows):
                torch.mul(x[start:end], factor[row], out=out[start:end])
        target = x[t0:].view(self.samples, self.target_len, -1)
        torch.mul(target, factor[: self.samples, None], out=out[t0:].view_as(target))
        return out

    def gated_add(self, x: torch.Tensor, gate: torch.Tensor, update: torch.Tensor, prefix: bool = True):
        """`x + gate * update` (`gate` = tanh of the table's gate) with `modulate`'s row selection, in place into `x`
        (returned)."""
        t0 = self.target_start if prefix else 0
        if prefix:
            for (start, end), row in zip(self.prefix_spans, self.prefix_mod_rows):
                x[start:end] += gate[row] * update[start:end]
        target = x[t0:].view(self.samples, self.target_len, -1)
        target += gate[: self.samples, None] * update[t0:].view_as(target)
        return x


def block_modulation(table: torch.Tensor) -> torch.Tensor:
    """The modulation table `(B + 1, 4 * width)` `[scale1 | gate1 | scale2 | gate2]` as the blocks apply it,
    `[1 + scale1 | tanh(gate1) | 1 + scale2 | tanh(gate2)]`. Every block reads the same table, so this runs once per
    forward instead of four small kernels in each of the 32 blocks (the same values: the same ops on the same
    inputs)."""
    scale1, gate1, scale2, gate2 = table.chunk(4, dim=-1)
    return torch.cat([1 + scale1, gate1.tanh(), 1 + scale2, gate2.tanh()], dim=-1)


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
        gate = self.gate_up.rows(x, 0, hidden)
        return self.down(F.silu(gate, inplace=True).mul_(up))

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
            mods: `(B + 1, 4 * width)` modulation rows as applied, `[1 + scale1 | tanh(gate1) | 1 + scale2 |
                tanh(gate2)]` (`block_modulation`; the DiT's `prepare` makes them once for every block).
            rows: the buffer's `Rows`.
            kv: this layer's view of the prefix cache: filled in a prefill, read in a cached step.
            drop_prefix: return the target rows only (the last block: nothing reads the prefix rows' outputs,
                only their keys and values were needed).
        Returns:
            the updated buffer, `(rows, width)`, or the target rows only with `drop_prefix`. Eagerly `x` is updated
            in place and returned; a compiled block (`compiled`, set by `compiled.compile_blocks`) returns a new
            buffer, so read the result, not `x`.
        """
        if rows.mode != "uncached" and kv is None:
            raise ValueError(f"a {rows.mode} step needs this layer's prefix cache (kv).")
        drop_prefix = drop_prefix and bool(rows.prefix_spans)  # a cached step has no prefix rows to drop
        if self.compiled is not None and self.compiled.takes(rows, kv):
            return self.compiled(self, x, mods, rows, kv, drop_prefix)
        return self.run(x, mods, rows, kv, drop_prefix)

    #: the compiled forward shared by every block (`compiled.CompiledBlocks`), or None to run eagerly
    compiled = None

    def run(self, x: torch.Tensor, mods: torch.Tensor, rows: Rows, kv: LayerKV | None, drop_prefix: bool):
        """`forward`'s work, eager or traced: only tensor maths, so nothing in it breaks a compiled graph."""
        factor1, gate1, factor2, gate2 = mods.chunk(4, dim=-1)
        q, k, v = self.qkv_heads(rows.modulate(layer_norm(x, self.eps), factor1), rows.rope)
        attn = self.attention(q, k, v, rows, kv, drop_prefix)
        return self._finish(x, attn, gate1, factor2, gate2, rows, drop_prefix)

    def attention(self, q, k, v, rows: Rows, kv, drop_prefix: bool) -> torch.Tensor:
        """Every row's attention output `(rows, heads, head_dim)` (the target rows only with `drop_prefix`), written
        into one buffer; a prefill stores the chunks' keys and values in `kv` first."""
        heads, head_dim, t0 = self.num_heads, self.head_dim, rows.target_start
        first_out = t0 if drop_prefix else 0
        attn = torch.empty(q.shape[0] - first_out, heads, head_dim, dtype=v.dtype, device=v.device)
        (*q_c, q_t), (*k_c, k_t), (*v_c, v_t) = (rows.chunks(tensor) for tensor in (q, k, v))
        self._store_prefill(rows, k_c, v_c, kv)
        if not drop_prefix:
            for c, (start, end) in enumerate(rows.prefix_spans):
                attn[start:end] = rows.prefix_attention(c, q_c[c], k_c[c], v_c[c], kv)
        shape = (rows.samples, rows.target_len, heads, head_dim)
        q_t, k_t, v_t = (tensor.view(shape) for tensor in (q_t, k_t, v_t))
        attn_t = attn[t0 - first_out :].view(shape)
        for g, pick in enumerate(rows.readers):
            if pick is not None:
                prefix = rows.prefix_keys(g, k_c, v_c, kv)
                attn_t[pick] = rows.target_attention(q_t[pick], k_t[pick], v_t[pick], *prefix)
        return attn

    @staticmethod
    def _store_prefill(rows: Rows, chunk_k, chunk_v, kv) -> None:
        """A prefill stores every chunk's keys first: a later chunk may read an earlier one's."""
        if rows.mode == "prefill":
            for c in range(len(chunk_k)):
                kv.store(rows.chunk_groups[c], chunk_k[c], chunk_v[c])

    def _finish(self, x, attn, gate1, factor2, gate2, rows: Rows, drop_prefix: bool) -> torch.Tensor:
        """The attention's projection and the MLP, each added through its gate."""
        t0 = rows.target_start
        if drop_prefix:
            x = x[t0:]
        keep = not drop_prefix  # after dropping them the buffer holds the target rows only
        x = rows.gated_add(x, gate1, self.to_out(attn.flatten(1)), prefix=keep)
        x = rows.gated_add(x, gate2, self.mlp(rows.modulate(layer_norm(x, self.eps), factor2, prefix=keep)),
                           prefix=keep)
        if x.dtype == torch.float16:
            x = x.clamp_(-65504, 65504)
        return x
