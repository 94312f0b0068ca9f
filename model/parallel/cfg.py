"""CFG-parallel: true CFG's two prompts on two ranks, each running the whole model on its own prompt.

Rank 0 samples the positive prompt, rank 1 the negative, each with its own prefix cache (kept in its own store, as a
single-prompt run keeps it). After every forward the two velocities are gathered and both ranks continue from the
guided one, `v_neg + cfg (v_pos - v_neg)`, so their latents stay identical and rank 0's are the result. Per step only
the velocity crosses (`(B, T, 64)`: 0.5 MiB at 1024x1024 in bf16), against Ulysses' gigabyte, so it is the mode for
slow links; it helps only when cfg > 1 with a negative prompt (otherwise both ranks run the positive prompt and rank
1's work is wasted). What one process shares between the two prompts (a leading run of references) each rank
computes for itself.

Set as `model.parallel` like `Ulysses` (dit.py calls `shard` and `gather`); `worker.run_sample` gives each rank its
prompt and sets `scale` (None: no guidance, rank 0's velocity is used) for the run.
"""

import torch
import torch.distributed as dist

from ..prefix_cache.layout import PrefixKVCache
from .agreement import CfgIndicator
from .ulysses import all_gather_single


class CfgParallel:
    """This rank's half of CFG: its own prompt's forward; the guided velocity of both comes back."""

    def __init__(self, group=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.world != 2:
            raise ValueError(f"parallel cfg runs CFG's two prompts on two devices; got {self.world} devices. Use "
                             "ulysses for more.")
        self.scale: float | None = None  # the run's cfg; None: no guidance (rank 0's velocity for both)
        self.edit = False  # whether the run's positive prompt has references (the step cache's threshold)

    def join_step_cache(self, step_cache) -> None:
        """Make the run's step cache decide as one process would: the larger indicator of the two prompts, against
        the positive prompt's threshold on both ranks (parallel/agreement.py)."""
        step_cache.indicator = CfgIndicator(self)
        step_cache.threshold = step_cache.options.threshold_for(self.edit)

    def new_cache(self) -> PrefixKVCache:
        return PrefixKVCache()

    def shard(self, x: torch.Tensor, rows):
        return x, rows

    def gather(self, out: torch.Tensor, target_len: int) -> torch.Tensor:
        """This rank's velocity `(B, T, C)` -> the guided one (identical on both ranks)."""
        both = out.new_empty(2 * out.shape[0], *out.shape[1:])
        all_gather_single(both, out.contiguous(), group=self.group)
        positive, negative = both.chunk(2)
        if self.scale is None:
            return positive
        return negative + self.scale * (positive - negative)
