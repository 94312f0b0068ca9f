"""The step methods beyond T8's rule (step_cache.py), as one block hook on the same protocol (hooks.py):

    front/back split   `probe_blocks` n, `back_blocks` m (cache-dit's DBCache Fn / Bn): the indicator reads the
                       first n blocks' residual; a skipped step adds the forecast residual of the middle blocks
                       n..N-m-1 and still runs the last m blocks (`Resume`), which correct part of the forecast's
                       error. n = 0 (with a mask or a schedule only: no indicator) runs no front block at all. Only a
                       cached step may skip middle blocks (its later blocks read their prefix from the prefix cache,
                       never a stale row), so without the prefix cache, or on a call with the Fun ControlNet (its
                       later control blocks chain on the skipped ones), a skipped step runs no back block and
                       replays the residual of every block after the probe instead, as T8 does.
    forecast           mode "taylor", `order` 1 or 2 (TaylorSeer's idea): the residual a skipped step adds is the
                       Newton polynomial in sigma through the last order + 1 full passes' residuals, evaluated at
                       the call's sigma (t8 replays the last one: order 0; extrapolate is order 1).
    steps mask         decide "mask": the first `full_first` steps, every `full_every`-th step after them and the
                       last `full_last` steps always run in full (cache-dit's steps computation mask); any other
                       step is skipped when the indicator is below the threshold (a huge threshold: always).
    schedule           decide "schedule": the full steps as shares of the run (`schedule`, step i of n at i / n),
                       chosen offline on a few prompts (DPCache's idea; benchmarks/step_cache_peers.py calibrates,
                       the node's presets carry the result), then as the mask.

With a mask or a schedule the window and the skip cap are theirs, not T8's: a step is full because the mask says so.
Every decision is a function of the call's sigma and the indicator, which the ranks of a split run reduce over their
group (parallel/agreement.py), so every rank skips the same calls and runs the same back blocks.
"""

import math

import torch

from ..transformer.hooks import Finish, Resume
from .step_cache import StepCache, StepCacheOptions


def full_steps(options: StepCacheOptions, steps: int) -> frozenset | None:
    """The steps (0-based, of `steps`) a mask or a schedule runs in full, step 0 always; None: the indicator decides
    alone (T8's window and skip cap)."""
    if options.decide == "mask":
        first, every, last = options.full_first, options.full_every, options.full_last
        return frozenset(i for i in range(steps) if i == 0 or i < first or i >= steps - last
                         or (every and (i - first) % every == 0))
    if options.decide == "schedule":
        return frozenset({0} | {min(steps - 1, round(share * steps)) for share in options.schedule})
    return None


def newton_forecast(points: list, sigma: float) -> torch.Tensor:
    """The polynomial through `points` [(sigma_j, value_j)] (oldest first, distinct sigmas) at `sigma`, by Newton's
    divided differences from the newest point: order len(points) - 1."""
    sigmas = [s for s, _ in points][::-1]  # newest first
    table = [v for _, v in points][::-1]
    value, product = table[0], 1.0
    for k in range(1, len(points)):
        table = [(table[j] - table[j + 1]) / (sigmas[j] - sigmas[j + k]) for j in range(len(table) - 1)]
        product *= sigma - sigmas[k - 1]
        value = value + table[0] * product
    return value


class StepMethods(StepCache):
    """A run's step cache with a front/back split (a probe of 0 blocks too), a forecast of order 1-2, a steps mask
    or a calibrated schedule (module docstring). The same hook as `StepCache`: `call` before each model call, then
    `start`, `after_block`, `end` from the DiT's forward."""

    min_probe = 0  # a mask or a schedule needs no indicator: a skipped step may run no front block

    def __init__(self, options: StepCacheOptions, sigmas, *, edit: bool, num_layers: int, probe_blocks: int = 1):
        super().__init__(options, sigmas, edit=edit, num_layers=num_layers, probe_blocks=probe_blocks)
        self.back_blocks = int(options.back_blocks)
        if self.probe_blocks + self.back_blocks >= self.num_layers:
            raise ValueError(f"probe_blocks + back_blocks must leave a block to skip of {self.num_layers}; got "
                             f"{self.probe_blocks} + {self.back_blocks}.")
        self.order = {"t8": 0, "extrapolate": 1}.get(options.mode, options.order)
        self.full = full_steps(options, len(self.sigmas) - 1)
        self._resumable = self._skipping = False
        self.resumed = 0  # skipped calls that ran the back blocks (the rest replayed every block after the probe)

    def _reset(self) -> None:
        super()._reset()
        self._history = []  # (sigma, residual) of the last order + 1 full passes, oldest first

    def free(self) -> None:
        super().free()
        self._history = []

    def step_of(self, sigma: float) -> int:
        """The 0-based step a call at `sigma` belongs to (a call between two sigmas: the earlier one's)."""
        return int(math.floor(self.progress(sigma) * (len(self.sigmas) - 1) + 1e-6))

    # -- the loop's side ------------------------------------------------------------------------------------------
    def call(self, sigma: float, key=None, mode: str = "cached") -> "StepMethods":
        super().call(sigma, key, mode)
        if self.full is not None:  # the mask or the schedule instead of T8's window and skip cap
            self._may_skip = (mode != "prefill" and self._residual is not None
                              and self.step_of(self._sigma) not in self.full)
        return self

    # -- the DiT's side -------------------------------------------------------------------------------------------
    def start(self, x: torch.Tensor, mods, rows, cache) -> "None | Finish | Resume":
        self._rows = rows
        # the back blocks run only where they read their prefix from the cache and no control stream chains on
        # the skipped blocks; the residual a full pass keeps is the one the run's skipped calls will replay
        self._resumable = self.back_blocks > 0 and rows.mode != "uncached" and not self._key
        self._skipping = False
        if self.probe_blocks == 0:  # no probe: the mask or the schedule decides before block 0
            decided = self._decide(x)
            return decided if isinstance(decided, (Finish, Resume)) else None
        self._before = self.indicator.sampled(self._targets(x))
        return None

    @property
    def _resume_at(self) -> int:
        return self.num_layers - self.back_blocks

    def after_block(self, index: int, x: torch.Tensor) -> "torch.Tensor | Finish | Resume":
        if index == self.probe_blocks - 1:
            return self._decide(x)
        if self._resumable and not self._skipping and index == self._resume_at - 1:
            self._keep(self._targets(x))  # a full pass: the middle blocks' residual, before the back blocks
        return x

    def _decide(self, x: torch.Tensor) -> "torch.Tensor | Finish | Resume":
        target = self._targets(x)
        if self.probe_blocks == 0:  # nothing to read: the mask or the schedule alone (the same on every rank)
            skipped = self._skips_now(target, None, skip=self._may_skip)
        else:
            skipped = self._skips_now(target, self._probed(target))
        if not skipped:
            return x
        replayed = (target.float() + self._replayed()).to(x.dtype)
        if not self._resumable:
            return Finish(replayed.flatten(0, 1))
        self._skipping = True
        self.resumed += 1
        target.copy_(replayed)  # the middle blocks' forecast output, in the buffer the back blocks read
        return Resume(self._resume_at, x)

    def end(self, x: torch.Tensor) -> None:
        if self._skipping:  # a skipped call that ran its back blocks: nothing new to keep
            self._skipping = False
            return
        if not self._resumable:
            self._keep(self._targets(x))
        self._reference, self._anchor, self._skips = self._indicator, None, 0

    def _keep(self, target: torch.Tensor) -> None:
        residual = (self._sigma, target.float() - self._anchor)
        history = [point for point in self._history if point[0] != self._sigma]  # a repeated sigma: the newer
        self._history = (history + [residual])[-(self.order + 1):]
        self._residual = residual

    def _replayed(self) -> torch.Tensor:
        """The forecast residual at this call's sigma: the Newton polynomial through the kept passes (order 0: the
        last pass's residual as it is)."""
        return newton_forecast(self._history, self._sigma)

    # -- the report -----------------------------------------------------------------------------------------------
    def report(self, per: str = "step") -> dict:
        report = super().report(per)
        calls = len(self.records)
        blocks = calls * self.num_layers
        skipped = report["skipped"]
        # a resumed call skipped the middle blocks; one that replayed everything after the probe skipped those
        middle, later = self.num_layers - self.probe_blocks - self.back_blocks, self.num_layers - self.probe_blocks
        saved = self.resumed * middle + (skipped - self.resumed) * later
        report.update({
            "blocks_skipped_share": round(saved / blocks, 4) if blocks else 0.0,
            "probe_blocks": self.probe_blocks, "back_blocks": self.back_blocks, "order": self.order,
            "decide": self.options.decide, "back_blocks_ran": self.resumed,
        })
        if self.full is not None:
            report["window"] = None  # the mask or the schedule decides which steps may skip
            report["max_skips"] = None
        return report


StepCache.methods = StepMethods  # what `StepCache.for_run` builds for these options (step_cache.py says why)
