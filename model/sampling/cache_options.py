"""Where the prefix cache lives and how it stores its rows, chosen by the user with core's `QwenImage21Cache`
vocabulary, and carried by a model copy (as the LoRA and ControlNet copies carry theirs):

    device   auto (the memory planner's choice), gpu (on the compute device), cpu (pinned host memory, streamed in
             per layer), off (no cache: every step recomputes the prefix)
    dtype    default (the model's compute dtype), int8, int4 (quantized per token through comfy-kitchen;
             transformer/cache_storage.py)

The copy shares every weight with the model it was made from, and its kept caches are keyed by that model
(`cache_base`; the storage is part of the store key), so ComfyUI unloading the model drops them too.
"""

from dataclasses import dataclass

from ..loaders.lora import clone_tree
from ..transformer.cache_storage import CACHE_DEVICES, CACHE_DTYPES, cache_storage


@dataclass(frozen=True)
class CacheOptions:
    device: str = "auto"
    dtype: str = "default"

    def __post_init__(self):
        if self.device not in CACHE_DEVICES:
            raise ValueError(f"device must be one of {', '.join(CACHE_DEVICES)}; got {self.device!r}.")
        if self.dtype not in CACHE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(CACHE_DTYPES)}; got {self.dtype!r}.")


DEFAULT_OPTIONS = CacheOptions()


def cache_options(model) -> CacheOptions:
    """The options a model copy carries (the defaults for a plain model)."""
    return getattr(model, "cache_options", None) or DEFAULT_OPTIONS


def with_cache_options(model, device: str = "auto", dtype: str = "default"):
    """`model` with these cache options, as a new model object sharing every weight with it (which is never
    changed); the defaults return `model` itself. An int8 / int4 storage is checked here (comfy-kitchen importable,
    a row width its layouts take), so a graph that cannot run it fails at this node, naming `dtype`."""
    options = CacheOptions(device, dtype)
    storage = cache_storage(options.dtype, "dtype")
    if storage is not None:
        width = model.config.num_heads * model.config.head_dim
        try:
            storage.check_width(width)
        except ValueError as error:
            raise ValueError(f"dtype {dtype}: {error}") from None
    if options == DEFAULT_OPTIONS and cache_options(model) == DEFAULT_OPTIONS:
        return model
    return option_copy(model, cache_options=options)


def option_copy(model, **options):
    """`model` as a new model object sharing every weight, with `options` set as attributes (the Prefix Cache and
    Step Cache nodes' copies). The prefix cache is unaffected, so the copy keeps the model's kept prefixes
    (`cache_base`); the host's memory handle (ComfyUI's patcher) stays with the original object."""
    new = clone_tree(model)
    new.manager = None
    new.cache_base = model
    for name, value in options.items():
        setattr(new, name, value)
    return new
