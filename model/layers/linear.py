"""The DiT's linear layer and its extension points, shared by every weight format.

`Linear` is a bias-free linear whose blocks ask for row ranges of fused weights (`rows(x, start, end)`); two
extension points keep other weight formats and LoRA out of the blocks: a format that stores its weight otherwise
overrides `weight_rows` (dequantize, then the plain GEMM) or `project` (its own quantized GEMM), and LoRA adds
`adapters`, terms added to the output (the frozen weight is never changed or copied). `StoredLinear` is the base
of the formats that keep their weight as stored row segments (GGUF, comfy-kitchen quantized files).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Linear(nn.Module):
    """Bias-free linear whose weight may be stored in a narrower dtype (fp8) than the compute dtype (the
    extension points: module docstring). Each of `adapters` is called as `adapter(x, start, end)` -> the
    `(..., end - start)` term for those output rows, or None when it does not touch them."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__()
        weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.adapters: tuple = ()

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows(x, 0, self.out_features)

    def weight_rows(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows `[start, end)` of the weight in `dtype` (a view when no conversion is needed)."""
        weight = self.weight[start:end]
        return weight if weight.dtype == dtype else weight.to(dtype)

    def project(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The frozen layer's output features `[start, end)`: one GEMM over a contiguous block of weight rows.
        Formats with kernels of their own (int8 / fp8 GEMMs) override this instead of `weight_rows`."""
        return F.linear(x, self.weight_rows(start, end, x.dtype))

    def rows(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Output features `[start, end)` only, adapters included."""
        out = self.project(x, start, end)
        for adapter in self.adapters:
            term = adapter(x, start, end)
            if term is not None:
                out += term  # `out` is this call's own GEMM output: no second buffer
        return out


def row_overlaps(segments, start: int, end: int):
    """`(segment, first, last)` for each row segment (with `.start` / `.end`) that overlaps rows `[start, end)`,
    `[first, last)` being the overlap in the segment's own rows."""
    for seg in segments:
        lo, hi = max(start, seg.start), min(end, seg.end)
        if lo < hi:
            yield seg, lo - seg.start, hi - seg.start


class StoredLinear(Linear):
    """A `Linear` whose weight stays in a stored format as row segments (GGUF blocks, comfy-kitchen quantized
    tensors): each segment's tensors are parameters of their own, so `.to(device)` moves the stored bytes and the
    resident bytes are the file's. Subclasses add segments and override `weight_rows` or `project`.

    `weight` is a meta tensor of the logical shape and compute dtype (shapes and `out_features` keep working; reading
    its values fails loudly), unless a subclass stores a real parameter under that name.
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        nn.Module.__init__(self)  # not Linear.__init__: there is no dense weight to allocate
        self.in_features = in_features
        self._logical = torch.empty(out_features, in_features, dtype=dtype, device="meta")
        self.segments: list = []
        self.adapters: tuple = ()

    def __getattr__(self, name: str):
        if name == "weight" and "_logical" in self.__dict__ and "weight" not in self.__dict__.get("_parameters", {}):
            return self.__dict__["_logical"]
        return super().__getattr__(name)

    def _pieces(self, start: int, end: int):
        return row_overlaps(self.segments, start, end)
