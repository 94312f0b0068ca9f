"""Device slots that a sequence of host-resident items (DiT blocks, a host cache's layers) cycles through:
the packing of one item's tensors into a byte slot, and one slot ring that fetches the next item on a side CUDA
stream while the current one runs (synchronous copies off CUDA, which is how the CPU tests run the same path)."""

import torch

#: Device slots a streamed model cycles its layers through (the one running, the one being copied in).
STREAM_SLOTS = 2
#: Byte alignment of each tensor inside a slot (views of any dtype start on an aligned address).
SLOT_ALIGN = 512


def slot_layout(tensors) -> tuple[list[int], int]:
    """Offsets of `tensors` packed into one byte buffer (each aligned to `SLOT_ALIGN`), and the buffer's size."""
    offsets, end = [], 0
    for tensor in tensors:
        offsets.append(end)
        end += -(-tensor.numel() * tensor.element_size() // SLOT_ALIGN) * SLOT_ALIGN
    return offsets, end


class Copier:
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


class SlotRing:
    """`count` device slots cycling through a sequence of items: `acquire(item, following)` returns the slot that
    holds `item` (copying it in if no slot does, and waiting for its copy), then starts copying `following` into
    another slot so that it arrives while `item` is used.

    The owner says what an item is: `pairs(item, slot)` -> the (device destination, host source) copies that fill
    `slot` with `item`, `after(item)` -> an extra event the copy must wait for (a host write still in flight).
    """

    def __init__(self, count: int, device: torch.device, pairs, after=lambda item: None):
        self.copier = Copier(device)
        self.owner = [None] * count
        self.ready = [None] * count
        self.used = [0] * count
        self.clock = 0
        self.copies = 0  # items copied in (tests and benchmarks read it)
        self._pairs = pairs
        self._after = after

    def find(self, item):
        return self.owner.index(item) if item in self.owner else None

    def forget(self, item) -> None:
        """A slot holding `item` is stale (its host copy changed): refill it on the next acquire."""
        slot = self.find(item)
        if slot is not None:
            self.owner[slot] = None

    def _victim(self, keep) -> int:
        """A slot to refill: an empty one, else the least recently used one that is not `keep`."""
        choices = [s for s in range(len(self.owner)) if s != keep]
        return min(choices, key=lambda s: (self.owner[s] is not None, self.used[s]))

    def _touch(self, slot: int) -> None:
        self.clock += 1
        self.used[slot] = self.clock

    def _fetch(self, item, keep) -> int:
        slot = self._victim(keep)
        # the slot's previous item was read by compute enqueued before now: the copy waits for that to finish
        self.ready[slot] = self.copier.copy(self._pairs(item, slot), after=(self.copier.now(), self._after(item)))
        self.owner[slot] = item
        self._touch(slot)
        self.copies += 1
        return slot

    def acquire(self, item, following=None) -> int:
        slot = self.find(item)
        if slot is None:
            slot = self._fetch(item, keep=None)
        self._touch(slot)
        self.copier.wait(self.ready[slot])
        if following is not None and following != item and self.find(following) is None:
            self._fetch(following, keep=slot)
        return slot

    def drain(self) -> None:
        self.copier.drain()
