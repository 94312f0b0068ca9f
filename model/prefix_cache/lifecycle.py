"""The prefix caches of one sampling run: planned from the store, filled, read, and at the end kept or freed.

A plain run has one cache. A run with a Fun ControlNet (transformer/controlnet.py) has one per *phase*: the
steps inside the control's window read a controlled cache (the base blocks' prefix K/V with the control's skips
applied, and the control blocks' own prefix K/V as more layers of the same cache), the steps outside it a plain
cache, which is the one an uncontrolled run of the same model makes and may share with it through the store.
Each is planned on its first use (the longest leading runs kept in the store, or shared by the run's prompts) and,
without `keep_cache`, freed right after its last step: a partial window holds both only while both are in use.
"""

from .kept_entries import PrefixCacheStore
from .layout import PrefixKVCache


def share_leading_runs(runs, bases) -> list:
    """`bases` (what each prefix may start from, for `PrefixKVCache.plan`) with the leading runs the prefixes of
    one run share among themselves: prefix g starts from an earlier prefix h of the batch when h shares more of
    its leading rows than any kept cache offers (CFG's two prompts after the same references, say)."""
    bases = list(bases)
    for g, wanted in enumerate(runs):
        best = bases[g][2] if bases[g] is not None else 0
        for h in range(g):
            rows = wanted.common_rows(runs[h])
            if rows > best:
                best, bases[g] = rows, ("group", h, rows)
    return bases


class PhaseCache:
    """One cache of the run: `cache`, the store entries it read (`taken`), whether it started from the store
    (`from_store`) or was complete before its first step (`hit`), its store key, and what it held at most."""

    def __init__(self, cache: PrefixKVCache, taken, from_store: bool, key, layers: int, base_layers: int):
        self.cache, self.taken, self.from_store, self.key = cache, taken, from_store, key
        self.hit = cache.filled
        self.layers, self.base_layers = layers, base_layers
        self.nbytes, self.device, self.computed_rows = 0, None, 0

    def note(self) -> None:
        """Record its bytes and rows while it is filled (before it is freed or handed to the store)."""
        cache = self.cache
        if cache is None or not cache.filled:
            return
        self.nbytes = max(self.nbytes, cache.nbytes)
        self.device = str(cache.device)
        if not self.hit:
            self.computed_rows = sum(end - start for _, start, end in cache.computed)

    @property
    def stream_bytes(self) -> tuple[int, int]:
        """(bytes of the base blocks' layers, bytes of the control's): every payload tensor has one row per layer."""
        base = self.nbytes * self.base_layers // self.layers
        return base, self.nbytes - base


class RunCaches:
    """The run's caches by phase (False: plain; True: with the control). `get(phase)` plans on first use."""

    def __init__(self, model, prefixes, runs, *, store: PrefixCacheStore | None, keep_cache: bool, new_cache,
                 device, dtype, storage=None, prefix_key: str | None = None, identity: tuple = (), phased=None):
        self.model, self.prefixes, self.runs, self.prefix_key = model, prefixes, runs, prefix_key
        self.identity = identity  # what the model's features say a kept cache must match (the record's)
        self.storage = storage  # None (the compute dtype) or a cache_storage.QuantizedRows
        self.store, self.keep_cache, self.new_cache = store, keep_cache, new_cache or PrefixKVCache
        self.compute_device, self.dtype = device, dtype
        # what the phase's cache adds to the plain one (a `RunPart.phase_cache()`: a Fun ControlNet's `ControlPatch`)
        self.phased = phased
        self.phases: dict[bool, PhaseCache] = {}

    def layers(self, in_phase: bool) -> int:
        extra = self.phased.extra_layers if in_phase else 0
        return self.model.config.num_layers + extra

    def get(self, in_phase: bool) -> PhaseCache:
        if in_phase not in self.phases:
            self.phases[in_phase] = self._plan(in_phase)
        return self.phases[in_phase]

    def mode(self, in_phase: bool) -> str:
        """"cached" once the phase's cache holds every prefix row, else "prefill" (its first step)."""
        return "cached" if self.get(in_phase).cache.filled else "prefill"

    def _plan(self, in_phase: bool) -> PhaseCache:
        """The phase's cache, planned: its prefixes start from the longest leading runs kept in the store (with
        `keep_cache`) or shared with another prefix of the run; filled already when nothing is left to compute."""
        model, runs = self.model, self.runs
        extra = (self.phased.cache_key,) if in_phase else ()
        key = PrefixCacheStore.key(model, *extra, dtype=self.dtype, storage=self.storage_name, identity=self.identity)
        layers = self.layers(in_phase)
        cache = self.new_cache()
        cache.storage = self.storage
        if in_phase and hasattr(cache, "read_order"):  # a host-side cache fetches the layer read next
            cache.read_order = self.phased.read_order(model.config.num_layers)
        bases, taken = [None] * len(runs), []
        if self.keep_cache:
            taken, bases, whole = self.store.reuse(key, runs, self.compute_device, cache.shares_rows)
            if whole is not None:  # a kept cache of exactly these prefixes, of a kind that shares no rows
                return PhaseCache(whole, taken, True, key, layers, model.config.num_layers)
        lens = [p.layout.prefix_len for p in self.prefixes]
        from_store = False
        if cache.shares_rows:
            bases = share_leading_runs(runs, bases)
            from_store = any(base is not None and base[0] == "parts" for base in bases)
            cache.plan(lens, bases)
            if cache.planned_rows == 0:  # every row is held already: no prefill at all
                config = model.config
                cache.allocate(lens, layers, config.num_heads, config.head_dim, model.compute_dtype,
                               self.compute_device)
        cache.runs = tuple(runs)
        return PhaseCache(cache, taken, from_store, key, layers, model.config.num_layers)

    def done_with(self, in_phase: bool) -> None:
        """The phase's last step ran: without `keep_cache` nothing reads its cache again, so free it now."""
        phase = self.phases.get(in_phase)
        if phase is not None and not self.keep_cache:
            phase.note()
            phase.cache.free()

    def close(self, succeeded: bool, notes: list) -> None:
        """After the run (success, error or interrupt): hand each cache to the store (`keep_cache`) or free it;
        entries a failed run read are dropped, never put back half-used."""
        for phase in self.phases.values():
            phase.note()
            kept = succeeded and self.keep_cache and self.store.give_back(phase.key, phase.taken, phase.cache,
                                                                          self.model, prefix_key=self.prefix_key)
            if not kept:
                phase.cache.free()
                if not succeeded:
                    for entry in phase.taken:
                        entry.free()
            note = "cache not kept: larger than the store's budget"
            if succeeded and self.keep_cache and not kept and note not in notes:
                notes.append(note)
            phase.cache, phase.taken = None, ()

    # -- report -------------------------------------------------------------------------------------------------
    def state(self) -> str:
        """"hit" when every cache was complete before its first step, "partial" when one started from the store."""
        phases = self.phases.values()
        if phases and all(p.hit for p in phases):
            return "hit"
        return "partial" if any(p.from_store for p in phases) else "miss"

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.phases.values())

    @property
    def storage_name(self) -> str:
        """The report's `cache_dtype`: "default" or "int8" / "int4"."""
        return "default" if self.storage is None else self.storage.name

    @property
    def device(self) -> str | None:
        return next((p.device for p in self.phases.values() if p.device is not None), None)

    @property
    def computed_rows(self) -> int:
        return sum(p.computed_rows for p in self.phases.values())

    @property
    def held_rows(self) -> int:
        """Prefix rows the run's caches hold together (each phase holds every prefix row)."""
        return len(self.phases) * sum(p.layout.prefix_len for p in self.prefixes)

    def stream_bytes(self) -> dict:
        """Cache bytes per stream for the control report: `base` and `control` of the controlled cache, and
        `base_uncontrolled` for the plain one of the steps outside the window."""
        out = {}
        if True in self.phases:
            out["base"], out["control"] = self.phases[True].stream_bytes
        if False in self.phases:
            out["base_uncontrolled"] = self.phases[False].nbytes
        return out
