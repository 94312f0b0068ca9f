"""A feature's declaration (`Feature`) and what one run of it is (`RunPart`).

The sampling loop sits below the features in the floor plan, so it never imports them: the run spec hands it the
`RunPart`s of the record's active features (built by `Feature.start_run`), and the loop only calls the protocol
below, in the order the parts were given.
"""

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Supported:
    how: str  # why the two compose (what tests/test_feature_pairs.py compares)


@dataclass(frozen=True)
class Refused:
    advice: str  # what to do instead


class RunPart:
    """One feature's share of one sampling run; every method a no-op."""

    def hooks(self, call) -> tuple:
        """Block hooks for one model call (`call`: a loop `ModelCall`: sigma, mode, control phase); each hook's
        `order` places it among the others (model/transformer/hooks.py)."""
        return ()

    def reads_sigma(self) -> bool:
        """Whether its hooks need the call's sigma (the denoiser then passes it with every call)."""
        return False

    def phase(self, sigma: float) -> bool:
        """Whether a call at `sigma` is in this feature's phase (it reads a prefix cache of its own: a Fun
        ControlNet's window); False for a feature without phases."""
        return False

    def phase_cache(self):
        """What the cache of its phase adds to the plain one (`extra_layers`, `cache_key`, `read_order(base_layers)`:
        prefix_cache/lifecycle.py), or None for a feature without phases."""
        return None

    def prepare(self, calls_in_phase: bool) -> None:
        """Before the first call's clock (`calls_in_phase`: some call of the run is in its phase)."""

    def finish(self, report: dict, notes: list, run) -> None:
        """Add its keys to the run's report and its notes (`run`: the loop's `RunFacts`)."""

    def close(self) -> None:
        """Free what it held (after success, error or interrupt)."""


@dataclass(frozen=True)
class Feature:
    """One feature as the options record and the run see it.

    `fields`: record field -> default (the default is the plain model's). `check(record)` raises ValueError naming
    the input for a bad value. `is_on(record)`. `verdicts`: feature name -> `Supported` / `Refused`, for each
    feature before it in the registry's order. `start_run(model, record, run)` -> a `RunPart` or None.
    `kept_identity(model, record)` -> a value a kept prefix cache must match (another value never reuses one).
    `route_inputs`: node id -> the inputs of that node the route key keeps
    (nodes/route_key.py holds the stdlib copy; tests/test_route_key.py checks the two agree)."""

    name: str
    label: str  # as the user sets it (what a refusal names)
    fields: dict
    is_on: Callable
    check: Callable = lambda record: None
    verdicts: dict = field(default_factory=dict)
    start_run: Callable | None = None
    kept_identity: Callable | None = None
    route_inputs: dict = field(default_factory=dict)


def one_of(name: str, value, allowed) -> None:
    """The check of a choice field: `name` must be one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}.")
