"""GGUF block dequantization in torch ops (CPU and GPU alike), and the DiT layer that keeps its weight quantized.

A GGUF tensor of a quantized type is a sequence of blocks along the flattened tensor: each block holds
`block_size` consecutive elements (32, or 256 for the K-quants) in `type_size` bytes. For a Linear weight
`(out, in)` with `in` a multiple of the block size, row `r` is blocks `[r * in / block, (r + 1) * in / block)`:
rows are independent, and a few rows cost only their own blocks. The layouts follow llama.cpp's `ggml-quants.c`
as the `gguf` package's reference dequantizer reads them (`gguf.quants.<TYPE>.dequantize_blocks`); every kernel
here performs the same fp32 operations in the same order, so the results are equal bit for bit
(tests/test_gguf.py checks each type against that reference).

This module needs only torch: the `gguf` package is used to read the file (loaders/gguf.py), not to run it.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn

from .linear import StoredLinear

#: GGUF types stored as plain floats: element dtype on load.
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
#: Quantized types we dequantize: (elements per block, bytes per block), as llama.cpp defines them.
QUANT_TYPES = {
    "Q8_0": (32, 34), "Q5_1": (32, 24), "Q5_0": (32, 22), "Q4_1": (32, 20), "Q4_0": (32, 18),
    "Q6_K": (256, 210), "Q5_K": (256, 176), "Q4_K": (256, 144), "Q3_K": (256, 110), "Q2_K": (256, 84),
}
SUPPORTED_TYPES = (*FLOAT_TYPES, *QUANT_TYPES)
#: Where each quantized type keeps its fp16 block scales: byte offsets of `d` (and of `m` / `dmin` where it has one,
#: always right after it), as llama.cpp's `block_q*` structs lay them out. The K-quants' 4- and 6-bit sub-scales are
#: integers and cannot be NaN.
SCALE_OFFSETS = {
    "Q8_0": (0,), "Q5_1": (0, 2), "Q5_0": (0,), "Q4_1": (0, 2), "Q4_0": (0,),
    "Q6_K": (208,), "Q5_K": (0, 2), "Q4_K": (0, 2), "Q3_K": (108,), "Q2_K": (80, 82),
}


# -- helpers --------------------------------------------------------------------------------------------------------
# Each kernel builds its quants as small integers (uint8/int8), converts them to fp32 once and scales that buffer in
# place: the reference's fp32 arithmetic (int -> fp32 is exact) with one large allocation. Scales are read as fp16
# columns of the blocks seen as 16-bit words (every block size and scale offset is even).
def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 scale stored at byte `at` of each block, as `(n, 1)` fp32."""
    return blocks.view(torch.float16)[:, at // 2 : at // 2 + 1].float()


def _shifted(data: torch.Tensor, step: int, count: int, dim: int) -> torch.Tensor:
    """`data >> (0, step, 2 step, ...)`: `count` shifted copies of `data` stacked on a new axis `dim` (negative)."""
    shifts = torch.arange(0, step * count, step, dtype=torch.uint8, device=data.device)
    return data.unsqueeze(dim) >> shifts.view(-1, *([1] * (-dim - 1)))


def _nibbles(data: torch.Tensor) -> torch.Tensor:
    """`(n, k)` bytes -> `(n, 2k)`: the k low nibbles, then the k high nibbles."""
    return torch.stack((data & 0x0F, data >> 4), dim=1).reshape(data.shape[0], -1)


def _bits32(data: torch.Tensor) -> torch.Tensor:
    """`(n, 4)` bytes of a little-endian uint32 -> `(n, 32)` of its bits, bit j at column j."""
    return (_shifted(data, 1, 8, -1) & 1).reshape(data.shape[0], 32)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins, each `(n, 8)` fp32."""
    a, b, c = scales.reshape(-1, 3, 4).unbind(1)
    sc = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], dim=-1)
    mn = torch.cat([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _signed(data: torch.Tensor, offset: int) -> torch.Tensor:
    """Unsigned quants (< 128) minus their zero point, as int8."""
    return data.view(torch.int8) - offset


# -- one kernel per type: (n, type_size) uint8 -> (n, block_size) fp32 ----------------------------------------------
def _q8_0(b):
    return b[:, 2:].view(torch.int8).float().mul_(_f16(b, 0))


def _q4_0(b):
    return _signed(_nibbles(b[:, 2:]), 8).float().mul_(_f16(b, 0))


def _q4_1(b):
    return _nibbles(b[:, 4:]).float().mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5_0(b):
    q = _nibbles(b[:, 6:]) | (_bits32(b[:, 2:6]) << 4)
    return _signed(q, 16).float().mul_(_f16(b, 0))


def _q5_1(b):
    q = _nibbles(b[:, 8:]) | (_bits32(b[:, 4:8]) << 4)
    return q.float().mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q2_k(b):
    n = b.shape[0]
    scales = b[:, :16]
    dl = (_f16(b, 80) * (scales & 0x0F).float()).view(n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).float()).view(n, 16, 1)
    q = (_shifted(b[:, 16:80].reshape(n, 2, 32), 2, 4, -2) & 3).reshape(n, 16, 16)
    return q.float().mul_(dl).sub_(ml).view(n, 256)


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    low = (_shifted(scales[:, :8], 4, 2, -2) & 0x0F).reshape(n, 16)
    high = (_shifted(scales[:, 8:], 2, 4, -2) & 3).reshape(n, 16)
    dl = (_f16(b, 108) * _signed(low | (high << 4), 32).float()).view(n, 16, 1)
    ql = (_shifted(qs.reshape(n, 2, 32), 2, 4, -2) & 3).reshape(n, 16, 16)
    qh = (_shifted(hmask.reshape(n, 1, 32), 1, 8, -2) & 1).reshape(n, 16, 16) ^ 1  # a set bit means no offset
    return (ql.view(torch.int8) - (qh << 2).view(torch.int8)).float().mul_(dl).view(n, 256)


def _k4_scales(b):
    """Q4_K / Q5_K super-block header: the 8 sub-blocks' scales and minimums, `(n, 8, 1)` each."""
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    return (_f16(b, 0) * sc).view(n, 8, 1), (_f16(b, 2) * mn).view(n, 8, 1)


def _q4_k(b):
    n = b.shape[0]
    d, dm = _k4_scales(b)
    q = (_shifted(b[:, 16:].reshape(n, 4, 32), 4, 2, -2) & 0x0F).reshape(n, 8, 32)
    return q.float().mul_(d).sub_(dm).view(n, 256)


def _q5_k(b):
    n = b.shape[0]
    d, dm = _k4_scales(b)
    ql = (_shifted(b[:, 48:].reshape(n, 4, 32), 4, 2, -2) & 0x0F).reshape(n, 8, 32)
    qh = (_shifted(b[:, 16:48].reshape(n, 1, 32), 1, 8, -2) & 1).reshape(n, 8, 32)
    return (ql | (qh << 4)).float().mul_(d).sub_(dm).view(n, 256)


def _q6_k(b):
    n = b.shape[0]
    d = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).view(n, 16, 1)
    ql = (_shifted(b[:, :128].reshape(n, 2, 64), 4, 2, -2) & 0x0F).reshape(n, 8, 32)
    qh = (_shifted(b[:, 128:192].reshape(n, 2, 32), 2, 4, -2) & 3).reshape(n, 8, 32)
    return _signed(ql | (qh << 4), 32).float().view(n, 16, 16).mul_(d).view(n, 256)


_KERNELS = {"Q8_0": _q8_0, "Q5_1": _q5_1, "Q5_0": _q5_0, "Q4_1": _q4_1, "Q4_0": _q4_0,
            "Q6_K": _q6_k, "Q5_K": _q5_k, "Q4_K": _q4_k, "Q3_K": _q3_k, "Q2_K": _q2_k}


def block_scales(qtype: str, blocks: torch.Tensor) -> torch.Tensor:
    """The fp16 scales of `(n, type_size)` uint8 blocks as an `(n, 1 or 2)` view (no copy): what a finiteness check
    of a quantized tensor needs to read (a NaN anywhere else in a block is impossible: the rest are integers)."""
    first, last = SCALE_OFFSETS[qtype][0], SCALE_OFFSETS[qtype][-1]
    return blocks.view(torch.float16)[:, first // 2 : last // 2 + 1]


def dequantize_blocks(qtype: str, blocks: torch.Tensor) -> torch.Tensor:
    """`(n, type_size)` uint8 blocks of quantized type `qtype` -> `(n, block_size)` fp32, on the blocks' device."""
    size = QUANT_TYPES[qtype][1]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != size:
        raise ValueError(f"{qtype} blocks must be a (n, {size}) uint8 tensor, got {tuple(blocks.shape)} "
                         f"{blocks.dtype}.")
    return _KERNELS[qtype](blocks.contiguous())


def dequantize(qtype: str, data: torch.Tensor) -> torch.Tensor:
    """A whole tensor's bytes (any shape, uint8) of GGUF type `qtype` -> its elements, flat fp32."""
    if qtype in FLOAT_TYPES:
        return data.contiguous().view(torch.uint8).view(-1).view(FLOAT_TYPES[qtype]).float()
    size = QUANT_TYPES[qtype][1]
    return dequantize_blocks(qtype, data.contiguous().view(torch.uint8).view(-1, size)).view(-1)


# -- the layer --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    """Rows `[start, end)` of a layer's weight, stored in parameter `name` as GGUF type `qtype`: `(blocks,
    type_size)` uint8 for a quantized type, `(end - start, in_features)` in the float type otherwise."""

    start: int
    end: int
    qtype: str
    name: str


class GGUFLinear(StoredLinear):
    """A `Linear` (model/layers/linear.py) whose weight stays in the file's GGUF types and is dequantized at each call.

    The weight is one or more row segments (a fused weight such as [q; k; v] may mix types, as "_K_M" files
    do), each a parameter of its own in the file's bytes, so `.to(device)` moves the quantized data and the
    resident bytes are the file's. Only `Linear.weight_rows` is overridden: it dequantizes just the rows asked
    for, in fp32 (exactly as the reference dequantizer does) and casts them to the compute dtype; `Linear.rows`
    runs the GEMM and adds the `adapters` (LoRA) as for any Linear. Nothing dequantized is kept between calls.
    `weight` is a meta tensor of the logical shape and compute dtype (shapes and `out_features` keep working;
    anything that reads its values fails loudly); `weight_rows` gives the real values.
    """

    def add_segment(self, qtype: str, data: torch.Tensor) -> None:
        """Append rows stored as `data` (see `Segment`); it becomes a parameter of this layer as it is."""
        start = self.segments[-1].end if self.segments else 0
        if qtype in FLOAT_TYPES:
            rows = data.shape[0]
        else:
            rows = data.shape[0] * QUANT_TYPES[qtype][0] // self.in_features
        name = f"weight_{len(self.segments)}"
        self.register_parameter(name, nn.Parameter(data, requires_grad=False))
        self.segments.append(Segment(start, start + rows, qtype, name))

    def weight_rows(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Weight rows `[start, end)` in `dtype`, freshly dequantized (or the stored rows when already `dtype`)."""
        pieces = [self._segment_rows(seg, first, last, dtype) for seg, first, last in self._pieces(start, end)]
        if not pieces:
            return torch.empty(0, self.in_features, dtype=dtype, device=getattr(self, self.segments[0].name).device)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _segment_rows(self, seg: Segment, first: int, last: int, dtype: torch.dtype) -> torch.Tensor:
        data = getattr(self, seg.name)
        if data.is_floating_point():
            rows = data[first:last]
            return rows if rows.dtype == dtype else rows.to(dtype)
        # rows [first, last) are elements [first * in, last * in) of the segment's flat sequence of blocks
        width = self.in_features
        block = QUANT_TYPES[seg.qtype][0]
        begin, stop = first * width // block, -(-last * width // block)
        values = dequantize_blocks(seg.qtype, data[begin:stop]).view(-1)
        skip = first * width - begin * block  # 0 unless a block straddles rows (in_features not a multiple)
        values = values[skip : skip + (last - first) * width].view(last - first, width)
        return values if dtype == torch.float32 else values.to(dtype)

    def extra_repr(self) -> str:
        types = ", ".join(dict.fromkeys(seg.qtype for seg in self.segments))
        return f"in_features={self.in_features}, out_features={self.out_features}, gguf={types}"
