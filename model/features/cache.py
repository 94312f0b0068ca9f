"""The Prefix Cache node's storage: where the prefix cache lives and how it stores its rows (model/prefix_cache/)."""

from ..prefix_cache.storage_choice import CacheOptions
from .plugin import Feature


def _check(record) -> None:
    if not isinstance(record.cache, CacheOptions):
        raise ValueError(f"cache must be CacheOptions; got {type(record.cache).__name__}.")


FEATURE = Feature(
    name="cache", label="the Prefix Cache node's device / dtype",
    fields={"cache": CacheOptions()},  # storage_choice.py: device auto / gpu / cpu / off, dtype default / int8 / int4
    is_on=lambda record: record.cache != CacheOptions(),
    check=_check,
)
