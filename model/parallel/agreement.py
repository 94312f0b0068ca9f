"""One step-cache decision for every rank of a split run (sampling/step_cache.py: the rule).

The step cache skips blocks 1..N-1 of a model call when block 0's residual barely changed. On ranks that each hold
part of the call, each would measure its own part and could decide differently; a rank that skips then waits in an
attention all-to-all the others never reach (the hang limit ends the run). So the ranks reduce the indicator over
their group before the decision, and every rank compares the same number with the same threshold:

    ulysses   each rank holds 1/N of every sample's target rows. It reads the rows of the stride-8 grid one process
              reads (global row index a multiple of 8, padding rows left out), and the group sums, per sample,
              |now - then|, |then| and the count read; the indicator is then the one process's ratio of means, the
              largest over the samples. Equal to one process's up to the order of the fp32 sums.
    cfg       each rank holds whole samples (its prompt of CFG); the indicator is the largest over the samples, so
              the group takes the maximum of the ranks' own indicators: one process's exactly. Both ranks use the
              threshold of the run's positive prompt (the one a single process decides with).

One small all-reduce (a few floats) per model call after the first full pass, whether or not the rule may skip
that call: the report keeps every call's indicator.
"""

import torch
import torch.distributed as dist

from ..sampling.step_cache import STRIDE, relative_change


class UlyssesIndicator:
    """The indicator of a Ulysses rank (`Ulysses.join_step_cache` sets it on the run's `StepCache`)."""

    def __init__(self, split):
        self.split = split  # the rank's `Ulysses`: rank, group, and the global target length of this forward

    def sampled(self, target: torch.Tensor) -> torch.Tensor:
        """This rank's rows `(S, T/N, width)` -> the rows of the global stride-8 grid it holds, every 8th channel."""
        local = target.shape[1]
        first = self.split.rank * local  # the global index of this rank's first row
        start = -first % STRIDE
        stop = max(start, min(local, self.split.target_len - first))  # padding rows are no sample's rows
        return target[:, start:stop:STRIDE, ::STRIDE].to(torch.float32, copy=True)

    def score(self, now: torch.Tensor, then: torch.Tensor) -> float:
        sums = torch.cat([(now - then).abs().sum((1, 2)).double(), then.abs().sum((1, 2)).double(),
                          torch.tensor([now[0].numel()], dtype=torch.float64)])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.split.group)
        samples, count = now.shape[0], sums[-1]
        change, scale = sums[:samples] / count, sums[samples:2 * samples] / count
        return float((change / scale.clamp_min(1e-6)).max())


class CfgIndicator:
    """The indicator of a CFG-parallel rank (`CfgParallel.join_step_cache`)."""

    def __init__(self, split):
        self.split = split

    @staticmethod
    def sampled(target: torch.Tensor) -> torch.Tensor:
        return target[:, ::STRIDE, ::STRIDE].to(torch.float32, copy=True)

    def score(self, now: torch.Tensor, then: torch.Tensor) -> float:
        score = torch.tensor([relative_change(now, then)], dtype=torch.float64)
        dist.all_reduce(score, op=dist.ReduceOp.MAX, group=self.split.group)
        return float(score)
