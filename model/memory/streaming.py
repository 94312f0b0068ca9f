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
(loaders/lora.py: new module objects sharing the Parameters) is not affected by a streamer attached to the original.
On a CPU the same code runs with the device equal to the host (copies are synchronous): that is how the tests show
that a streamed run gives bit-identical latents to a resident one. Numerics are untouched: a copy is exact.
"""

import torch
from torch import nn

from ..prefix_cache.host_moves import HostPrefixKVCache, release_cache_slots
from ..prefix_cache.layout import PrefixKVCache
from .slots import SLOT_ALIGN, STREAM_SLOTS, SlotRing, slot_layout
from .weights import run_layers


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


class LayerStreamer:
    """Streams the weights of `layers[i]`, i in `streamed`, through `STREAM_SLOTS` device slots while the model runs.

    Use as a context manager around the forward passes (one sampling run): entering allocates the slots and hooks
    the streamed layers; leaving puts every layer back on its host tensors, waits for the copies in flight and
    frees the slots. The layers must already be in host memory (`place_layers`).
    """

    def __init__(self, layers, streamed, device, slots: int = STREAM_SLOTS):
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
        self._ring = SlotRing(self.slot_count, self.device, self._slot_copies)
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
        if self._ring is not None:
            self._ring.drain()
        self._buffers = self._ring = None
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

    def _slot_copies(self, index: int, slot: int):
        self.copies += 1
        buffer = self._buffers[slot]
        return [(_view(buffer, t, off), t) for _, _, _, t, off in self._entries[index]]

    def _bring(self, index: int) -> None:
        slot = self._ring.acquire(index, following=self._next_after(index))
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

    def _restore(self, index: int) -> None:
        for sub, kind, name, original in self._swapped.pop(index, ()):
            (sub._parameters if kind == "param" else sub._buffers)[name] = original


def _get(sub: nn.Module, kind: str, name: str) -> torch.Tensor:
    return sub._parameters[name] if kind == "param" else sub._buffers[name]


def _view(buffer: torch.Tensor, like: torch.Tensor, offset: int) -> torch.Tensor:
    """`like`'s shape and dtype over `buffer[offset:]` (a byte buffer)."""
    nbytes = like.numel() * like.element_size()
    return buffer[offset : offset + nbytes].view(like.dtype).view(like.shape)


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
        self.streamer = LayerStreamer(run_layers(model), streamed, self.device)

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
