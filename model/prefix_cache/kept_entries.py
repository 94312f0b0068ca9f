"""Prefix caches kept between runs (`keep_cache`), bounded by a memory budget, matched by content.

A later run with the same model finds here the longest leading run of its prefix that some kept cache holds
(`reuse`): the same prompt (another seed, size or batch size: the prefix never reads the target) reuses all of
it and skips the prefill; a new instruction after the same references reuses the rows up to the instruction and
computes only the rest. Matching compares content digests (`prefix_cache/leading_runs.py`), never object identity.

Kept caches may share tensors (a run that started from a kept cache reads that cache's rows in place), so the
store counts every tensor once, and a tensor is freed only when no kept cache and no run holds it any more.
Entries are evicted least-recently-used to stay inside the budget, dropped when their model is garbage-collected,
and cleared on request (ComfyUI's "free memory"). A run takes out the entries it reads while it samples: if it
fails or is interrupted they are dropped with it, never put back half-used; if it succeeds they go back beside
its own cache unless that cache now holds everything they offered.

The bound is the smaller of a fixed ceiling (`budget_bytes`; None: none) and what the memory planner says is free
beside the current run (`free_bytes`, set by the sampler nodes before each run from the memory plan); with neither,
`DEFAULT_BUDGET_BYTES`. The samplers' store (`KEPT_CACHES` in nodes/placement.py) has no fixed ceiling unless the user
sets one (ComfyUI's settings panel, read through nodes/bridge.py): on a large GPU it keeps more.

For monitoring (plain attributes, read without the lock): `evictions` counts the kept caches dropped least recently
used first to stay inside the bound, `evicted_bytes` what they held, `peak_bytes` the most the store held after any
change; `kept_bytes()` is what it holds now and `entries()` a snapshot of its entries, oldest first.
"""

import itertools
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass

from .layout import PrefixKVCache

DEFAULT_BUDGET_BYTES = 8 * 2**30  # ~16k prefix tokens of the full model in bf16 (0.5 MiB per token)


@dataclass
class KeptInfo:
    """What observability shows of a kept cache (`PrefixCacheStore.snapshot`): when its content was first kept
    (`time.monotonic()`), how many later runs read rows of it, and the report's `prefix_key` of the run that made it.
    A run's cache that covers an entry it read takes that entry's info over (the same content, kept on)."""

    since: float
    hits: int = 0
    prefix_key: str | None = None


def _info(cache) -> KeptInfo | None:
    return getattr(cache, "kept_info", None)


def _unique_bytes(caches) -> int:
    seen = {}
    for cache in caches:
        for tensor in cache.kv or ():
            seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def _covers(cache: PrefixKVCache, other: PrefixKVCache) -> bool:
    """Whether every prefix `other` holds is a leading run of one of `cache`'s (so `other` offers nothing more)."""
    return bool(other.runs) and all(any(mine.common_rows(theirs) == theirs.rows for mine in cache.runs)
                                    for theirs in other.runs)


class PrefixCacheStore:
    def __init__(self, budget_bytes: int | None = DEFAULT_BUDGET_BYTES):
        self.budget_bytes = None if budget_bytes is None else int(budget_bytes)
        self.free_bytes: int | None = None  # the memory planner's figure (set_free)
        self._entries: OrderedDict[int, tuple[tuple, PrefixKVCache]] = OrderedDict()  # id -> (model key, cache)
        self._ids = itertools.count()
        self._watched: set[int] = set()
        self._lock = threading.Lock()
        self.evictions = 0  # kept caches dropped (least recently used first) to stay inside the bound
        self.evicted_bytes = 0  # what they held (a tensor another entry still shares is counted with each)
        self.peak_bytes = 0  # the most the kept caches held after any change

    @staticmethod
    def key(model, *extra, dtype=None, storage: str = "default", identity: tuple = ()) -> tuple:
        """The model's identity and dtype, anything else that must match (`extra`: a Fun ControlNet's net and
        strength for a controlled prefix), and last what the model's features say a kept cache must match
        (`identity`: the options record's `kept_identity`, e.g. the LoRA set with each strength: another strength
        or another LoRA never reuses a prefix). The prefix itself is matched by content (`reuse`), not by
        key. A controlled copy is identified by the model it was applied to (`cache_owner`): a new control image
        reuses its prefix, and its steps outside the control's window share plain caches with that model's runs.
        A quantized cache (`storage` "int8" / "int4") adds its storage to the dtype ("torch.bfloat16/int8"): it is
        reused only by runs asking for the same storage."""
        stored = str(dtype) if storage == "default" else f"{dtype}/{storage}"
        return (id(cache_owner(model)), stored, *extra, tuple(identity))

    @property
    def limit_bytes(self) -> int:
        """The bound in force: the smaller of `budget_bytes` and `free_bytes` (DEFAULT_BUDGET_BYTES with neither)."""
        bounds = [b for b in (self.budget_bytes, self.free_bytes) if b is not None]
        return min(bounds) if bounds else DEFAULT_BUDGET_BYTES

    def set_budget(self, budget_bytes: int | None) -> None:
        """A new fixed ceiling (None: none, the planner's figure alone); evicts (LRU) down to it now."""
        with self._lock:
            self.budget_bytes = None if budget_bytes is None else max(0, int(budget_bytes))
            self._evict_to_limit()

    def set_free(self, free_bytes: int | None) -> None:
        """What the memory planner says kept caches may use beside the next run; evicts (LRU) down to it now."""
        with self._lock:
            self.free_bytes = None if free_bytes is None else max(0, int(free_bytes))
            self._evict_to_limit()

    def drop_where(self, predicate) -> None:
        """Free every kept cache for which `predicate(cache)` holds."""
        with self._lock:
            for entry in [e for e, (_, cache) in self._entries.items() if predicate(cache)]:
                self._entries.pop(entry)[1].free()

    def payloads(self) -> list:
        """The distinct tensors the kept caches hold (for memory accounting)."""
        seen = {}
        for _, cache in self._entries.values():
            for tensor in cache.kv or ():
                seen[id(tensor)] = tensor
        return list(seen.values())

    @property
    def nbytes(self) -> int:
        """Bytes the kept caches hold, each shared tensor counted once."""
        return _unique_bytes(cache for _, cache in self._entries.values())

    def kept_bytes(self) -> int:
        """Bytes the kept caches hold now (`nbytes`)."""
        return self.nbytes

    def entries(self) -> list[dict]:
        """A snapshot of the kept caches, least recently used first: each one's bytes, device, prefix count and
        rows. Plain values only: nothing here holds a cache."""
        with self._lock:
            return [{"bytes": cache.nbytes, "device": str(cache.device), "prefixes": len(cache.runs),
                     "rows": sum(run.rows for run in cache.runs)} for _, cache in self._entries.values()]

    def caches(self) -> list[PrefixKVCache]:
        return [cache for _, cache in self._entries.values()]

    def __len__(self) -> int:
        return len(self._entries)

    def reuse(self, model_key, runs, device, shares_rows: bool = True):
        """What a new run with prefixes of these `runs` can start from: `(taken, bases, whole)`.

        `bases[g]` is None or `("parts", parts, rows)` for `PrefixKVCache.plan`: the longest leading run of prefix g
        some kept cache of this model on `device` holds. The entries it reads are taken out (`taken`: hand them to
        `give_back` after a successful run, free them after a failed one). A cache kind that cannot share rows
        (`shares_rows` False, the host-side cache) reuses only a kept cache of exactly these prefixes, returned
        whole as `whole` (taken out too).
        """
        bases, taken, whole = [None] * len(runs), {}, None
        with self._lock:
            candidates = [(e, cache) for e, (key, cache) in self._entries.items()
                          if key == model_key and cache.filled and cache.runs]
            if not shares_rows:
                for entry, cache in candidates:
                    if type(cache).shares_rows is False and len(cache.runs) == len(runs) and all(
                            a.rows == b.rows == a.common_rows(b) for a, b in zip(runs, cache.runs)):
                        whole = self._entries.pop(entry)[1]
                        _count_hit(whole)
                        return [whole], bases, whole
                return [], bases, None
            for g, wanted in enumerate(runs):
                best = (0, None, None)
                for entry, cache in candidates:
                    if not cache.shares_rows or cache.device != device:
                        continue
                    for h, theirs in enumerate(cache.runs):
                        rows = wanted.common_rows(theirs)
                        if rows > best[0]:
                            best = (rows, entry, cache.parts[h])
                if best[1] is not None:
                    bases[g] = ("parts", best[2], best[0])
                    taken[best[1]] = None
            taken = [self._entries.pop(entry)[1] for entry in taken]
            for cache in taken:
                _count_hit(cache)
        return taken, bases, whole

    def give_back(self, model_key, taken, cache: PrefixKVCache, model, prefix_key: str | None = None) -> bool:
        """After a successful run: keep its `cache`, and put back the `taken` entries it does not cover. Returns
        whether the run's cache was kept (False: larger than the budget on its own; it is freed then).
        `prefix_key`: the run report's, shown by `snapshot`."""
        for old in taken:
            if old is not cache and not _covers(cache, old):
                self.put(model_key, old, model)
            elif old is not cache:
                _inherit(cache, old)
                old.free()
        return self.put(model_key, cache, model, prefix_key=prefix_key)

    def put(self, model_key, cache: PrefixKVCache, model, prefix_key: str | None = None) -> bool:
        """Keep `cache` (made by `model`, under its `key`), evicting the least recently used entries to fit the
        budget. Entries it covers are dropped (it offers all they did).

        Returns False (and frees the cache) when it alone exceeds the budget.
        """
        if _info(cache) is None:
            cache.kept_info = KeptInfo(since=time.monotonic())
        if prefix_key is not None and cache.kept_info.prefix_key is None:
            cache.kept_info.prefix_key = prefix_key
        with self._lock:
            if cache.nbytes > self.limit_bytes:
                cache.free()
                return False
            for entry in [e for e, (key, old) in self._entries.items()
                          if key == model_key and old is not cache and _covers(cache, old)]:
                old = self._entries.pop(entry)[1]
                _inherit(cache, old)
                old.free()
            for entry in [e for e, (_, old) in self._entries.items() if old is cache]:
                self._entries.pop(entry)
            self._entries[next(self._ids)] = (model_key, cache)
            self._evict_to_limit(keep=cache)
            self.peak_bytes = max(self.peak_bytes, self.nbytes)
            model = cache_owner(model)  # the identity in the key (`key`)
            if id(model) not in self._watched:
                self._watched.add(id(model))
                # the finaliser holds the store weakly: a model must not keep a discarded store alive
                weakref.finalize(model, _evict_from, weakref.ref(self), id(model))
            return True

    def _evict_to_limit(self, keep=None) -> None:
        while self._entries and self.nbytes > self.limit_bytes:
            entry = next(e for e, (_, cache) in self._entries.items() if cache is not keep or len(self._entries) == 1)
            cache = self._entries.pop(entry)[1]
            self.evictions += 1
            self.evicted_bytes += cache.nbytes
            cache.free()

    def evict_model(self, model_id: int) -> None:
        """Drop every entry made by the model with this id (it was unloaded)."""
        with self._lock:
            for entry in [e for e, (key, _) in self._entries.items() if key[0] == model_id]:
                self._entries.pop(entry)[1].free()
            self._watched.discard(model_id)

    def snapshot(self) -> dict:
        """A consistent, read-only view for observability (taken under the store's lock, so it may be read while a
        run samples): each kept entry (most recently used last) with its `prefix_key`, rows, bytes (a tensor
        shared by two entries is in both), device, dtype, age in seconds and hits, LoRAs, and whether it is a Fun
        ControlNet's controlled prefix; `bytes` (each tensor once), `limit_bytes`, and `evictions`."""
        now = time.monotonic()
        with self._lock:
            entries = []
            for key, cache in self._entries.values():
                info = _info(cache) or KeptInfo(since=now)
                kv = cache.kv or ()
                entries.append({
                    "prefix_key": info.prefix_key,
                    "rows": sum(run.rows for run in cache.runs or ()),
                    "bytes": int(cache.nbytes),
                    "device": None if cache.device is None else str(cache.device),
                    "dtype": str(kv[0].dtype).replace("torch.", "") if kv else None,
                    "age_seconds": round(now - info.since, 3),
                    "hits": info.hits,
                    "loras": [list(lora) for lora in dict(key[-1]).get("lora", ())],  # the record's kept identity
                    "controlled": len(key) > 3,
                })
            return {"entries": entries, "bytes": _unique_bytes(c for _, c in self._entries.values()),
                    "limit_bytes": self.limit_bytes, "evictions": self.evictions}

    def clear(self) -> None:
        with self._lock:
            for _, cache in self._entries.values():
                cache.free()
            self._entries.clear()


def _count_hit(cache) -> None:
    info = _info(cache)
    if info is not None:
        info.hits += 1


def _inherit(cache, old) -> None:
    """`cache` covers `old` (it holds every row `old` did): the kept content is older, and was read as often."""
    mine, theirs = _info(cache), _info(old)
    if theirs is None:
        return
    if mine is None:
        cache.kept_info = KeptInfo(since=theirs.since, hits=theirs.hits, prefix_key=theirs.prefix_key)
    else:
        mine.since, mine.hits = min(mine.since, theirs.since), max(mine.hits, theirs.hits)


def cache_owner(model):
    """The model whose identity keys its prefix caches: for a copy that shares its prefix rows with the model it was
    made from (`cache_base`: a copy that only changes options, whose storage is in the key; a Fun ControlNet copy,
    whose controlled prefix adds the control's key), that model's owner."""
    base = getattr(model, "cache_base", None)
    return model if base is None else cache_owner(base)


def _evict_from(store_ref, model_id: int) -> None:
    store = store_ref()
    if store is not None:
        store.evict_model(model_id)

