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
  saved (measured with benchmarks/speed.py gpu, see docs/measurements.md).
One block, the row buffer it runs over and the config are in `block.py` (the Fun ControlNet's blocks are the same).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..layers.linear import Linear
from ..prefix_cache.layout import PrefixKVCache
from .attention import ATTENTION_BACKENDS, flex_block_mask, segment_table
from .block import Block, DiTConfig, Rows, block_modulation, layer_norm
from .compiled import begin_step
from .hooks import BlockHook, Finish, Resume, ordered
from .layout import SequenceLayout
from .rope import rope_rotations

TIMESTEP_DIM = 256  # sinusoid width fed to the timestep MLP
#: How many batch compositions' row rotations a layout keeps (`_rope`).
ROWS_ROPE_KEPT = 4
MODES = ("uncached", "prefill", "cached")


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


@dataclass(frozen=True, eq=False)
class PrefixInputs:
    """One distinct prompt: text-encoder states `(L, context_dim)`, its layout, and its references' packed
    latents `(sum h*w, in_channels)` (None without references). Cached steps only read `layout`."""

    layout: SequenceLayout
    text: torch.Tensor | None = None
    references: torch.Tensor | None = None


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

    `forward` = `prepare` (embeddings, modulation rows, the `Rows` of this call) + each block, with the block hooks
    between them (hooks.py) + `final_layer`.
    """

    def __init__(self, config: DiTConfig = DiTConfig(), device=None, dtype=None,  # noqa: B008 (frozen)
                 attention: str = "sdpa"):
        super().__init__()
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {attention!r}.")
        self.config = config
        self.attention = attention
        self.compute_dtype = dtype or torch.float32
        self.source = None  # what the loader read (loaders.dit_keys.DiTSource); None for a model built in code
        self.manager = None  # the host's memory-management handle (nodes/bridge.py keeps ComfyUI's patcher here)
        # the options record (model/features/record.py): which features this copy runs with, the only place that
        # says so; set by the loaders, the nodes and the features' `apply_*`; None for a model built in code
        self.options = None
        # this process's share of a forward split over several (model/parallel/ulysses.py: `shard` after `prepare`,
        # `gather` after the output head); None: this process does all of it
        self.parallel = None
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
        hooks: Sequence[BlockHook | None] = (),
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
            hooks: work between blocks (`hooks.BlockHook`: the Fun ControlNet's stream, the interrupt check, the step
                cache), run in their stated order (hooks.py); None entries are skipped.
        Returns:
            `(B, T, out_channels)` in the compute dtype.
        """
        begin_step(self)
        hooks = ordered(hooks)
        x, mods, final_scale, rows = self.prepare(target, timestep, prefixes, sample_prefix, cache, mode, attention,
                                                  extra_cache_layers=sum(hook.cache_layers for hook in hooks))
        if self.parallel is not None:
            self._check_split(hooks)
            x, rows = self.parallel.shard(x, rows)
        began = [hook.start(x, mods, rows, cache) for hook in hooks]
        last, index = len(self.blocks) - 1, 0
        skip = next((early for early in began if isinstance(early, (Finish, Resume))), None)
        if isinstance(skip, Finish):  # no block runs (a step method with no probe: hooks.py)
            return self._gathered(self.final_layer(skip.x, final_scale, rows), target)
        if isinstance(skip, Resume):
            index, x = self._resumed(-1, skip, rows), skip.x
        while index <= last:
            x = self.blocks[index](x, mods, rows, cache.layer_kv(index) if cache is not None else None,
                                   drop_prefix=index == last)
            following = index + 1
            for hook in hooks:
                x = hook.after_block(index, x)
                if isinstance(x, Finish):  # the blocks left are skipped: the output layer reads these target rows
                    return self._gathered(self.final_layer(x.x, final_scale, rows), target)
                if isinstance(x, Resume):  # the blocks up to x.index are skipped; the later ones run
                    following, x = self._resumed(index, x, rows), x.x
                    break
            index = following
        for hook in hooks:
            hook.end(x)
        return self._gathered(self.final_layer(x, final_scale, rows), target)

    def _resumed(self, index: int, resume: Resume, rows) -> int:
        """The block a `Resume` after block `index` goes on with; only a cached step may skip blocks (hooks.py)."""
        if not index + 1 < resume.index < len(self.blocks):
            raise ValueError(f"a hook may resume after block {index} at a later block than the next, up to "
                             f"{len(self.blocks) - 1}; got {resume.index}.")
        if rows.mode != "cached":
            raise ValueError(f"only a cached step may skip blocks (its prefix rows are in the prefix cache); this "
                             f"step is {rows.mode}.")
        return resume.index

    @staticmethod
    def _check_split(hooks) -> None:
        for hook in hooks:
            if not hook.runs_split:
                raise ValueError(f"{hook.name} does not run split over several devices yet; load the model with "
                                 "parallel off to use it.")

    def _gathered(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The velocity of every target row: this process's own, or gathered from every rank of a split forward."""
        return out if self.parallel is None else self.parallel.gather(out, target.shape[1])

    def prepare(self, target, timestep, prefixes, sample_prefix=None, cache=None, mode="uncached", attention=None,
                extra_cache_layers: int = 0):
        """Everything before the first block: `(x, mods, final_scale, rows)`.

        `x` is the row buffer `(rows, width)`, `mods` the modulation rows `(B + 1, 4 * width)` every block
        reads (`block.block_modulation`), `final_scale` the output head's `(B + 1, width)`, `rows` the buffer's
        `Rows`. A prefill allocates `cache` (with `extra_cache_layers` after the blocks' own: the hooks' blocks);
        a cached step checks it was filled for these prefixes and layers.
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
        mods = block_modulation(self.modulation(temb_act))  # (B + 1, 4 * width), as every block applies it
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
            chunk_groups=tuple(g for g, _, _ in chunks),
            whole=tuple(whole),
            chunk_segments=tuple(segment_table(prefixes[g].layout.segments) for g, _, _ in chunks),
            chunk_first=tuple(first for _, first, _ in chunks),
            chunk_masks=self._flex_masks(prefixes, chunks, attention or self.attention, device),
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
        """The rotations of every buffer row, `(rows, head_dim / 2, 2)` `[cos, sin]`; built once per run and reused
        by every step (layouts live for a run, so the memo sits on the first prefix's layout)."""
        axes, theta = self.config.axes_dims_rope, self.config.rope_theta
        layouts = tuple(p.layout for p in prefixes)

        def table(layout, part):
            positions = layout.prefix_positions if part == "prefix" else layout.target_positions
            key = ("rope", part, str(device), axes)
            return layout.memo(key, lambda: rope_rotations(positions.to(device), axes, theta))

        def build():
            parts = [table(layouts[g], "prefix")[first:end] for g, first, end in chunks]
            parts += [table(layouts[g], "target") for g in sample_prefix]
            return torch.cat(parts) if len(parts) > 1 else parts[0]

        # The last few batch compositions that started with this layout, oldest first: a sampling loop repeats one
        # (or two, with CFG) every step, while a layout that lives on (a prompt ComfyUI keeps, a training set)
        # meets ever new ones, whose tables and other layouts must not pile up here.
        recent = layouts[0].memo("rows_rope", dict)
        key = (str(device), axes, tuple(map(id, layouts)), tuple(sample_prefix), tuple(chunks))
        # the entry keeps its layouts alive, so no other layout can take one of their ids while it is here
        kept = recent.pop(key, None) or (layouts, build())
        recent[key] = kept  # now the newest
        while len(recent) > ROWS_ROPE_KEPT:
            recent.pop(next(iter(recent)))
        return kept[1]

    def _embed_prefix(self, prefix: PrefixInputs, dtype, device) -> torch.Tensor:
        """`(P, width)` prefix rows: projected text in its rows, projected reference latents in theirs."""
        layout = prefix.layout
        if prefix.text is None:
            raise ValueError("a prefill or uncached step needs the prompt's text states (PrefixInputs.text).")
        rows = torch.empty(layout.prefix_len, self.config.width, dtype=dtype, device=device)
        text = prefix.text.to(device=device, dtype=dtype)[layout.text_src.to(device)]
        rows[layout.text_dst.to(device)] = self.txt_in(text).to(dtype)  # .to: autocast (training) runs bf16
        if layout.ref_tokens:
            if prefix.references is None or prefix.references.shape[0] != layout.ref_tokens:
                got = None if prefix.references is None else tuple(prefix.references.shape)
                raise ValueError(f"the layout places {layout.ref_tokens} reference latent tokens, got {got}.")
            rows[layout.ref_dst.to(device)] = self.img_in(prefix.references.to(device=device, dtype=dtype)).to(dtype)
        return rows

    def _flex_masks(self, prefixes, chunks, backend, device) -> tuple:
        """Per chunk its flex block mask on the flex backend (a whole prefix only: a chunk after a reused leading
        run runs segment-wise on SDPA), else None; `()` on the sdpa backend."""
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {backend!r}.")
        if backend != "flex":
            return ()
        key = ("flex", str(device))
        return tuple(
            prefixes[g].layout.memo(key, lambda layout=prefixes[g].layout: flex_block_mask(layout, device))
            if first == 0 else None
            for g, first, _ in chunks
        )

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
