"""What rides on a model: one frozen record per model copy, set only by `with_options`, and the table of which
features work together.

Every feature a node adds to a model (the prefix cache's storage, the step cache, the Fun ControlNet, LoRAs) and
every loader choice the sampler must honour (compile, devices / parallel, weight_dtype, the memory plan) is a field of
`ModelOptions`. The nodes set it through `with_options(model, **changes)`, which returns a new model copy carrying the
new record (the input model never changes), and the samplers read it with `options_of(model)`: one record instead of
attributes set here and there and a type test for the split model.

The mechanisms stay where they work (a LoRA's branches and a ControlNet's stream on the copy's modules, the compiled
block forward on its blocks, the workers' recipe in a `SplitModel`); the record says which are on, and `with_options`
applies a mechanism (its `build`) only after the record passed the table of pairs.

`PAIRS` holds a verdict for every pair of `FEATURES`: supported (the combination gives what each gives alone;
tests/test_feature_pairs.py runs every one) or refused when the record is set, before anything runs, with a message
that names both nodes / inputs and says what to do. A new field must name its feature in `FIELDS`, and a new
feature needs a verdict against every other one: the module refuses to import otherwise.
"""

import itertools
from dataclasses import dataclass, fields, replace

from .loaders.checkpoint import WEIGHT_DTYPES
from .loaders.lora import clone_tree
from .memory.planner import PLAN_CHOICES
from .parallel.split import PARALLEL_MODES, SplitModel
from .prefix_cache.storage_choice import CacheOptions, check_cache_storage
from .sampling.step_cache import StepCacheOptions
from .transformer.compiled import COMPILE_MODES

#: Each feature, as the user sets it (what a refusal names).
FEATURES = {
    "cache": "the Prefix Cache node's device / dtype",
    "step_cache": "the Step Cache node",
    "control": "the Apply Fun ControlNet node",
    "compile": "the Model Loader's compile",
    "devices": "the Model Loader's devices / parallel",
    "lora": "the LoRA node",
    "weights": "the Model Loader's weight_dtype",
    "plan": "the Model Loader's plan",
}


@dataclass(frozen=True)
class ModelOptions:
    """Everything that rides on one model copy; the defaults are a plain model as loaded with default inputs."""

    cache: CacheOptions = CacheOptions()  # the Prefix Cache node (prefix_cache/storage_choice.py)
    step_cache: StepCacheOptions | None = None  # the Step Cache node (sampling/step_cache.py); None: off
    control: str | None = None  # the Fun ControlNet applied (its file name); the stream is the copy's `control`
    compile: str = "off"  # transformer/compiled.py's COMPILE_MODES
    devices: tuple[str, ...] = ()  # the loader's devices: () runs the DiT in this process
    parallel: str = "off"  # parallel/split.py's PARALLEL_MODES
    loras: tuple[tuple[str, float], ...] = ()  # (name, strength) per LoRA node, in order
    weights: str = "default"  # the loader's weight_dtype (a GGUF file's compute dtype)
    plan: str = "auto"  # memory/planner.py's PLAN_CHOICES

    def __post_init__(self):
        for name, value, allowed in (("compile", self.compile, COMPILE_MODES), ("parallel", self.parallel,
                                     PARALLEL_MODES), ("weight_dtype", self.weights, WEIGHT_DTYPES),
                                     ("plan", self.plan, PLAN_CHOICES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}.")
        if not isinstance(self.cache, CacheOptions):
            raise ValueError(f"cache must be CacheOptions; got {type(self.cache).__name__}.")
        if self.step_cache is not None and not isinstance(self.step_cache, StepCacheOptions):
            raise ValueError(f"step_cache must be StepCacheOptions or None; got {type(self.step_cache).__name__}.")

    def active(self) -> tuple[str, ...]:
        """The features that are on, in `FEATURES` order."""
        on = {"cache": self.cache != CacheOptions(), "step_cache": self.step_cache is not None,
              "control": self.control is not None, "compile": self.compile != "off", "devices": bool(self.devices),
              "lora": bool(self.loras), "weights": self.weights != "default", "plan": self.plan != "auto"}
        return tuple(feature for feature in FEATURES if on[feature])

    @property
    def split(self) -> bool:
        """Whether the DiT runs in worker processes (the model is a `SplitModel` recipe)."""
        return bool(self.devices)


PLAIN = ModelOptions()

#: Which feature each field belongs to.
FIELDS = {"cache": "cache", "step_cache": "step_cache", "control": "control", "compile": "compile",
          "devices": "devices", "parallel": "devices", "loras": "lora", "weights": "weights", "plan": "plan"}


@dataclass(frozen=True)
class Supported:
    how: str  # why the two compose (what the pair test compares)


@dataclass(frozen=True)
class Refused:
    advice: str  # what to do instead


def _table() -> dict:
    refused = {
        ("devices", "cache"): Refused("the worker processes keep their head-sharded prefix cache on their own devices "
                                      "in the model's dtype. Remove the Prefix Cache node, or leave devices empty."),
        ("devices", "control"): Refused("the control stream does not run split over worker processes yet. Leave "
                                        "devices empty to use the ControlNet."),
        ("devices", "compile"): Refused("the worker processes run their blocks eagerly. Set compile off, or leave "
                                        "devices empty to compile in ComfyUI's process."),
        ("devices", "plan"): Refused("the memory plan places weights and cache in ComfyUI's process, while each "
                                     "worker holds the whole model on its own device. Set plan auto, or leave devices "
                                     "empty."),
    }
    supported = {
        ("devices", "step_cache"): "the ranks reduce the indicator over their group and decide together "
                                   "(parallel/agreement.py)",
        ("devices", "lora"): "the LoRA joins the workers' recipe; each rank applies it as this process does",
        ("devices", "weights"): "each worker loads the file with this weight_dtype",
        ("step_cache", "control"): "the skipped blocks' residual replays the control's skips",
        ("step_cache", "cache"): "the step cache reads the target rows only; the cache's storage is the prefix's",
        ("step_cache", "compile"): "the step cache works between blocks, outside the compiled block forward",
        ("step_cache", "lora"): "the LoRA is in the blocks; the step cache reads their outputs",
        ("step_cache", "weights"): "the step cache reads the blocks' outputs in fp32, whatever the weights",
        ("step_cache", "plan"): "a skipped step brings no streamed block in; the rest streams as planned",
        ("control", "cache"): "the control's prefix keys and values are more layers of the same cache",
        ("control", "compile"): "the control blocks run the model's compiled block forward",
        ("control", "lora"): "LoRAs change the base blocks; the control stream reads their rows",
        ("control", "weights"): "the control net keeps its own dtype and computes in the model's",
        ("control", "plan"): "the planner counts the control net's weights and cache layers",
        ("cache", "compile"): "a host-side cache runs its blocks eagerly; the compiled forward takes the rest",
        ("cache", "lora"): "the cache stores what the LoRA'd blocks computed",
        ("cache", "weights"): "the cache stores rows in the compute dtype or its own int8 / int4",
        ("cache", "plan"): "the planner places the cache where the Prefix Cache node says, or refuses the run",
        ("compile", "lora"): "a LoRA branch is part of the compiled block",
        ("compile", "weights"): "every weight format's layer runs inside the compiled block",
        ("compile", "plan"): "streaming hooks run around the compiled block forward",
        ("lora", "weights"): "a LoRA runs as a branch beside weights of any format",
        ("lora", "plan"): "a streamed block brings its LoRA branches with it",
        ("weights", "plan"): "the planner counts the weights' bytes in their format",
    }
    table = {frozenset(pair): verdict for pair, verdict in refused.items()}
    table.update({frozenset(pair): Supported(how) for pair, how in supported.items()})
    return table


PAIRS = _table()
_missing = [pair for pair in itertools.combinations(FEATURES, 2) if frozenset(pair) not in PAIRS]
if _missing or len(PAIRS) != len(FEATURES) * (len(FEATURES) - 1) // 2 or set(FIELDS) != {f.name for f in
                                                                                          fields(ModelOptions)}:
    raise ImportError(f"model/options.py: the table of pairs lacks {_missing} or FIELDS is not ModelOptions' fields")


def verdict(a: str, b: str):
    """The table's `Supported` or `Refused` for two features."""
    return PAIRS[frozenset((a, b))]


def pair_problem(record: ModelOptions) -> str | None:
    """The refusal for the first refused pair of features `record` has on, naming both; None when all compose."""
    for a, b in itertools.combinations(record.active(), 2):
        found = verdict(a, b)
        if isinstance(found, Refused):
            return f"{FEATURES[a]} and {FEATURES[b]} do not work together: {found.advice}"
    return None


def options_of(model) -> ModelOptions:
    """The record a model copy carries; `PLAIN` for a model no node has set one on (a split model made through the
    Python API without one: its devices)."""
    record = getattr(model, "options", None)
    if record is None and isinstance(model, SplitModel):
        return ModelOptions(devices=tuple(model.devices), parallel=model.mode)
    return record or PLAIN


def with_options(model, *, build=None, fresh: bool = False, **changes):
    """`model` with its record changed by `changes` (field names of `ModelOptions`), as a new model object: the
    record is checked against the table of pairs first, so a refused combination fails here, naming both features,
    before `build` does any work.

    `build(model)` applies a feature's mechanism and returns the new model copy (a LoRA, a ControlNet), or None when
    it only checks something; without a copy of its own the model is copied (sharing every weight). `fresh`: `model`
    is a new object only the caller holds (a loader's), so `build` may change it in place and it takes the record
    itself. A change that leaves the record as it was, without `build`, returns `model`.
    """
    unknown = sorted(set(changes) - {f.name for f in fields(ModelOptions)})
    if unknown:
        raise ValueError(f"unknown model option(s) {', '.join(unknown)}; the options are "
                         f"{', '.join(f.name for f in fields(ModelOptions))}.")
    step_cache = changes.get("step_cache")
    if step_cache is not None and step_cache.mode == "off":
        changes["step_cache"] = None  # off is no step cache: the model runs exactly as without one
    old = options_of(model)
    record = replace(old, **changes)
    problem = pair_problem(record)
    if problem is not None:
        raise ValueError(problem)
    if build is None and record == old and not fresh:
        return model
    new = build(model) if build is not None else None
    if new is None or new is model:
        new = model if fresh else _copy(model)
    if isinstance(new, SplitModel):
        return replace(new, options=record)
    new.options = record
    return new


def with_cache_options(model, device: str = "auto", dtype: str = "default"):
    """`with_options` for the Prefix Cache node: the storage is checked on the model (an int8 / int4 cache needs
    comfy-kitchen and a row width its layouts take), so a graph that cannot run it fails there, naming `dtype`."""
    options = CacheOptions(device, dtype)
    if options.dtype == "default":  # nothing to check: an unchanged record returns the model itself
        return with_options(model, cache=options)
    return with_options(model, cache=options, build=lambda new: check_cache_storage(new, options))


def _copy(model):
    """`model` as a new model object sharing every weight. The prefix cache is unaffected, so the copy keeps the
    model's kept prefixes (`cache_base`); the host's memory handle (ComfyUI's patcher) stays with the original."""
    if isinstance(model, SplitModel):
        return replace(model)
    new = clone_tree(model)
    new.manager = None
    new.cache_base = model
    return new
