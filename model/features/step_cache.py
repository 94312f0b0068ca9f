"""The Step Cache node: skip the later blocks of model calls where the probe barely changed (lossy, opt-in).

The rule and its state are model/sampling/step_cache.py's `StepCache`, a block hook; this module says what rides
on the record, how it sits with the other features, and what one run of it adds: its hook on every model call, the
ranks of a split run deciding together, its report entry, and its state freed when the run ends.
"""

from ..sampling.step_cache import StepCache, StepCacheOptions
from .plugin import Feature, RunPart, Supported


def _check(record) -> None:
    if record.step_cache is not None and not isinstance(record.step_cache, StepCacheOptions):
        raise ValueError(f"step_cache must be StepCacheOptions or None; got {type(record.step_cache).__name__}.")


class StepCachePart(RunPart):
    def __init__(self, skipper: StepCache):
        self.skipper = skipper

    def hooks(self, call) -> tuple:
        return (self.skipper.call(call.sigma, key=call.phase, mode=call.mode),)

    def reads_sigma(self) -> bool:
        return True

    def finish(self, report: dict, notes: list, run) -> None:
        report["step_cache"] = self.skipper.report(run.per)

    def close(self) -> None:
        self.skipper.free()


def _start_run(model, record, run):
    skipper = StepCache.for_run(record.step_cache, run.sigmas, edit=run.edit, num_layers=run.num_layers)
    if skipper is None:
        return None
    if run.split is not None:  # a rank of a split model: the ranks reduce the indicator and decide together
        run.split.join_step_cache(skipper)
    return StepCachePart(skipper)


FEATURE = Feature(
    name="step_cache", label="the Step Cache node",
    fields={"step_cache": None},  # StepCacheOptions, or None: off
    is_on=lambda record: record.step_cache is not None,
    check=_check,
    verdicts={"cache": Supported("the step cache reads the target rows only; the cache's storage is the prefix's")},
    start_run=_start_run,
)
