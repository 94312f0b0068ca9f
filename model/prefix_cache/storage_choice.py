"""Where the prefix cache lives and how it stores its rows, chosen by the user with core's `QwenImage21Cache`
vocabulary, and carried by a model copy in its options record (model/options.py), as the step cache, the LoRA and
the ControlNet ride on theirs:

    device   auto (the memory planner's choice), gpu (on the compute device), cpu (pinned host memory, streamed in
             per layer), off (no cache: every step recomputes the prefix)
    dtype    default (the model's compute dtype), int8, int4 (quantized per token through comfy-kitchen;
             prefix_cache/storage_formats.py)

The copy shares every weight with the model it was made from, and its kept caches are keyed by that model
(`cache_base`; the storage is part of the store key), so ComfyUI unloading the model drops them too.
"""

from dataclasses import dataclass

from .storage_formats import CACHE_DEVICES, CACHE_DTYPES, cache_storage


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


def check_cache_storage(model, options: CacheOptions) -> None:
    """An int8 / int4 storage is checked when the option is set (comfy-kitchen importable, a row width its layouts
    take), so a graph that cannot run it fails at the Prefix Cache node, naming `dtype`."""
    storage = cache_storage(options.dtype, "dtype")
    if storage is not None:
        width = model.config.num_heads * model.config.head_dim
        try:
            storage.check_width(width)
        except ValueError as error:
            raise ValueError(f"dtype {options.dtype}: {error}") from None
