"""What rides on a model: one frozen record per model copy, set only by `with_options`, and the table of which
features work together.

Each feature is one module of model/features/ (registry.py lists them): it declares its fields of the record with
their validation, its verdicts in the table of pairs, and what one run of it adds (block hooks, report entries).
This module puts the record on a model copy: the nodes set it through `with_options(model, **changes)`, which
returns a new model copy carrying the new record (the input model never changes), and the samplers read it with
`options_of(model)`.

The mechanisms stay where they work (a LoRA's branches and a ControlNet's stream on the copy's modules, the compiled
block forward on its blocks, the workers' recipe in a `SplitModel`); the record says which are on, and `with_options`
applies a mechanism (its `build`) only after the record passed the table of pairs (docs/options.md).
"""

from dataclasses import replace as dataclass_replace

from .features import registry  # noqa: F401 (registers the pack's features)
from .features.plugin import Refused  # noqa: F401 (a refused pair's verdict, for readers of the table)
from .features.record import ModelOptions, features, field_owners, pairs, verdict  # noqa: F401
from .loaders.lora import AppliedLora, clone_tree
from .parallel.split import SplitModel
from .prefix_cache.storage_choice import CacheOptions, check_cache_storage

#: Each of the pack's features, as the user sets it (what a refusal names).
FEATURES = {feature.name: feature.label for feature in features()}
#: Which feature each field belongs to.
FIELDS = {name: feature.name for name, feature in field_owners().items()}
#: The table of pairs: frozenset of two feature names -> `Supported` / `Refused`.
PAIRS = pairs()
PLAIN = ModelOptions()


def options_of(model) -> ModelOptions:
    """The record a model copy carries; `PLAIN` for a model no node has set one on (a split model made through the
    Python API without one: its devices)."""
    record = getattr(model, "options", None)
    if record is None and isinstance(model, SplitModel):
        return ModelOptions(devices=tuple(model.devices), parallel=model.mode)
    return record or PLAIN


def with_options(model, *, build=None, turns_on: tuple[str, ...] = (), fresh: bool = False, **changes):
    """`model` with its record changed by `changes` (field names of `ModelOptions`), as a new model object: the
    record is checked against the table of pairs first, so a refused combination fails here, naming both features,
    before `build` does any work.

    `build(model)` applies a feature's mechanism and returns the new model copy, or None when it only checks
    something; without a copy of its own the model is copied (sharing every weight). A feature's `apply_*` (a LoRA,
    a ControlNet) records itself on its copy's record, which `changes` then extend: `turns_on` names the features
    such a `build` turns on, for the check before it runs. `fresh`: `model` is a new object only the caller holds
    (a loader's), so `build` may change it in place and it takes the record itself. A change that leaves the record
    as it was, without `build`, returns `model`.
    """
    step_cache = changes.get("step_cache")
    if step_cache is not None and step_cache.mode == "off":
        changes["step_cache"] = None  # off is no step cache: the model runs exactly as without one
    old = options_of(model)
    record = old.replace(**changes)  # an unknown field is refused here, naming the options there are
    problem = record.pair_problem(also=turns_on)
    if problem is not None:
        raise ValueError(problem)
    if build is None and record == old and not fresh:
        return model
    new = build(model) if build is not None else None
    if new is None or new is model:
        new = model if fresh else _copy(model)
    elif options_of(new) is not old:  # the build recorded its own feature on its copy: the changes go on top
        record = options_of(new).replace(**changes)
    if isinstance(new, SplitModel):
        return dataclass_replace(new, options=record)
    new.options = record
    return new


def with_cache_options(model, device: str = "auto", dtype: str = "default"):
    """`with_options` for the Prefix Cache node: the storage is checked on the model (an int8 / int4 cache needs
    comfy-kitchen and a row width its layouts take), so a graph that cannot run it fails there, naming `dtype`."""
    options = CacheOptions(device, dtype)
    if options.dtype == "default":  # nothing to check: an unchanged record returns the model itself
        return with_options(model, cache=options)
    return with_options(model, cache=options, build=lambda new: check_cache_storage(new, options))


def with_lora(model, path, strength: float, name: str, apply):
    """`model` with one more LoRA on its record's `loras`, and its mechanism where the model runs: a split model's
    recipe takes it (each worker applies it when it builds the chain, model/parallel/split.py); a model in this
    process gets `apply(model, path, strength, name=name)` (features/lora.py's `apply_lora`, or a caller's wrapper
    of it), which records it with the notes of its loading."""
    record = options_of(model)
    if record.split:
        return with_options(model, build=lambda split: split.with_lora(path, strength, name=name),
                            loras=record.loras + (AppliedLora(name, float(strength)),))
    return with_options(model, build=lambda whole: apply(whole, path, strength, name=name), turns_on=("lora",))


def _copy(model):
    """`model` as a new model object sharing every weight. The prefix cache is unaffected, so the copy keeps the
    model's kept prefixes (`cache_base`); the host's memory handle (ComfyUI's patcher) stays with the original."""
    if isinstance(model, SplitModel):
        return dataclass_replace(model)
    new = clone_tree(model)
    new.manager = None
    new.cache_base = model
    return new
