"""The options record: one frozen value per model copy whose fields are the registered features' fields, and the
table of pairs built from the features' own verdicts.

`ModelOptions(**values)` takes every field of every registered feature (missing ones take the feature's default)
and asks each feature to check its values; `replace(**changes)` makes a new record. A feature registered later
(`register`, e.g. from a test or another module) extends the record and the table at once; the table must then hold
a verdict for every pair, or the registration is refused.
"""

import itertools

from .plugin import Feature, Refused

_FEATURES: dict[str, Feature] = {}


def features() -> tuple[Feature, ...]:
    """The registered features, in their order (each declares its verdicts against the ones before it)."""
    return tuple(_FEATURES.values())


def field_owners() -> dict[str, Feature]:
    """Record field -> the feature that declares it."""
    return {name: feature for feature in _FEATURES.values() for name in feature.fields}


def register(feature: Feature) -> None:
    """Add `feature` after the registered ones: its fields join the record, its verdicts the table. Refused (and
    nothing changed) when a field or name is taken or a verdict against an earlier feature is missing."""
    if feature.name in _FEATURES:
        raise ValueError(f"a feature named {feature.name!r} is registered already.")
    taken = sorted(set(feature.fields) & set(field_owners()))
    missing = sorted(set(_FEATURES) - set(feature.verdicts))
    unknown = sorted(set(feature.verdicts) - set(_FEATURES))
    if taken or missing or unknown:
        raise ValueError(f"feature {feature.name!r}: fields {taken} are another feature's, verdicts missing against "
                         f"{missing}, verdicts against unknown features {unknown}.")
    _FEATURES[feature.name] = feature


def unregister(name: str) -> None:
    """Remove the feature registered last (only the last: the others' verdicts never name a later one)."""
    if not _FEATURES or list(_FEATURES)[-1] != name:
        raise ValueError(f"only the feature registered last can be removed; {name!r} is not it.")
    del _FEATURES[name]


def verdict(a: str, b: str):
    """The table's `Supported` or `Refused` for two features (declared by the later one)."""
    order = list(_FEATURES)
    first, later = sorted((a, b), key=order.index)
    return _FEATURES[later].verdicts[first]


def pairs() -> dict:
    """The whole table: frozenset of two feature names -> verdict."""
    return {frozenset(pair): verdict(*pair) for pair in itertools.combinations(_FEATURES, 2)}


class ModelOptions:
    """Everything that rides on one model copy; the defaults are a plain model as loaded with default inputs."""

    __slots__ = ("_values",)

    def __init__(self, **values):
        owners = field_owners()
        unknown = sorted(set(values) - set(owners))
        if unknown:
            raise ValueError(f"unknown model option(s) {', '.join(unknown)}; the options are {', '.join(owners)}.")
        merged = {name: values.get(name, feature.fields[name]) for name, feature in owners.items()}
        object.__setattr__(self, "_values", merged)
        for feature in _FEATURES.values():
            feature.check(self)

    def __getattr__(self, name):
        try:
            return object.__getattribute__(self, "_values")[name]
        except KeyError:
            raise AttributeError(f"the options record has no field {name!r}") from None

    def __setattr__(self, name, value):
        raise AttributeError("the options record is frozen: make a new one with replace(...)")

    def __eq__(self, other):
        return isinstance(other, ModelOptions) and self._values == other._values

    def __hash__(self):
        return hash(tuple(self._values.items()))

    def __repr__(self):
        changed = {k: v for k, v in self._values.items() if v != field_owners()[k].fields[k]}
        return f"ModelOptions({', '.join(f'{k}={v!r}' for k, v in changed.items())})"

    def __reduce__(self):  # a worker process rebuilds the record from its values
        return (_rebuild, (dict(self._values),))

    def replace(self, **changes) -> "ModelOptions":
        return ModelOptions(**{**self._values, **changes})

    def active(self) -> tuple[str, ...]:
        """The features that are on, in registration order."""
        return tuple(feature.name for feature in _FEATURES.values() if feature.is_on(self))

    @property
    def split(self) -> bool:
        """Whether the DiT runs in worker processes (the devices feature is on)."""
        return bool(self._values.get("devices"))

    def pair_problem(self, also: tuple[str, ...] = ()) -> str | None:
        """The refusal for the first refused pair of features this record has on (and the features in `also`, which
        a mechanism is about to turn on), naming both; None when all compose."""
        on = self.active()
        on += tuple(name for name in _FEATURES if name in also and name not in on)
        for a, b in itertools.combinations(on, 2):
            found = verdict(a, b)
            if isinstance(found, Refused):
                return f"{_FEATURES[a].label} and {_FEATURES[b].label} do not work together: {found.advice}"
        return None

    def kept_identity(self, model) -> tuple:
        """(feature, value) for each active feature that a kept prefix cache must match (kept_entries.py's key)."""
        return tuple((feature.name, feature.kept_identity(model, self)) for feature in _FEATURES.values()
                     if feature.kept_identity is not None and feature.is_on(self))

    def start_run(self, model, facts) -> list:
        """The `RunPart`s of the active features for one sampling run, in registration order."""
        parts = []
        for feature in _FEATURES.values():
            if feature.start_run is not None and feature.is_on(self):
                part = feature.start_run(model, self, facts)
                if part is not None:
                    parts.append(part)
        return parts


def record_on(model) -> ModelOptions:
    """The record a model copy carries (`model.options`, which the loaders, the nodes and the features' `apply_*`
    set); a plain one for a model built in code that none has set."""
    return getattr(model, "options", None) or ModelOptions()


def _rebuild(values: dict) -> ModelOptions:
    return ModelOptions(**values)
