"""Prefix caches kept between runs (`keep_cache`), bounded by a memory budget.

A second run with the same model and the same conditioning (another seed, another size, another batch size:
the prefix never reads the target) finds its cache here and skips the prefill entirely. Entries are keyed by
the model's identity and the conditioning's content, evicted least-recently-used to stay inside the budget,
dropped when their model is garbage-collected, and cleared on request (ComfyUI's "free memory").

The bound is the smaller of a fixed ceiling (`budget_bytes`; None: none) and what the memory planner says is free
beside the current run (`free_bytes`, set by the sampler nodes before each run from the memory plan); with neither,
`DEFAULT_BUDGET_BYTES`. The samplers' store (`KEPT_CACHES` in nodes/placement.py) has no fixed ceiling: on a large
GPU it keeps more.
"""

import threading
import weakref
from collections import OrderedDict

from ..transformer.prefix_cache import PrefixKVCache

DEFAULT_BUDGET_BYTES = 8 * 2**30  # ~16k prefix tokens of the full model in bf16 (0.5 MiB per token)


class PrefixCacheStore:
    def __init__(self, budget_bytes: int | None = DEFAULT_BUDGET_BYTES):
        self.budget_bytes = None if budget_bytes is None else int(budget_bytes)
        self.free_bytes: int | None = None  # the memory planner's figure (set_free)
        self._entries: OrderedDict[tuple, PrefixKVCache] = OrderedDict()
        self._watched: set[int] = set()
        self._lock = threading.Lock()

    @staticmethod
    def key(model, *fingerprints, dtype=None) -> tuple:
        """The model's identity and dtype, the conditioning's fingerprints, and last the model's LoRA set (name and
        strength of each: another strength or another LoRA never reuses a prefix)."""
        loras = tuple((lora.name, lora.strength) for lora in getattr(model, "loras", ()))
        return (id(model), str(dtype), *fingerprints, loras)

    @property
    def limit_bytes(self) -> int:
        """The bound in force: the smaller of `budget_bytes` and `free_bytes` (DEFAULT_BUDGET_BYTES with neither)."""
        bounds = [b for b in (self.budget_bytes, self.free_bytes) if b is not None]
        return min(bounds) if bounds else DEFAULT_BUDGET_BYTES

    def set_free(self, free_bytes: int | None) -> None:
        """What the memory planner says kept caches may use beside the next run; evicts (LRU) down to it now."""
        with self._lock:
            self.free_bytes = None if free_bytes is None else max(0, int(free_bytes))
            while self._entries and self.nbytes > self.limit_bytes:
                self._entries.popitem(last=False)[1].free()

    def drop_where(self, predicate) -> None:
        """Free every kept cache for which `predicate(cache)` holds."""
        with self._lock:
            for key in [k for k, cache in self._entries.items() if predicate(cache)]:
                self._entries.pop(key).free()

    def payloads(self) -> list:
        """The tensors the kept caches hold (for memory accounting)."""
        return [t for cache in self._entries.values() for t in (cache.kv or ())]

    @property
    def nbytes(self) -> int:
        return sum(cache.nbytes for cache in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, key) -> PrefixKVCache | None:
        """Remove and return the entry for `key` (the run owns it while it samples), or None."""
        with self._lock:
            return self._entries.pop(key, None)

    def put(self, key, cache: PrefixKVCache, model) -> bool:
        """Keep `cache` under `key`, evicting the least recently used entries to fit the budget.

        Returns False (and frees the cache) when it alone exceeds the budget.
        """
        with self._lock:
            if cache.nbytes > self.limit_bytes:
                cache.free()
                return False
            self._entries.pop(key, None)
            self._entries[key] = cache
            while self.nbytes > self.limit_bytes:
                _, evicted = self._entries.popitem(last=False)
                evicted.free()
            if id(model) not in self._watched:
                self._watched.add(id(model))
                # the finaliser holds the store weakly: a model must not keep a discarded store alive
                weakref.finalize(model, _evict_from, weakref.ref(self), id(model))
            return True

    def evict_model(self, model_id: int) -> None:
        """Drop every entry made by the model with this id (it was unloaded)."""
        with self._lock:
            for key in [k for k in self._entries if k[0] == model_id]:
                self._entries.pop(key).free()
            self._watched.discard(model_id)

    def clear(self) -> None:
        with self._lock:
            for cache in self._entries.values():
                cache.free()
            self._entries.clear()


def _evict_from(store_ref, model_id: int) -> None:
    store = store_ref()
    if store is not None:
        store.evict_model(model_id)

