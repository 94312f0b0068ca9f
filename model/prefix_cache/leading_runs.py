"""Which leading rows two prefixes share: a chained content digest at every point where a prefix may be cut.

A prefix row's keys and values depend only on the rows up to it (text is causal) or up to the end of its image
block (a reference reads itself and everything before it), on their positions, and on the model. So two prefixes
that agree on their first units (a unit: one text row, or one whole reference block with its size and position)
have the same keys and values for those rows, whatever follows. The cut points are the ends of units: after any
text row, or after a whole reference block, never inside one.

Each unit's digest chains the previous one (`d_k = sha256(d_{k-1} | unit bytes)`), so equal digests at unit k
mean equal content up to there, and the longest common leading run of two prefixes is found by comparing digests.
The unit bytes are the prefix's inputs as the DiT receives them (the encoder state of a text row, the packed
latents of a reference block) with the row's RoPE position, dtype and shape: a hash of content, never of objects,
so it is the same in every process that was given the same inputs.
"""

import hashlib
from dataclasses import dataclass

import torch


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    tensor = tensor.detach().contiguous().cpu()
    header = f"{tensor.dtype}{tuple(tensor.shape)}".encode()
    return header + (tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")


@dataclass(frozen=True)
class PrefixRuns:
    """The cut points of one prefix: `ends[k]` is the row after unit k, `digests[k]` the chained digest up to it.
    `last_block` is the index of the last reference block's unit (-1 without references)."""

    ends: tuple[int, ...]
    digests: tuple[bytes, ...]
    last_block: int = -1

    @property
    def rows(self) -> int:
        return self.ends[-1] if self.ends else 0

    def common_rows(self, other: "PrefixRuns") -> int:
        """Rows of the longest leading run both prefixes share (0 when their first units differ)."""
        low, high = 0, min(len(self.digests), len(other.digests))  # digests chain: equal at k => equal before k
        while low < high:
            middle = (low + high + 1) // 2
            if self.digests[middle - 1] == other.digests[middle - 1]:
                low = middle
            else:
                high = middle - 1
        return self.ends[low - 1] if low else 0

    def leading_key(self) -> str | None:
        """Hex digest of everything up to the end of the last reference (the text before it included): what a
        new instruction after the same references keeps. None without references."""
        return None if self.last_block < 0 else self.digests[self.last_block].hex()


def prefix_runs(layout, text: torch.Tensor, references: torch.Tensor | None) -> PrefixRuns:
    """The cut points and digests of one prefix (`layout` a `SequenceLayout`, `text` its encoder states,
    `references` its packed reference latents in layout order)."""
    rows_text = {int(dst): int(src) for src, dst in zip(layout.text_src.tolist(), layout.text_dst.tolist())}
    positions = layout.prefix_positions
    ends, digests, last_block = [], [], -1
    digest = hashlib.sha256(b"qi21-prefix").digest()
    ref_start, block = 0, 0
    for start, end, is_text in layout.segments:
        if is_text:
            for row in range(start, end):
                unit = b"t" + _tensor_bytes(positions[row]) + _tensor_bytes(text[rows_text[row]])
                digest = hashlib.sha256(digest + unit).digest()
                ends.append(row + 1)
                digests.append(digest)
            continue
        height, width = layout.ref_shapes[block]
        latents = references[ref_start : ref_start + height * width]
        unit = b"i" + repr((height, width)).encode() + _tensor_bytes(positions[start]) + _tensor_bytes(latents)
        digest = hashlib.sha256(digest + unit).digest()
        ends.append(end)
        digests.append(digest)
        last_block = len(digests) - 1
        ref_start += height * width
        block += 1
    return PrefixRuns(tuple(ends), tuple(digests), last_block)
