"""Weight streaming and the host-side prefix cache: a model larger than the device runs with some of its layers in
(pinned) host memory, each copied into a device slot just before it runs, and the prefix cache can live in host
memory too, copied in one layer ahead.

    place_layers(root, layers, streamed, device)   everything on the device but the streamed layers, which go to
                                                   host memory (pinned when the device is a GPU)
    LayerStreamer(layers, streamed, device)        forward pre-/post-hooks on the streamed layers: before layer i
                                                   runs its weights are in a device slot (the copy was started
                                                   one streamed layer earlier, on a side CUDA stream, overlapping
                                                   the compute in between); after it, the layer points at its host
                                                   tensors again
    HostPrefixKVCache(device)                      a PrefixKVCache whose payload stays in host memory: the prefill
                                                   copies each layer's keys and values out, a cached step reads
                                                   layer l from a device slot filled while layer l - 1 ran

Two slots of the largest streamed layer's size hold the layers in flight (the one running and the next), so a
streamed model needs `resident layers + 2 slots` of device memory for weights whatever N is. While the layer in
slot A runs, slot B is refilled only after the compute that last read B is done (a CUDA event recorded on the
compute stream), and the compute waits for B's copy (an event recorded on the side stream) before reading it.

The hooks swap tensors in the running module's own `_parameters` / `_buffers` entries and put the host ones back
afterwards; the Parameter objects themselves are never changed while a forward runs, so a LoRA copy of the model
(model/lora.py: new module objects sharing the Parameters) is not affected by a streamer attached to the original.
On a CPU the same code runs with the device equal to the host (copies are synchronous): that is how the tests show
that a streamed run gives bit-identical latents to a resident one. Numerics are untouched: a copy is exact.
"""

import weakref

import torch
from torch import nn

from .planner import SLOT_ALIGN, slot_layout
from .prefix_cache import LayerKV, PrefixKVCache


def _host_copy(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """`tensor` in host memory (contiguous; pinned when `pin`), the same object when it already is."""
    if tensor.device.type == "cpu" and tensor.is_contiguous() and (not pin or tensor.is_pinned()):
        return tensor
    if pin:  # straight into page-locked memory: one copy, not a pageable one and then a pinned one
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True).copy_(tensor.detach())
    return tensor.detach().to("cpu").contiguous()


def _own_tensors(module: nn.Module):
    """(module, kind, name) of every parameter and buffer of `module` and its submodules."""
    for sub in module.modules():
        for name, tensor in sub._parameters.items():
            if tensor is not None:
                yield sub, "param", name
        for name, tensor in sub._buffers.items():
            if tensor is not None:
                yield sub, "buffer", name


def _move(sub: nn.Module, kind: str, name: str, fn) -> None:
    if kind == "param":
        param = sub._parameters[name]
        moved = fn(param.data)
        if moved is not param.data:
            param.data = moved  # the Parameter object stays: shared by LoRA copies, held by ComfyUI's patcher
    else:
        sub._buffers[name] = fn(sub._buffers[name])


def place_layers(root: nn.Module, layers, streamed, device, pin: bool | None = None) -> None:
    """Put `root` on `device` except the layers `layers[i]` for i in `streamed`, which go to host memory (pinned
    when `device` is a GPU, unless `pin` says otherwise): what a streamed run expects before it starts."""
    device = torch.device(device)
    pin = device.type == "cuda" if pin is None else pin
    streamed_modules = {id(layers[i]) for i in streamed}
    on_host = {id(sub) for layer in layers if id(layer) in streamed_modules for sub in layer.modules()}
    for sub in root.modules():
        host = id(sub) in on_host
        for kind, entries in (("param", sub._parameters), ("buffer", sub._buffers)):
            for name, tensor in list(entries.items()):
                if tensor is None or tensor.is_meta:
                    continue
                if host:
                    _move(sub, kind, name, lambda t: _host_copy(t, pin))
                elif tensor.device != device:
                    _move(sub, kind, name, lambda t: t.to(device))


def resident_part(root: nn.Module, layers, streamed) -> nn.Module:
    """A container of every subtree of `root` that holds no streamed layer (the resident weights): the module a
    host's memory manager (ComfyUI) loads and unloads, while the streamed layers stay with the streamer."""
    streamed_ids = {id(layers[i]) for i in streamed}
    holds = {}

    def contains(module) -> bool:
        if id(module) not in holds:
            holds[id(module)] = id(module) in streamed_ids or any(contains(c) for c in module.children())
        return holds[id(module)]

    parts = []

    def collect(module):
        if id(module) in streamed_ids:
            return
        if not contains(module):
            parts.append(module)
            return
        for child in module.children():
            collect(child)

    collect(root)
    return nn.ModuleList(parts)


class _Copier:
    """Copies into device slots: on a side CUDA stream ordered by events, or synchronously elsewhere."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def now(self):
        """An event at the compute stream's current position (None off CUDA)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy(self, pairs, after=()):
        """`dst.copy_(src)` for each pair once every event in `after` has passed; returns the 'done' event."""
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return None
        with torch.cuda.stream(self.stream):
            for event in after:
                if event is not None:
                    self.stream.wait_event(event)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def drain(self) -> None:
        """Let the compute stream (and so the allocator's reuse of anything freed after this) follow every copy."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


class _Ring:
    """Two (or more) slots cycling through a sequence of items: which item each holds and when its copy is done."""

    def __init__(self, count: int):
        self.owner = [None] * count
        self.ready = [None] * count
        self.used = [0] * count
        self.clock = 0

    def find(self, item):
        return self.owner.index(item) if item in self.owner else None

    def victim(self, keep) -> int:
        """A slot to refill: an empty one, else the least recently used one that is not `keep`."""
        choices = [s for s in range(len(self.owner)) if s != keep]
        return min(choices, key=lambda s: (self.owner[s] is not None, self.used[s]))

    def touch(self, slot: int) -> None:
        self.clock += 1
        self.used[slot] = self.clock


class LayerStreamer:
    """Streams the weights of `layers[i]`, i in `streamed`, through two device slots while the model runs.

    Use as a context manager around the forward passes (one sampling run): entering allocates the slots and hooks
    the streamed layers; leaving puts every layer back on its host tensors, waits for the copies in flight and
    frees the slots. The layers must already be in host memory (`place_layers`).
    """

    def __init__(self, layers, streamed, device, slots: int = 2):
        self.layers = list(layers)
        self.streamed = tuple(sorted(set(int(i) for i in streamed)))
        if any(not 0 <= i < len(self.layers) for i in self.streamed):
            raise ValueError(f"streamed layers {self.streamed} outside 0..{len(self.layers) - 1}.")
        self.device = torch.device(device)
        self.slot_count = max(1, min(slots, len(self.streamed)))
        self.copies = 0  # layer copies issued (tests and benchmarks read it)
        self._handles = []
        self._swapped: dict[int, list] = {}
        self._entries: dict[int, list] = {}
        self._buffers = None
        self._copier = None
        self._ring = None

    # -- lifetime ----------------------------------------------------------------------------------------------
    def __enter__(self) -> "LayerStreamer":
        if not self.streamed:
            return self
        self._entries = {}
        for i in self.streamed:
            entries = list(_own_tensors(self.layers[i]))
            tensors = [_get(sub, kind, name) for sub, kind, name in entries]
            offsets, _ = slot_layout(tensors)
            self._entries[i] = [(*entry, t, off) for entry, t, off in zip(entries, tensors, offsets)]
        size = max(slot_layout([e[3] for e in entries])[1] for entries in self._entries.values())
        self._copier = _Copier(self.device)
        self._ring = _Ring(self.slot_count)
        self._buffers = [torch.empty(max(size, SLOT_ALIGN), dtype=torch.uint8, device=self.device)
                         for _ in range(self.slot_count)]
        for i in self.streamed:
            layer = self.layers[i]
            self._handles.append(layer.register_forward_pre_hook(self._pre_hook(i, layer)))
            self._handles.append(layer.register_forward_hook(self._post_hook(i, layer), always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for i in list(self._swapped):
            self._restore(i)
        if self._copier is not None:
            self._copier.drain()
        self._buffers = self._copier = self._ring = None
        self._entries = {}

    # -- hooks -------------------------------------------------------------------------------------------------
    def _pre_hook(self, index: int, layer: nn.Module):
        def hook(module, args):
            if module is layer:  # a copy of the module tree (LoRA) inherits the hook dicts: not ours to stream
                self._bring(index)

        return hook

    def _post_hook(self, index: int, layer: nn.Module):
        def hook(module, args, output):
            if module is layer:
                self._restore(index)

        return hook

    def _next_after(self, index: int) -> int:
        position = self.streamed.index(index)
        return self.streamed[(position + 1) % len(self.streamed)]

    def _fetch(self, index: int, keep) -> int:
        ring, copier = self._ring, self._copier
        slot = ring.victim(keep)
        buffer = self._buffers[slot]
        pairs = [(_view(buffer, t, off), t) for _, _, _, t, off in self._entries[index]]
        # the slot's previous layer was read by compute enqueued before now: the copy waits for that to finish
        ring.ready[slot] = copier.copy(pairs, after=(copier.now(),))
        ring.owner[slot] = index
        ring.touch(slot)
        self.copies += 1
        return slot

    def _bring(self, index: int) -> None:
        ring = self._ring
        slot = ring.find(index)
        if slot is None:
            slot = self._fetch(index, keep=None)
        ring.touch(slot)
        self._copier.wait(ring.ready[slot])
        buffer = self._buffers[slot]
        swapped = []
        for sub, kind, name, host, off in self._entries[index]:
            view = _view(buffer, host, off)
            if kind == "param":
                original = sub._parameters[name]
                sub._parameters[name] = nn.Parameter(view, requires_grad=False)
            else:
                original = sub._buffers[name]
                sub._buffers[name] = view
            swapped.append((sub, kind, name, original))
        self._swapped[index] = swapped
        following = self._next_after(index)
        if following != index and ring.find(following) is None:
            self._fetch(following, keep=slot)

    def _restore(self, index: int) -> None:
        for sub, kind, name, original in self._swapped.pop(index, ()):
            (sub._parameters if kind == "param" else sub._buffers)[name] = original


def _get(sub: nn.Module, kind: str, name: str) -> torch.Tensor:
    return sub._parameters[name] if kind == "param" else sub._buffers[name]


def _view(buffer: torch.Tensor, like: torch.Tensor, offset: int) -> torch.Tensor:
    """`like`'s shape and dtype over `buffer[offset:]` (a byte buffer)."""
    nbytes = like.numel() * like.element_size()
    return buffer[offset : offset + nbytes].view(like.dtype).view(like.shape)


# -- the prefix cache in host memory ---------------------------------------------------------------------------------
class HostPrefixKVCache(PrefixKVCache):
    """A `PrefixKVCache` whose payload lives in host memory (pinned for a GPU) and is streamed in per layer.

    The prefill copies each layer's prefix keys and values out to the host as the block computes them; a cached
    step reads layer l from one of two device slots, filled on a side stream while layer l - 1 ran (layer 0 of the
    next step is fetched while the last layer runs). `device` reports where the payload is (the host), and
    `to()` keeps it there: the store keeps it in host memory between runs.
    """

    def __init__(self, device):
        super().__init__()
        self.compute_device = torch.device(device)
        self.copies = 0
        self._slots = None
        self._ring = None
        self._copier = None
        self._written = {}

    def allocate(self, prefix_lens, layers: int, heads: int, head_dim: int, dtype, device) -> None:
        self.free()
        self.compute_device = torch.device(device)
        self.prefix_lens = tuple(int(p) for p in prefix_lens)
        pin = self.compute_device.type == "cuda"
        self.kv = [torch.empty(layers, 2, p, heads, head_dim, dtype=dtype, device="cpu", pin_memory=pin)
                   for p in self.prefix_lens]

    def layer_kv(self, layer: int) -> "HostLayerKV":
        return HostLayerKV(self, layer)

    def to(self, device) -> "HostPrefixKVCache":
        return self  # the payload stays in host memory; reads stream it to the compute device

    def free(self) -> None:
        self.release_device()
        super().free()

    def release_device(self) -> None:
        """Drop the device slots (the run is over); the host payload stays."""
        if self._copier is not None:
            self._copier.drain()
        self._slots = self._ring = self._copier = None
        self._written = {}

    @property
    def layers(self) -> int:
        return self.kv[0].shape[0]

    def _store(self, group: int, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        entry = self.kv[group][layer]
        pinned = entry.is_pinned()
        entry[0].copy_(key, non_blocking=pinned)
        entry[1].copy_(value, non_blocking=pinned)
        if self.compute_device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.compute_device))
            self._written[layer] = event
        if self._ring is not None and layer in self._ring.owner:  # a slot holding this layer is stale now
            self._ring.owner[self._ring.owner.index(layer)] = None

    def _fetch(self, layer: int, keep) -> int:
        ring, copier = self._ring, self._copier
        slot = ring.victim(keep)
        pairs = [(self._slots[slot][g], self.kv[g][layer]) for g in range(len(self.kv))]
        ring.ready[slot] = copier.copy(pairs, after=(copier.now(), self._written.get(layer)))
        ring.owner[slot] = layer
        ring.touch(slot)
        self.copies += 1
        return slot

    def _read(self, layer: int) -> list[torch.Tensor]:
        """Layer `layer`'s keys and values of every prefix on the compute device; starts fetching the next layer."""
        if self._slots is None:
            _WITH_SLOTS.add(self)
            self._copier = _Copier(self.compute_device)
            self._ring = _Ring(2)
            self._slots = [[torch.empty(t.shape[1:], dtype=t.dtype, device=self.compute_device) for t in self.kv]
                           for _ in range(2)]
        ring = self._ring
        slot = ring.find(layer)
        if slot is None:
            slot = self._fetch(layer, keep=None)
        ring.touch(slot)
        self._copier.wait(ring.ready[slot])
        following = (layer + 1) % self.layers
        if following != layer and ring.find(following) is None:
            self._fetch(following, keep=slot)
        return self._slots[slot]


class HostLayerKV(LayerKV):
    """One layer of a `HostPrefixKVCache`: `store` copies out to the host, `read` returns device tensors."""

    __slots__ = ()

    def store(self, group: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self.cache._store(group, self.layer, key, value)

    def read(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self.cache._read(self.layer)[group]
        return entry[0], entry[1]


#: Host caches holding device slots right now (released when their run ends, also when a kept one was reused).
_WITH_SLOTS: "weakref.WeakSet[HostPrefixKVCache]" = weakref.WeakSet()


def release_cache_slots() -> None:
    """Drop the device slots of every host-side cache (their payloads stay in host memory)."""
    for cache in list(_WITH_SLOTS):
        cache.release_device()
        _WITH_SLOTS.discard(cache)


class StreamedRun:
    """One sampling run under a plan: streams the DiT blocks in `streamed` (already placed with `place_layers`) and
    makes the prefix caches ("device": a plain `PrefixKVCache`; "host": a `HostPrefixKVCache`).

    `with StreamedRun(model, streamed, cache, device) as run: sample(..., new_cache=run.new_cache)`; leaving it puts
    every block back on its host tensors and frees the slots, also after an error or an interrupt.
    """

    def __init__(self, model: nn.Module, streamed=(), cache: str = "device", device=None):
        self.model = model
        self.cache = cache
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.streamer = LayerStreamer(model.blocks, streamed, self.device)

    def new_cache(self) -> PrefixKVCache:
        return HostPrefixKVCache(self.device) if self.cache == "host" else PrefixKVCache()

    def __enter__(self) -> "StreamedRun":
        self.streamer.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.streamer.close()
        finally:
            release_cache_slots()
