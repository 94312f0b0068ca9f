"""How the prefix cache stores its keys and values: in the model's dtype (`default`), or quantized per token through
comfy-kitchen's layouts, with core's `QwenImage21Cache` vocabulary (`int8`, `int4`).

    int8   `TensorWiseINT8Layout`, ConvRot (group 256), one fp32 scale per token row: W + 4 bytes per row
    int4   `TensorCoreConvRotW4A4Layout`, ConvRot (group 256), signed 4-bit pairs, one fp32 scale per token row:
           W / 2 + 4 bytes per row

A row is one token's keys (or values) of one layer, all heads: W = heads x head_dim values (4096 in the released
model, so int8 keeps 0.5005x and int4 0.2505x of the bf16 bytes, scales included). Each row is quantized on its
own (ConvRot spreads an outlier over its group before the per-row absmax), in fixed blocks of rows, so its stored
bytes depend only on its own values: the same row gives the same bytes in every run, whether it was computed with its
whole prefix or as a chunk after kept rows, which is what makes a reused quantized cache equal a fresh one.

A quantized payload is one uint8 tensor `(layers, 2, rows, row_bytes)` whose last 4 bytes per row are the row's
fp32 scale: everything the prefix cache does with payload tensors (row ranges, sharing, `.to(device)`, the host
cache's per-layer copies, byte accounting) works on it unchanged, and a byte count is the real one, scales
included. comfy-kitchen is imported on first use; without it `int8` / `int4` are refused with how to install it.
"""

import torch

from ..layers.custom_ops import op_name
from ..layers.formats import kitchen

CACHE_DTYPES = ("default", "int8", "int4")
CACHE_DEVICES = ("auto", "gpu", "cpu", "off")
SCALE_BYTES = 4  # one fp32 scale per row
ROTATION_GROUP = 256  # ConvRot's Hadamard group, as core uses it
INT4_GROUP = 64  # comfy-kitchen's int4 layout wants rows a multiple of its quantization group
ENCODE_ROWS = 256  # rows per call of a layout's quantize (`QuantizedRows.encode`)
DECODE_ROWS = 1024  # rows per call of a layout's dequantize: its fp32 temporaries stay small


def rotation_group(width: int) -> int:
    """The ConvRot group for rows of `width`: 256, or for a narrower model the largest power of 4 dividing it."""
    group = ROTATION_GROUP
    while group >= 4 and width % group:
        group //= 4
    if group < 4:
        raise ValueError(f"a quantized prefix cache needs heads x head_dim divisible by 4; this model has {width}.")
    return group


class QuantizedRows:
    """One quantized storage (`int8` or `int4`): rows of W values to `row_bytes(W)` bytes and back."""

    def __init__(self, name: str):
        self.name = name
        self.bits = 8 if name == "int8" else 4

    def __repr__(self) -> str:
        return f"QuantizedRows({self.name!r})"

    def payload_bytes(self, width: int) -> int:
        return width * self.bits // 8

    def row_bytes(self, width: int) -> int:
        return self.payload_bytes(width) + SCALE_BYTES

    def check_width(self, width: int) -> None:
        rotation_group(width)
        if self.bits == 4 and width % INT4_GROUP:
            raise ValueError(f"an int4 prefix cache needs heads x head_dim divisible by {INT4_GROUP}; this model has "
                             f"{width}. Use dtype int8 or default.")

    def _layout(self):
        kitchen(f"A prefix cache with dtype {self.name}")
        from comfy_kitchen.tensor import TensorCoreConvRotW4A4Layout, TensorWiseINT8Layout

        return TensorWiseINT8Layout if self.bits == 8 else TensorCoreConvRotW4A4Layout

    def encode(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """Quantize `rows` `(n, W)` into `out` `(n, row_bytes)` uint8 (quantized bytes, then the fp32 scale); through
        the `cache_rows_encode` operator (module end)."""
        encode_rows(rows, out, self.name)

    def decode(self, stored: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
        """`(n, W)` rows in `dtype` from `stored` `(n, row_bytes)` uint8 (a row range of a payload); through the
        `cache_rows_decode` operator (module end)."""
        return decode_rows(stored, width, dtype, self.name)

    def _encode(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """`encode`'s work.

        The rows go through the layout in blocks of `ENCODE_ROWS` (the last one padded with zero rows): the
        rotation is a GEMM, whose rounding may depend on how many rows it is given, and a fixed block makes a
        row's bytes the same whether it was quantized with its whole prefix or as a chunk after kept rows."""
        width = rows.shape[-1]
        group, layout, cut = rotation_group(width), self._layout(), self.payload_bytes(width)
        for first in range(0, rows.shape[0], ENCODE_ROWS):
            block = rows[first:first + ENCODE_ROWS].float()
            count = block.shape[0]
            if count < ENCODE_ROWS:
                block = torch.cat([block, block.new_zeros(ENCODE_ROWS - count, width)])
            if self.bits == 8:
                data, params = layout.quantize(block, is_weight=True, per_channel=True, convrot=True,
                                               convrot_groupsize=group)
            else:
                data, params = layout.quantize(block, convrot_groupsize=group)
            target = out[first:first + count]
            target[:, :cut].copy_(data[:count].view(torch.uint8))
            target[:, cut:].copy_(params.scale.reshape(-1, 1)[:count].to(torch.float32).view(torch.uint8))

    def _decode(self, stored: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
        """`decode`'s work."""
        cut, layout, group = self.payload_bytes(width), self._layout(), rotation_group(width)
        out = torch.empty(stored.shape[0], width, dtype=dtype, device=stored.device)
        for first in range(0, stored.shape[0], DECODE_ROWS):  # blocks bound the layout's fp32 temporaries
            block = stored[first:first + DECODE_ROWS]
            data = block[:, :cut].view(torch.int8).contiguous()
            scale = block[:, cut:].view(torch.float32).contiguous()
            shape = (block.shape[0], width)
            if self.bits == 8:
                params = layout.Params(scale=scale, orig_dtype=dtype, orig_shape=shape, is_weight=True,
                                       convrot=True, convrot_groupsize=group)
            else:
                params = layout.Params(scale=scale.reshape(-1), orig_dtype=dtype, orig_shape=shape,
                                       convrot_groupsize=group)
            out[first:first + block.shape[0]] = layout.dequantize(data, params)
        return out


# comfy-kitchen picks its kernel backend per call through a registry behind a lock, and caches its rotation
# matrices in a module dict: traced inside a compiled block (model/transformer/compiled.py) that breaks the graph
# and recompiles it. As operators the quantized cache's reads and writes are opaque to the tracer, eager and compiled
# alike, and the graph around them stays whole.
@torch.library.custom_op(op_name("cache_rows_encode"), mutates_args=("out",))
def encode_rows(rows: torch.Tensor, out: torch.Tensor, name: str) -> None:
    QuantizedRows(name)._encode(rows, out)


@torch.library.custom_op(op_name("cache_rows_decode"), mutates_args=())
def decode_rows(stored: torch.Tensor, width: int, dtype: torch.dtype, name: str) -> torch.Tensor:
    return QuantizedRows(name)._decode(stored, width, dtype)


@decode_rows.register_fake
def _(stored, width, dtype, name):
    return stored.new_empty((stored.shape[0], width), dtype=dtype)


def cache_storage(dtype: str = "default", what: str = "dtype") -> QuantizedRows | None:
    """The storage of a cache `dtype` (None: the model's own dtype); a clear error naming `what` otherwise, and for
    int8 / int4 when comfy-kitchen cannot be imported."""
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"{what} must be one of {', '.join(CACHE_DTYPES)}; got {dtype!r}.")
    if dtype == "default":
        return None
    kitchen(f"A prefix cache with {what} {dtype}")
    return QuantizedRows(dtype)


def cache_row_bytes(dtype: str, width: int, itemsize: int) -> int:
    """Bytes of one token's keys (or values) of one layer in a cache of `dtype`, scales included (no comfy-kitchen
    needed: the memory planner asks before anything runs)."""
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"the cache dtype must be one of {', '.join(CACHE_DTYPES)}; got {dtype!r}.")
    return width * itemsize if dtype == "default" else QuantizedRows(dtype).row_bytes(width)
