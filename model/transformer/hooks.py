"""Block hooks: work between the DiT's blocks that may replace the row buffer `x` (model/transformer/dit.py).

`QwenImage21DiT.forward(..., hooks=[...])` runs, for one forward:

    prepare                       embeddings, modulation rows, the `Rows` (and a split run's shard)
    hook.start(x, mods, rows, cache)      every hook, before block 0
    for each block i:
        x = block(x)
        x = hook.after_block(i, x)        every hook, in ORDER; a `Finish` ends the blocks here, a `Resume`
                                          goes on at a later block
    hook.end(x)                   every hook, when every block ran
    final_layer

The order is stated once, by each hook's `order` (ties keep the caller's order), not by who builds the list:
    CONTROL (10)    a second stream that adds to `x` (the Fun ControlNet): part of the model's arithmetic
    INTERRUPT (20)  reads nothing, may raise (the interrupt check): after the arithmetic of the block
    STEP_CACHE (30) reads the finished `x` and may end the blocks early (the step cache's probe): last
A hook that ends the blocks early returns `Finish(target_rows)`: the forward goes straight to the output layer with
those rows (`(samples * target_len, width)`), the hooks after it in the order are not asked, and no hook's `end`
runs. A hook that skips some blocks and runs the rest (a front/back split: model/sampling/step_methods.py) returns
`Resume(index, x)` after block i: the forward goes on with block `index` (> i + 1) on the buffer `x`, the hooks after
it in the order are not asked about block i, and the blocks between never run. A hook's `start` may return either
too (a step method without a probe block): then no block, or only the blocks from `index` on, run. Only a cached
step may skip blocks this way: its prefix rows are in the prefix cache of every layer, so a later block never reads
a stale prefix row.

Hooks stay eager: they run between the compiled blocks (compiled.py), never inside a graph. The features add
theirs through their run parts (model/features/plugin.py); what changes a block from outside yet is no block hook:
- weight streaming (memory/streaming.py) uses torch's module hooks: it streams any list of layers, the text
  encoder's too, which never runs this forward;
- `Block.compiled` is how a block computes its own forward, not work between blocks (hooks run between compiled
  blocks);
- a rank's `Rows.target_attention` / `prefix_split` (parallel/ulysses.py) replace the attention inside a block,
  which no hook between blocks can reach;
- training (training.py) swaps in a block class whose forward autograd can follow: another arithmetic of the
  block itself.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

CONTROL, INTERRUPT, STEP_CACHE = 10, 20, 30


@dataclass(frozen=True, eq=False)
class Finish:
    """What a hook returns to end the blocks early: the target rows to finish the forward with."""

    x: torch.Tensor


@dataclass(frozen=True, eq=False)
class Resume:
    """What a hook returns to skip blocks: go on with block `index` on the buffer `x` (the blocks before it that have
    not run yet never run)."""

    index: int
    x: torch.Tensor


class BlockHook:
    """A hook's protocol, every method a no-op: subclasses override what they need.

    `cache_layers`: prefix-cache layers this hook's own blocks add after the DiT's (a control stream's), so a
    prefill allocates them and a cached step checks them. `runs_split`: whether it can run on one rank's share of
    the target rows of a split forward (model/parallel/ulysses.py); one that cannot is refused there by name."""

    order = INTERRUPT
    cache_layers = 0
    runs_split = True
    name = "a block hook"

    def start(self, x: torch.Tensor, mods: torch.Tensor, rows, cache) -> "None | Finish | Resume":
        """Before block 0: `x` the row buffer, `mods` the modulation rows, `rows` the buffer's `Rows`, `cache` the
        prefix cache (or None). None to run every block, or `Finish` / `Resume` to skip from block 0 on."""

    def after_block(self, index: int, x: torch.Tensor) -> "torch.Tensor | Finish | Resume":
        """After block `index`: the buffer to go on with (`x`, maybe changed in place), `Finish` or `Resume`."""
        return x

    def end(self, x: torch.Tensor) -> None:
        """Every block ran; `x` holds the target rows after the last one (the last block drops the prefix rows)."""


class EveryBlock(BlockHook):
    """`callback(index)` after each block, the buffer untouched (the loop's interrupt check inside a step)."""

    order = INTERRUPT
    name = "the interrupt check"

    def __init__(self, callback: Callable[[int], None]):
        self.callback = callback

    def after_block(self, index: int, x: torch.Tensor) -> torch.Tensor:
        self.callback(index)
        return x


def ordered(hooks) -> tuple:
    """The hooks of one forward in ORDER (None entries dropped); a stable sort, so equal orders keep theirs."""
    return tuple(sorted((hook for hook in hooks if hook is not None), key=lambda hook: hook.order))
