"""The prefix cache in host memory (pinned for a GPU), streamed to the compute device one layer ahead through the
same slot ring as weight streaming: for a run whose cache does not fit beside the weights."""

import weakref

import torch

from ..memory.slots import STREAM_SLOTS, SlotRing
from .layout import LayerKV, PrefixKVCache


class HostPrefixKVCache(PrefixKVCache):
    """A `PrefixKVCache` whose payload lives in host memory (pinned for a GPU) and is streamed in per layer.

    The prefill copies each layer's prefix keys and values out to the host as the block computes them; a cached
    step reads layer l from one of `STREAM_SLOTS` device slots, filled on a side stream while layer l - 1 ran
    (layer 0 of the next step is fetched while the last layer runs). `device` reports where the payload is (the
    host), and `to()` keeps it there: the store keeps it in host memory between runs.
    """

    shares_rows = False  # whole prefixes stream in per layer: no rows read from another prefix's tensor

    def __init__(self, device):
        super().__init__()
        self.compute_device = torch.device(device)
        self.copies = 0
        #: the cache layers in the order a step reads them (None: 0, 1, 2, ...); a control stream's layers sit
        #: between the base's (`ControlPatch.read_order`), so the slot ring fetches the one read next
        self.read_order: tuple[int, ...] | None = None
        self._slots = None
        self._ring = None
        self._written = {}

    def allocate(self, prefix_lens, layers: int, heads: int, head_dim: int, dtype, device) -> None:
        self.free()
        self._plan = None  # never planned (shares_rows is False): every prefix is computed whole
        self.compute_device = torch.device(device)
        self.prefix_lens = tuple(int(p) for p in prefix_lens)
        pin = self.compute_device.type == "cuda"
        self.kv = [self.new_payload(layers, p, heads, head_dim, dtype, "cpu", pin_memory=pin) for p in self.prefix_lens]
        self.compute_dtype, self._head_shape = dtype, (heads, head_dim)
        self.parts = tuple(((t, 0, p),) for t, p in zip(self.kv, self.prefix_lens))
        self.computed = tuple((g, 0, p) for g, p in enumerate(self.prefix_lens))

    def layer_kv(self, layer: int) -> "HostLayerKV":
        return HostLayerKV(self, layer)

    def to(self, device) -> "HostPrefixKVCache":
        return self  # the payload stays in host memory; reads stream it to the compute device

    def free(self) -> None:
        self.release_device()
        super().free()

    def release_device(self) -> None:
        """Drop the device slots (the run is over); the host payload stays."""
        if self._ring is not None:
            self._ring.drain()
        self._slots = self._ring = None
        self._written = {}

    @property
    def layers(self) -> int:
        return self.kv[0].shape[0]

    def _store(self, group: int, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        entry = self.kv[group][layer]
        pinned = entry.is_pinned()
        if self.storage is not None:  # quantized on the device; only the quantized bytes cross to the host
            key, value = self._quantized(key, value)
        entry[0].copy_(key, non_blocking=pinned)
        entry[1].copy_(value, non_blocking=pinned)
        if self.compute_device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.compute_device))
            self._written[layer] = event
        if self._ring is not None:  # a slot holding this layer is stale now
            self._ring.forget(layer)

    def _quantized(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Keys and values `(rows, heads, head_dim)` as stored rows on the compute device; the rows are replaced by
        their dequantized values, which the prefill then attends over (as a device-side quantized cache does)."""
        stored = torch.empty(2, key.shape[0], *self.row_shape(*key.shape[1:]), dtype=torch.uint8, device=key.device)
        for index, rows in enumerate((key, value)):
            self.storage.encode(rows.reshape(rows.shape[0], -1), stored[index])
            rows.copy_(self.storage.decode(stored[index], rows[0].numel(), rows.dtype).view(rows.shape))
        return stored[0], stored[1]

    def _slot_copies(self, layer: int, slot: int):
        self.copies += 1
        return [(self._slots[slot][g], self.kv[g][layer]) for g in range(len(self.kv))]

    def _read(self, layer: int) -> list[torch.Tensor]:
        """Layer `layer`'s keys and values of every prefix on the compute device; starts fetching the next layer."""
        if self._slots is None:
            _WITH_SLOTS.add(self)
            self._ring = SlotRing(STREAM_SLOTS, self.compute_device, self._slot_copies,
                                  after=lambda layer: self._written.get(layer))
            self._slots = [[torch.empty(t.shape[1:], dtype=t.dtype, device=self.compute_device) for t in self.kv]
                           for _ in range(STREAM_SLOTS)]
        slot = self._ring.acquire(layer, following=self._read_after(layer))
        return self._slots[slot]

    def _read_after(self, layer: int) -> int:
        order = self.read_order
        if not order or layer not in order:
            return (layer + 1) % self.layers
        return order[(order.index(layer) + 1) % len(order)]


class HostLayerKV(LayerKV):
    """One layer of a `HostPrefixKVCache`: `store` copies out to the host, `read` returns device tensors. Unlike the
    device cache's views it keeps the layer number: a read goes through the slot ring, which fetches by layer (a
    block reading it runs uncompiled, `LayerKV.compilable`)."""

    __slots__ = ("cache", "layer")
    compilable = False

    def __init__(self, cache: HostPrefixKVCache, layer: int):
        self.cache, self.layer = cache, layer

    def store(self, group: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self.cache._store(group, self.layer, key, value)

    def read(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read_parts(group)[0]

    def read_parts(self, group: int, rows: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        entry = self.cache._read(self.layer)[group]
        key, value = (entry[0], entry[1]) if rows is None else (entry[0, :rows], entry[1, :rows])
        return [(key, value) if self.cache.storage is None else self.cache.decoded(key, value)]



#: Host caches holding device slots right now (released when their run ends, also when a kept one was reused).
_WITH_SLOTS: "weakref.WeakSet[HostPrefixKVCache]" = weakref.WeakSet()



def release_cache_slots() -> None:
    """Drop the device slots of every host-side cache (their payloads stay in host memory)."""
    for cache in list(_WITH_SLOTS):
        cache.release_device()
        _WITH_SLOTS.discard(cache)
