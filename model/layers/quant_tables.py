"""The numeric building blocks of the quantized formats (formats.py): the ConvRot rotation (a Hadamard matrix,
applied to a layer's inputs instead of its weight) and dequantization by byte tables."""

import math

import torch
import torch.nn.functional as F


def power_of_4(value: int) -> bool:
    return value >= 4 and value & (value - 1) == 0 and (value.bit_length() - 1) % 2 == 0


_HADAMARD: dict = {}


def hadamard(size: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The orthonormal ConvRot rotation of `size` (a power of 4): Kronecker powers of
    `[[1,1,1,-1],[1,1,-1,1],[1,-1,1,1],[-1,1,1,1]]` over sqrt(size); symmetric, so it is its own inverse."""
    key = (size, dtype, str(device))
    if key not in _HADAMARD:
        h4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float64)
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < size:
            h = torch.kron(h, h4)
        _HADAMARD[key] = (h / math.sqrt(size)).to(dtype=dtype, device=device)
    return _HADAMARD[key]


def rotate_inputs(x: torch.Tensor, group: int, shared: dict | None = None) -> torch.Tensor:
    """`x` with each block of `group` input features rotated by `hadamard(group)`: `x @ W.T` of a ConvRot weight
    `W = Wr @ H` (per block) is `rotate_inputs(x) @ Wr.T`, so the weight itself never needs rotating. `shared`
    keeps it for the other row segments of the same call ([q; k; v] is three file tensors, one input)."""
    if shared is not None and group in shared:
        return shared[group]
    # H = Ha (x) Hb (Kronecker), so each block, seen as an [a, b] array V, becomes Ha V Hb: two small products, a
    # fraction of the multiply-adds of one [group, group] product.
    a = 4 ** ((group.bit_length() - 1) // 4)
    if a == 1:
        rotated = (x.reshape(-1, group) @ hadamard(group, x.dtype, x.device)).reshape(x.shape)
    else:
        b = group // a
        right = (x.reshape(-1, b) @ hadamard(b, x.dtype, x.device)).view(-1, a, b)
        rotated = torch.matmul(hadamard(a, x.dtype, x.device), right).reshape(x.shape)
    if shared is not None:
        shared[group] = rotated
    return rotated


# Dequantizing by table: a CPU converts fp8 and gathers 4-bit codes one element at a time (~5 ns each, a third of
# an fp32 GEMM's time per weight at 1,024 tokens); `F.embedding` of a table with one row per stored byte, or per
# pair of bytes (65,536 rows, <= 1 MiB), is 2-3x faster and gives the same values (each entry is the exact conversion
# of its bytes).
_TABLES: dict = {}
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # FP4 E2M1 codes
_PAIRS = torch.arange(65536, dtype=torch.int64)


def _byte_values(kind: str, values=None) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int64)
    if kind in ("fp8", "fp8_e5m2"):
        fp8 = torch.float8_e4m3fn if kind == "fp8" else torch.float8_e5m2
        return codes.to(torch.uint8).view(fp8).to(torch.float32).unsqueeze(1)
    if kind == "e2m1":
        e2m1 = torch.tensor(E2M1, dtype=torch.float32)
        return torch.stack((e2m1[codes >> 4], e2m1[codes & 15]), dim=1)
    values = torch.as_tensor(values, dtype=torch.float32).cpu()
    return torch.stack((values[codes & 15], values[codes >> 4]), dim=1)


def byte_table(kind: str, dtype: torch.dtype, device, values=None) -> torch.Tensor:
    """[65536, 2n] table: what each (little-endian) pair of bytes holds in `dtype`: "fp8" (float8_e4m3fn, n = 1),
    "fp8_e5m2" or "e2m1" (two FP4 values a byte, high nibble first, n = 2); or, for "nibbles" (`values[code]` of two
    4-bit codes a byte, low nibble first), a [256, 2] table of single bytes, built for each call (the codebook is the
    layer's own, and 256 rows cost nothing to build)."""
    if values is not None:
        return _byte_values(kind, values).to(dtype=dtype, device=device)
    key = (kind, dtype, str(device))
    if key not in _TABLES:
        one = _byte_values(kind)
        _TABLES[key] = torch.cat((one[_PAIRS & 255], one[_PAIRS >> 8]), dim=1).to(dtype=dtype, device=device)
    return _TABLES[key]


def by_table(data: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Each pair of bytes of `data` ([rows, cols]) looked up in `table`; byte by byte (a table of single bytes, or the
    rows of a pair table whose high byte is 0) for an odd count and off the CPU (where the win is, and where uint16
    is sure to convert)."""
    rows, data = data.shape[0], data.contiguous()
    if table.shape[0] == 256:
        return F.embedding(data.view(torch.uint8).int(), table).view(rows, -1)
    if data.shape[-1] % 2 or data.device.type != "cpu":
        return F.embedding(data.view(torch.uint8).int(), table[:256, : table.shape[1] // 2]).view(rows, -1)
    return F.embedding(data.view(torch.uint16).int(), table).view(rows, -1)


def unswizzle(scales: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
    """Block scales in cuBLAS's swizzled layout (tiles of 128 rows x 4 blocks; inside a tile, row `32 i + j`, block
    `c` sits at `[j, 4 i + c]` of a 32 x 16 array) as a plain [rows, blocks] array."""
    tiles, groups = -(-rows // 128), -(-blocks // 4)
    plain = scales.reshape(tiles, groups, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(tiles * 128, groups * 4)
    return plain[:rows, :blocks]
