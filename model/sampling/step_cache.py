"""The step cache: an opt-in, lossy skip of the DiT's blocks 1..N-1 on model calls where block 0 barely changed,
on top of the prefix cache (a skipped call still runs block 0 against the cached prefix, and the output layer).

The rule is T8 BlockCache 0.1.3's (T8mars/Comfyui-Qwen-Image-2.1-BlockCache-T8, `cache.py` / `runtime.py`), with its
defaults, because that is what users of core know:

    indicator   block 0's residual on the target rows, sampled at stride 8 over tokens and channels, against the one
                of the last full pass: mean |now - then| / mean |then| per sample, the largest over the batch (one
                unstable CFG or batch row forces a full pass)
    skip        when the indicator is below the threshold (0.08; 0.03 for edits, i.e. when references are present),
                the call is inside the window (10% to 85% of the run), at most 2 calls in a row, and a full pass was
                made since the last reset; a skipped call returns block 0's output + the residual blocks 1..N-1 added
                on the last full pass
    never       the prefill (it fills the prefix cache of every layer), the first call of a run (a kept-cache hit
                too: there is no full pass to reuse yet), a call after the Fun ControlNet's window opened or closed

Where we differ from T8, and why:
- the window is a share of the run's own schedule, the call's position between the sigmas it runs (step i of n is at
  i / n; a call between two sigmas, a second-order sampler's, in between). T8 converts its percents to sigmas with
  ComfyUI's flux `percent_to_sigma`, which places 10% / 85% elsewhere on the official 40-step schedule and, for
  img2img with denoise < 1, outside the steps that run.
- decisions are keyed to the sigma progression, not to a call count: a call at a sigma above the previous call's is a
  new pass (a restart sampler) and starts over; a repeated sigma (Heun's second call, then the next step's first) is
  an ordinary call that the indicator decides.
- mode "extrapolate" (not T8's) replays a first-order extrapolation in sigma of the last two full passes' residuals
  instead of the last one as it is.
- with the Fun ControlNet, a skipped call replays the control's later skips inside the residual (T8's behaviour). The
  node's former `control = recompute` (run the later control blocks on a skipped call) is retired: it moved pictures
  by 0.3 dB or less for 5-13% more time on the toy, and would run 17 instead of 2 of 48 blocks on a skipped call at the
  released size (docs/step-cache.md); a saved workflow that asks for it runs as above.

The probe is "the first n blocks" (`StepCache(probe_blocks=n)`, 1 = T8's block 0, what the nodes use): a block hook of
the DiT's forward (model/transformer/hooks.py), so another probe, a front/back split or a higher-order forecast is
another hook, not an edit of the DiT.

Off means exact: a model without the option, threshold 0 or mode "off" gives no `StepCache` (`StepCache.for_run`
returns None) and the DiT runs as before, bit for bit.
"""

import math
from dataclasses import dataclass

import torch

from ..transformer.hooks import STEP_CACHE, BlockHook, Finish

MODES = ("off", "t8", "extrapolate", "taylor")
#: what decides a skip: the indicator alone (T8), or a steps mask / a calibrated schedule of full steps first (a
#: step they mark full always runs; any other step is skipped when the indicator is below the threshold)
DECIDERS = ("indicator", "mask", "schedule")
ORDERS = (1, 2)  # mode "taylor": the forecast's order (finite differences in sigma over the last order + 1 passes)
#: T8 BlockCache 0.1.3's `CacheConfig` defaults; 0.03 for edits is its README's advice.
THRESHOLD, EDIT_THRESHOLD = 0.08, 0.03
START_PERCENT, END_PERCENT = 0.10, 0.85
MAX_SKIPS = 2
STRIDE = 8  # T8's `metric_stride`: every 8th token and channel of block 0's residual


@dataclass(frozen=True)
class StepCacheOptions:
    """What the Step Cache node sets on a model copy; the defaults are T8's."""

    mode: str = "t8"
    threshold: float = THRESHOLD
    edit_threshold: float = EDIT_THRESHOLD
    start_percent: float = START_PERCENT
    end_percent: float = END_PERCENT
    max_skips: int = MAX_SKIPS
    # -- the step methods (model/sampling/step_methods.py); the defaults are T8's rule above -----------------------
    probe_blocks: int = 1  # the indicator reads the output of the first n blocks (0: none, a mask or schedule)
    back_blocks: int = 0  # a skipped step still runs the last m blocks (DBCache's front/back split; cached steps)
    order: int = 1  # mode "taylor": the forecast's order (1: what every preset uses); t8 replays (0), extrapolate is 1
    decide: str = "indicator"
    full_first: int = 0  # decide "mask": the first k steps always run in full,
    full_every: int = 0  # and every j-th step after them (0: none),
    full_last: int = 0  # and the last l steps
    schedule: tuple = ()  # decide "schedule": the full steps as shares of the run (step i of n at i / n)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}.")
        if self.decide not in DECIDERS:
            raise ValueError(f"decide must be one of {', '.join(DECIDERS)}; got {self.decide!r}.")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS} (mode taylor's forecast); got {self.order!r}.")
        for name in ("probe_blocks", "back_blocks", "full_first", "full_every", "full_last"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0; got {value!r}.")
        if self.probe_blocks == 0 and self.decide == "indicator":
            raise ValueError("probe_blocks 0 (no probe: a skipped step runs no front block) needs decide mask or "
                             "schedule; the indicator reads the probe's output.")
        if not isinstance(self.schedule, tuple) or not all(
                isinstance(f, (int, float)) and not isinstance(f, bool) and 0.0 <= f < 1.0 for f in self.schedule):
            raise ValueError(f"schedule must be a tuple of shares of the run in [0, 1); got {self.schedule!r}.")
        if self.decide == "schedule" and not self.schedule:
            raise ValueError("decide schedule needs the full steps (schedule), e.g. from a preset.")
        if self.decide == "mask" and not (self.full_first or self.full_every or self.full_last):
            raise ValueError("decide mask needs full_first, full_every or full_last > 0 (the steps that run in full).")
        for name in ("threshold", "edit_threshold"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number >= 0 (0 never skips); got {value!r}.")
        if not 0.0 <= self.start_percent < self.end_percent <= 1.0:
            raise ValueError(f"start_percent ({self.start_percent}) must be less than end_percent "
                             f"({self.end_percent}), within [0, 1].")
        if int(self.max_skips) != self.max_skips or self.max_skips < 0:
            raise ValueError(f"max_skips must be a whole number >= 0; got {self.max_skips!r}.")

    def threshold_for(self, edit: bool) -> float:
        return float(self.edit_threshold if edit else self.threshold)

    @property
    def is_t8(self) -> bool:
        """Whether this is T8's rule (or its first-order replay) as `StepCache` runs it; else `StepMethods` runs."""
        return (self.mode in ("t8", "extrapolate") and self.back_blocks == 0 and self.decide == "indicator")


def _sampled(target: torch.Tensor) -> torch.Tensor:
    """`(B, T, width)` -> fp32 `(B, ceil(T/8), ceil(width/8))`: the rows and channels the indicator reads."""
    return target[:, ::STRIDE, ::STRIDE].to(torch.float32, copy=True)  # a copy: blocks change the buffer in place


def relative_change(now: torch.Tensor, then: torch.Tensor) -> float:
    """Mean |now - then| / mean |then| per sample, the largest over the samples (T8's `difference`)."""
    axes = tuple(range(1, now.ndim))
    per_sample = (now - then).abs().mean(axes) / then.abs().mean(axes).clamp_min(1e-6)
    return float(per_sample.max())


class OneProcessIndicator:
    """The indicator of a run in one process: every target row is here (`sampled`), and `score` is the rule's."""

    @staticmethod
    def sampled(target: torch.Tensor) -> torch.Tensor:
        return _sampled(target)

    @staticmethod
    def score(now: torch.Tensor, then: torch.Tensor) -> float:
        return relative_change(now, then)


ONE_PROCESS = OneProcessIndicator()


class StepCache(BlockHook):
    """One run's step cache: the loop asks `call(sigma, key, mode)` before each model call and hands what it returns
    to the DiT's forward as one of its block hooks (model/transformer/hooks.py, last in their order). Its probe is the
    first `probe_blocks` blocks (1: T8's block 0): `start` samples the target rows before block 0, `after_block` at
    the probe's last block decides, and returns `Finish` (the probe's output + the replayed residual) on a skipped call;
    `end` keeps the residual of the blocks after the probe when every block ran.

    One decision per model call, for the whole batched forward (every sample and both CFG prompts). The tensors it
    holds (the probe's output and the residual of the last full pass, in fp32) are dropped by `free`, which the loop
    calls in its `finally`."""

    order = STEP_CACHE
    name = "the Step Cache"
    min_probe = 1  # T8's indicator reads block 0 at least
    #: the class that runs the other step methods (`StepMethods`): step_methods.py builds on this module, so it
    #: registers itself here when imported, and model/sampling/__init__.py imports it (every import of this module
    #: runs that first): one direction of imports, no cycle
    methods = None

    def __init__(self, options: StepCacheOptions, sigmas, *, edit: bool, num_layers: int, probe_blocks: int = 1):
        self.options = options
        self.threshold = options.threshold_for(edit)
        self.num_layers = int(num_layers)
        self.probe_blocks = int(probe_blocks)
        if not self.min_probe <= self.probe_blocks < self.num_layers:
            raise ValueError(f"probe_blocks must be {self.min_probe} to {self.num_layers - 1} (blocks after the "
                             f"probe to skip); got {probe_blocks!r}.")
        self.sigmas = [float(s) for s in sigmas]
        self.records: list[tuple[float, float | None, bool]] = []  # per call: sigma, indicator, skipped
        #: how the indicator is read and scored: `ONE_PROCESS` below; the ranks of a split run replace it with one
        #: that reduces the indicator over their group before the decision (model/parallel/agreement.py), or they
        #: would decide differently and wait on each other in the skipped blocks' collectives
        self.indicator = ONE_PROCESS
        self._reset()
        self._key = self._last_sigma = self._rows = None
        self._may_skip, self._sigma, self._before, self._anchor, self._indicator = False, None, None, None, None
        self._controlled = False  # whether any call of the run had a control stream (the report says)

    @classmethod
    def for_run(cls, options: StepCacheOptions | None, sigmas, *, edit: bool, num_layers: int,
                probe_blocks: int | None = None) -> "StepCache | None":
        """The run's step cache, or None when it cannot skip anything: no options, mode off, threshold 0 (exact by
        construction: the DiT never sees a step cache), or no block between the probe and the back blocks. T8's
        rule runs here; the other step methods (a front/back split, a forecast of order 2, a steps mask, a
        calibrated schedule) in step_methods.py."""
        if options is None or options.mode == "off" or options.threshold_for(edit) <= 0:
            return None
        probe = options.probe_blocks if probe_blocks is None else probe_blocks
        if num_layers <= probe + options.back_blocks:
            return None
        if options.is_t8 and cls is StepCache:
            return cls(options, sigmas, edit=edit, num_layers=num_layers, probe_blocks=probe)
        if StepCache.methods is None:
            raise RuntimeError("the step methods (model/sampling/step_methods.py) are not loaded; import "
                               "model.sampling, whose __init__ loads them.")
        return StepCache.methods(options, sigmas, edit=edit, num_layers=num_layers, probe_blocks=probe)

    def _reset(self) -> None:
        self._reference = None  # the probe's sampled residual at the last full pass
        self._residual = None  # (sigma, the later blocks' residual (B*T, width) fp32) of the last full pass
        self._previous = None  # the same of the full pass before (mode "extrapolate")
        self._skips = 0

    def free(self) -> None:
        self._reset()
        self._before = self._anchor = self._indicator = self._rows = None

    # -- the loop's side ------------------------------------------------------------------------------------------
    def progress(self, sigma: float) -> float:
        """The call's share of the run: step i of n is at i / n, a sigma between two of the run's at the fraction
        in between; above the first sigma 0, below the last 1."""
        s, n = self.sigmas, len(self.sigmas) - 1
        if n < 1 or sigma >= s[0]:
            return 0.0
        for i in range(n):
            high, low = s[i], s[i + 1]
            if low <= sigma <= high:
                return (i + ((high - sigma) / (high - low) if high > low else 0.0)) / n
        return 1.0

    def call(self, sigma: float, key=None, mode: str = "cached") -> "StepCache":
        """Prepare for one model call at `sigma`; `key` is the call's Fun ControlNet phase (True: its stream runs),
        what the call's blocks are: a residual is replayed only into a call of the same key. Returns self, the
        forward's block hook."""
        sigma = float(sigma)
        if (self._last_sigma is not None and sigma > self._last_sigma) or key != self._key:
            self._reset()  # a new pass, or other blocks: nothing of the last full pass applies
        self._last_sigma, self._key, self._sigma = sigma, key, sigma
        self._controlled = self._controlled or bool(key)
        options = self.options
        self._may_skip = (mode != "prefill" and self._residual is not None and self._skips < options.max_skips
                          and options.start_percent <= self.progress(sigma) < options.end_percent)
        return self

    # -- the DiT's side (hooks.BlockHook) -------------------------------------------------------------------------
    def _targets(self, x: torch.Tensor) -> torch.Tensor:
        """The target rows of the row buffer `(rows, width)` (always its last `samples * target_len` rows), as
        `(samples, target_len, width)`."""
        rows = self._rows
        return x[x.shape[0] - rows.samples * rows.target_len :].view(rows.samples, rows.target_len, -1)

    def start(self, x: torch.Tensor, mods, rows, cache) -> None:
        self._rows = rows
        self._before = self.indicator.sampled(self._targets(x))

    def after_block(self, index: int, x: torch.Tensor) -> "torch.Tensor | Finish":
        """After the probe's last block: `Finish` with the target rows `(samples * target_len, width)` when the call
        is skipped, else `x` (and the probe's output is kept to take the residual from)."""
        if index != self.probe_blocks - 1:
            return x
        target = self._targets(x)
        if not self._skips_now(target, self._probed(target)):
            return x
        return Finish((target.float() + self._replayed()).to(x.dtype).flatten(0, 1))

    def _probed(self, target: torch.Tensor) -> float | None:
        """The indicator of this call from the probe's output (None before any full pass to compare with)."""
        self._indicator = self.indicator.sampled(target) - self._before
        self._before = None
        return None if self._reference is None else self.indicator.score(self._indicator, self._reference)

    def _skips_now(self, target: torch.Tensor, score: float | None, skip: bool | None = None) -> bool:
        """Record this call's decision (by default: the rule's, `score` under the threshold) and count a skip; a
        full pass keeps the probe's output to take the residual from."""
        if skip is None:
            skip = self._may_skip and score is not None and math.isfinite(score) and score < self.threshold
        self.records.append((self._sigma, score, skip))
        if not skip:
            self._anchor = target.to(torch.float32, copy=True)  # a copy: the next blocks change the buffer in place
            return False
        self._skips += 1
        return True

    def end(self, x: torch.Tensor) -> None:
        """Every block ran; `x` holds the target rows after the last one: keep the later blocks' residual."""
        residual = self._targets(x).float() - self._anchor
        self._previous = self._residual if self.options.mode == "extrapolate" else None
        self._residual = (self._sigma, residual)
        self._reference, self._anchor, self._skips = self._indicator, None, 0

    def _replayed(self) -> torch.Tensor:
        """The residual a skipped call adds: the last full pass's, or (extrapolate) the line through the last two
        full passes' residuals in sigma, evaluated at this call's sigma."""
        sigma1, last = self._residual
        if self._previous is None or self._previous[0] == sigma1:
            return last
        sigma0, before = self._previous
        return last + (last - before) * ((self._sigma - sigma1) / (sigma1 - sigma0))

    # -- the report -----------------------------------------------------------------------------------------------
    def report(self, per: str = "step") -> dict:
        """The report's `step_cache`: the rule, calls run and skipped, and per call the indicator (None where there
        was no full pass to compare with) and the decision ("F" full, "S" skipped). `per`: what a call is ("step"
        for the built-in loop, "model call" for a SAMPLER)."""
        skipped = sum(skip for _, _, skip in self.records)
        calls = len(self.records)
        blocks, later = calls * self.num_layers, self.num_layers - self.probe_blocks
        return {
            "mode": self.options.mode,
            "threshold": self.threshold,
            "control": "reuse" if self._controlled else None,  # the one way left (reports before had "recompute")
            "window": [self.options.start_percent, self.options.end_percent],
            "max_skips": self.options.max_skips,
            "per": per,
            "run": calls - skipped,
            "skipped": skipped,
            "blocks_skipped_share": round(skipped * later / blocks, 4) if blocks else 0.0,
            "indicator": [None if score is None else round(score, 4) for _, score, _ in self.records],
            "pattern": "".join("S" if skip else "F" for _, _, skip in self.records),
        }
