"""Ulysses sequence parallelism for the DiT: N ranks, each holding 1/N of the target rows and 1/N of the heads.

Every rank runs the same model on the same inputs (replicated weights). Per forward:

    shard       each sample's T target rows are padded to a multiple of N; rank r keeps rows [r T/N, (r+1) T/N)
    per block   row-wise work (modulation, q/k/v, output projection, MLP) on the rank's rows only;
                attention: one all-to-all turns the rows' q/k/v `(S, T/N, H, D)` into the rank's heads over all rows
                `(S, T, H/N, D)`, the rank attends over its heads of [cached prefix | target], and one all-to-all
                turns the result back (two calls carrying the four tensors of Ulysses' four all-to-alls: q, k, v
                and the output, each `(T/N) x width x dtype_bytes x (N-1)/N` leaving the rank per sample)
    gather      the velocity rows `(S, T/N, 64)` are gathered (64 channels: small next to the attention traffic)

The prefix cache is split by heads: rank r keeps heads [r H/N, (r+1) H/N) of every prefix row (`HeadShardedKVCache`),
which are exactly the heads it attends with, so a cached step reads no other rank's cache and each rank holds 1/N of
the single-process bytes. The prefill's prefix rows are replicated (every rank runs their projections and MLP; a
prefill is one step of a run, or none with a kept cache): each rank attends with its own heads and the heads are
gathered, so the prefix's attention work is split N ways, the rest is not.

Exactness: attention heads are independent, and each rank sees every key of its heads (the padded target rows are
cut from the keys), so the result equals one process up to the order of floating-point sums in the kernels.
"""

from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist

from ..prefix_cache.layout import LayerKV, PrefixKVCache
from ..transformer.attention import target_attention
from .agreement import UlyssesIndicator

# torch 2.13 renamed all_gather_into_tensor (the old name warns); torch >= 2.4 is supported, so take what exists
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def check_world(num_heads: int, world: int) -> None:
    """Refuse a rank count that does not split the heads evenly (every rank attends with num_heads / N heads)."""
    if world < 1 or num_heads % world:
        divisors = [n for n in range(1, num_heads + 1) if num_heads % n == 0]
        raise ValueError(
            f"Ulysses parallelism over {world} devices needs the number of devices to divide the model's "
            f"{num_heads} attention heads (each device attends with heads / devices of them); use one of "
            f"{', '.join(map(str, divisors))} devices."
        )


def cached_step_bytes(target_len: int, width: int, layers: int, world: int, itemsize: int, samples: int = 1) -> int:
    """Bytes one rank sends to the others in a cached step's attention: per block and sample, q, k, v and the output,
    each `(T/N) x width x itemsize x (N-1)/N` (T padded to a multiple of N). The velocity gather (64 channels) is
    not counted. At 1024x1024 (T 4,096, width 4,096, 32 blocks) in bf16: 1.0 GiB for N = 2, 0.75 GiB for N = 4."""
    local = -(-target_len // world)
    return 4 * layers * samples * local * width * itemsize * (world - 1) // world


class HeadShardedKVCache(PrefixKVCache):
    """A `PrefixKVCache` holding one rank's heads `heads` (a slice of the model's `num_heads`): everything else
    (planned reuse, kept entries, sharing between prompts) works on the shard as on a whole cache."""

    def __init__(self, heads: slice, num_heads: int):
        super().__init__()
        self.heads, self.num_heads = heads, num_heads
        self.local_heads = heads.stop - heads.start

    def _local(self, heads: int) -> int:
        if heads != self.num_heads:
            raise ValueError(f"this cache keeps heads {self.heads.start}:{self.heads.stop} of a {self.num_heads}-head "
                             f"model; the model has {heads}.")
        return self.local_heads

    def allocate(self, prefix_lens, layers: int, heads: int, head_dim: int, dtype, device) -> None:
        super().allocate(prefix_lens, layers, self._local(heads), head_dim, dtype, device)

    def check_compatible(self, prefix_lens, layers: int, heads: int, head_dim: int) -> None:
        super().check_compatible(prefix_lens, layers, self._local(heads), head_dim)

    def layer_kv(self, layer: int) -> "HeadShardLayerKV":
        return HeadShardLayerKV(self, layer)


class HeadShardLayerKV(LayerKV):
    """A layer of a `HeadShardedKVCache`: the block hands it every head's keys/values, it stores the rank's."""

    __slots__ = ("heads",)

    def __init__(self, cache: HeadShardedKVCache, layer: int):
        super().__init__(cache, layer)
        self.heads = cache.heads

    def store(self, group: int, key: torch.Tensor, value: torch.Tensor) -> None:
        # views, written through: a quantized store puts the rounded rows back into the block's buffer
        super().store(group, key[:, self.heads], value[:, self.heads])


def _pad_rows(t: torch.Tensor, samples: int, length: int, padded: int) -> torch.Tensor:
    """`(samples * length, ...)` -> `(samples, padded, ...)`, zero rows appended to each sample."""
    t = t.view(samples, length, *t.shape[1:])
    if padded == length:
        return t
    pad = t.new_zeros(samples, padded - length, *t.shape[2:])
    return torch.cat([t, pad], dim=1)


class Ulysses:
    """This rank's share of a Ulysses forward; set as `model.parallel` on each rank's model (dit.py calls `shard`
    after `prepare` and `gather` after the output head).

    `group` is the torch.distributed process group of the N ranks (None: the default group). `sent_bytes` counts
    what the attention all-to-alls sent to other ranks (for the report and the traffic test).
    """

    def __init__(self, num_heads: int, group=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        check_world(num_heads, self.world)
        self.num_heads = num_heads
        share = num_heads // self.world
        self.heads = slice(self.rank * share, (self.rank + 1) * share)
        self.target_len = 0  # each sample's target rows in the forward being run (set by `shard`)

    def new_cache(self) -> HeadShardedKVCache:
        """The prefix cache a sampling run on this rank fills (`sample(new_cache=...)`)."""
        return HeadShardedKVCache(self.heads, self.num_heads)

    def join_step_cache(self, step_cache) -> None:
        """Make the run's step cache decide as one process would, over the ranks' rows (parallel/agreement.py)."""
        step_cache.indicator = UlyssesIndicator(self)

    def local_rows(self, target_len: int) -> int:
        """Target rows per sample on each rank: T padded up to a multiple of N, divided by N."""
        return -(-target_len // self.world)

    # -- the forward's two ends ---------------------------------------------------------------------------
    def shard(self, x: torch.Tensor, rows):
        """The row buffer and its `Rows` with each sample's target rows cut to this rank's share."""
        samples, length = rows.samples, rows.target_len
        self.target_len = length
        local = self.local_rows(length)
        first = self.rank * local
        t0 = rows.target_start

        def mine(t):
            return _pad_rows(t[t0:], samples, length, local * self.world)[:, first:first + local].flatten(0, 1)

        x = torch.cat([x[:t0], mine(x)]) if t0 else mine(x).contiguous()
        rope = torch.cat([rows.rope[:t0], mine(rows.rope)]) if t0 else mine(rows.rope).contiguous()
        return x, replace(rows, target_len=local, rope=rope, prefix_split=self._prefix_attention,
                          target_attention=partial(self._target_attention, length))

    def gather(self, out: torch.Tensor, target_len: int) -> torch.Tensor:
        """`(S, T/N, C)` velocity rows of every rank -> `(S, T, C)` on every rank."""
        samples, local, channels = out.shape
        return self._all_gather(out).transpose(0, 1).reshape(samples, self.world * local, channels)[:, :target_len]

    # -- attention --------------------------------------------------------------------------------------------
    def _all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        """`send` `(N, ...)`: slice i goes to rank i; returns slice i from rank i. Looked up on `dist` at each call
        (the traffic test counts the calls there)."""
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)
        return received

    def _all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """`(N, *t.shape)`: every rank's `t` in rank order (gloo wants the output as one dim-0 concatenation)."""
        parts = t.new_empty(self.world * t.shape[0], *t.shape[1:])
        all_gather_single(parts, t.contiguous(), group=self.group)
        return parts.view(self.world, *t.shape)

    def _mine(self, part: torch.Tensor) -> torch.Tensor:
        """This rank's heads of prefix keys/values `(P, heads, D)`: the cache holds only them already; a prefill
        or an uncached forward hands the buffer's rows with every head."""
        return part[:, self.heads] if part.shape[1] == self.num_heads else part

    def _target_attention(self, target_len: int, q, k, v, prefix_k, prefix_v) -> torch.Tensor:
        """`target_attention` for this rank's rows `(S, T/N, H, D)`, returning the same shape."""
        samples, local, heads, dim = q.shape
        world, share = self.world, heads // self.world
        # rows -> heads: (3, S, T/N, N, H/N, D) laid out as (N, 3, S, T/N, H/N, D), slice i for rank i
        send = torch.stack([q, k, v]).view(3, samples, local, world, share, dim).permute(3, 0, 1, 2, 4, 5)
        got = self._all_to_all(send.contiguous())  # (N from, 3, S, T/N, H/N, D): rank i's rows, my heads
        q_h, k_h, v_h = got.permute(1, 2, 0, 3, 4, 5).reshape(3, samples, world * local, share, dim)
        if isinstance(prefix_k, torch.Tensor):
            prefix_k, prefix_v = self._mine(prefix_k), self._mine(prefix_v)
        elif prefix_k is not None:
            prefix_k, prefix_v = [self._mine(p) for p in prefix_k], [self._mine(p) for p in prefix_v]
        # padded rows are queries whose answers are dropped, never keys
        out = target_attention(q_h, k_h[:, :target_len], v_h[:, :target_len], prefix_k, prefix_v)
        # heads -> rows: (S, N, T/N, H/N, D) laid out as (N, S, T/N, H/N, D), slice j for rank j
        back = self._all_to_all(out.view(samples, world, local, share, dim).transpose(0, 1).contiguous())
        return back.permute(1, 2, 0, 3, 4).reshape(samples, local, heads, dim)

    def _prefix_attention(self, inner, c, q, k, v, kv=None) -> torch.Tensor:
        """A prefill chunk's block-causal attention `(P, H, D)` with this rank's heads, the heads gathered."""
        heads = self.heads
        out = inner(c, q[:, heads], k[:, heads], v[:, heads], kv).contiguous()  # (P, H/N, D)
        return self._all_gather(out).transpose(0, 1).reshape(out.shape[0], self.num_heads, out.shape[2])
