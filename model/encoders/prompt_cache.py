"""What the text encoder keeps between encodings of the same references: each reference's vision-tower output and
the language model's keys/values of the prompt's leading run.

Every reference comes before the instruction in the Qwen-Image 2.1 template, and Qwen3-VL's language model is
causal, so the states (and keys/values) of the tokens up to the last `<|vision_end|>` do not depend on the words
that follow. Encoding the same references with another instruction (or the negative prompt after the positive)
therefore only has to run the instruction's tokens, attending over the kept keys/values of that leading run, and
the vision tower only has to see an image it has not seen. The leading run's states are returned as they were
kept, bit for bit, so the DiT's prefix cache recognises the rows as the same and reuses them too
(`prefix_cache/leading_runs.py`).

Everything kept lives in host memory (copied to the encoder's device when used), so nothing stays in VRAM when the
encoder is offloaded, and it goes with the encoder object. Bounded: least recently used entries go first once
the kept bytes pass `budget_bytes`; an entry larger than the whole budget is not kept.
"""

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

DEFAULT_PROMPT_CACHE_BYTES = 2 * 2**30  # one two-reference leading run of the 8B encoder in bf16 is ~1.2 GiB


def image_key(image, size: tuple[int, int]) -> str:
    """A reference's vision key: its RGB pixels and the size the processor was given."""
    return hashlib.sha256(repr((image.mode, image.size, tuple(size))).encode() + image.tobytes()).hexdigest()


def run_key(token_ids, image_keys) -> str:
    """A leading run's key: its token ids and the vision keys of the images in it."""
    hasher = hashlib.sha256(torch.as_tensor(token_ids, dtype=torch.int64).numpy().tobytes())
    for key in image_keys:
        hasher.update(key.encode())
    return hasher.hexdigest()


@dataclass(frozen=True, eq=False)
class VisionOutput:
    """One image through the vision tower: merged tokens `(n, hidden)`, one `(n, hidden)` per DeepStack layer, and
    the processor's `(t, h, w)` patch grid."""

    tokens: torch.Tensor
    deepstack: tuple[torch.Tensor, ...]
    grid: tuple[int, int, int]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tokens, *self.deepstack))


@dataclass(frozen=True, eq=False)
class LeadingRun:
    """The language model over a leading run: its states `(n, hidden)` and each layer's `(key, value)`, each
    `(1, kv_heads, n, head_dim)` as transformers' caches hold them."""

    states: torch.Tensor
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    @property
    def tokens(self) -> int:
        return self.states.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers for t in pair) + \
            self.states.numel() * self.states.element_size()


class PromptCache:
    """A small LRU of `VisionOutput`s and `LeadingRun`s by key, bounded by bytes, in host memory."""

    def __init__(self, budget_bytes: int = DEFAULT_PROMPT_CACHE_BYTES):
        self.budget_bytes = int(budget_bytes)
        self._entries: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str):
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: str, entry) -> None:
        """Keep `entry` (its tensors copied to host memory), evicting the least recently used to fit."""
        if entry.nbytes > self.budget_bytes:
            return
        entry = _on_host(entry)
        with self._lock:
            self._entries.pop(key, None)
            self._entries[key] = entry
            while self.nbytes > self.budget_bytes:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def _on_host(entry):
    host = lambda t: t.detach().to("cpu", copy=t.device.type == "cpu")  # noqa: E731  (own storage either way)
    if isinstance(entry, VisionOutput):
        return VisionOutput(host(entry.tokens), tuple(host(t) for t in entry.deepstack), entry.grid)
    return LeadingRun(host(entry.states), tuple((host(k), host(v)) for k, v in entry.layers))
