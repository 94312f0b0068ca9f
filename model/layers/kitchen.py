"""The layers of ComfyUI's per-layer quantized checkpoints: `QuantLinear` (a `linear.StoredLinear`, so LoRA adapters
and the DiT's row-range calls work unchanged) and `QuantEmbedding`, each file tensor one segment in its stored
dtype with its own scales, run by its format (formats.py: how each format is cut, dequantized and multiplied).
What the files hold and how they are checked before any weight is read: `loaders/kitchen.py`.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn

from .fast_gemm import float_rows, quantize_weight
from .format_table import format_of, gemm_mode
from .formats import GEMM_MODES, kitchen
from .linear import Linear, StoredLinear, row_overlaps

__all__ = ["QSegment", "QuantEmbedding", "QuantLinear", "fp8_rowwise_linears", "gemm_summary", "kitchen", "set_gemm"]


@dataclass(frozen=True, eq=False)
class QSegment:
    """Rows `[start, end)` of a layer: format `fmt` ("float" for rows the file keeps unquantized), the layer's
    attribute holding each role's tensor, and the format's options."""

    start: int
    end: int
    fmt: str
    names: dict
    options: dict


class _Segmented(nn.Module):
    """What `QuantLinear` and `QuantEmbedding` share: row segments, each tensor a parameter of the module in its
    stored dtype (so `.to(device)` moves the quantized bytes and `parameters()` counts the file's payload)."""

    segments: list

    def add_segment(self, fmt: str, tensors: dict[str, torch.Tensor], options: dict,
                    names: dict[str, str] | None = None) -> None:
        """Append rows stored as `tensors` (role -> tensor, `weight` first); each becomes a parameter as it is."""
        start = self.segments[-1].end if self.segments else 0
        index = len(self.segments)
        names = names or {role: f"{role}_{index}" for role in tensors}
        for role, tensor in tensors.items():  # straight into _parameters: `weight` is also QuantLinear's fallback name
            self._parameters[names[role]] = nn.Parameter(tensor, requires_grad=False)
        self.segments.append(QSegment(start, start + tensors["weight"].shape[0], fmt, names, dict(options)))

    def _tensors(self, seg: QSegment, first: int, last: int | None = None, index: torch.Tensor | None = None):
        """The segment's tensors cut to its rows `[first, last)` (or gathered at `index`) by its format."""
        rows = seg.end - seg.start
        tensors = {role: getattr(self, name) for role, name in seg.names.items()}
        return format_of(seg.fmt).cut(tensors, rows, first, rows if last is None else last, index)

    def _pieces(self, start: int, end: int):
        return row_overlaps(self.segments, start, end)

    def extra_repr(self) -> str:
        formats = ", ".join(dict.fromkeys(seg.fmt for seg in self.segments))
        return f"{tuple(self._logical.shape)}, quantized={formats}"


class QuantLinear(_Segmented, StoredLinear):
    """A `StoredLinear` whose weight stays in its file formats: one row segment per file tensor (quantized, with its
    own scales, or float), run by comfy-kitchen's kernels segment by segment.

    `project` (the frozen layer's output rows) is overridden; `rows`, `forward` and the LoRA `adapters` are
    `Linear`'s. `weight_rows` gives dequantized rows for anything that needs a dense weight. Without a
    parameter named `weight`, `weight` is a meta tensor of the logical shape and compute dtype (shapes and
    `out_features` work, reading its values fails loudly). The DiT loader's own fp8 option names its single
    segment's data `weight`, so there `weight` is the real fp8 parameter. `bias` is used by text-encoder layers.
    `gemm` ("auto", "kernel", "dequantize"; see `format_table.gemm_mode`) chooses between a format's own GEMM and
    dequantizing right before a plain one.
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__(in_features, out_features, dtype)
        self.bias = None
        self.gemm = "auto"

    def gemm_modes(self, device) -> dict[str, str]:
        """{format: "kernel" or "dequantize"} for this layer's quantized segments on `device`."""
        if self.gemm not in GEMM_MODES:
            raise ValueError(f"gemm must be one of {', '.join(GEMM_MODES)}, got {self.gemm!r}")
        return {seg.fmt: gemm_mode(format_of(seg.fmt), seg.options, torch.device(device), self.gemm)
                for seg in self.segments if seg.fmt != "float"}

    def project(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        pieces, shared = [], {}
        for seg, first, last in self._pieces(start, end):
            fmt = format_of(seg.fmt)
            mode = gemm_mode(fmt, seg.options, x.device, self.gemm)
            pieces.append(fmt.project(x, self._tensors(seg, first, last), seg.options, mode, shared))
        if not pieces:
            out = x.new_empty(*x.shape[:-1], 0)
        else:
            out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
        if self.bias is not None:
            out = out + self.bias[start:end].to(out.dtype)
        return out

    def weight_rows(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        pieces = [format_of(seg.fmt).dequantize(self._tensors(seg, first, last), seg.options, dtype)
                  for seg, first, last in self._pieces(start, end)]
        if not pieces:
            device = getattr(self, self.segments[0].names["weight"]).device
            return torch.empty(0, self.in_features, dtype=dtype, device=device)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    @classmethod
    def from_fp8(cls, weight: torch.Tensor, compute: torch.dtype) -> "QuantLinear":
        """The DiT loader's `weight_dtype = fp8_e4m3fn` on a float file: `weight` already rounded to fp8, without a
        scale (the plain cast), run through the same fp8 path as an fp8 file's layers."""
        layer = cls(weight.shape[1], weight.shape[0], compute)
        layer.add_segment("float8_e4m3fn", {"weight": weight}, {"full_precision": False}, names={"weight": "weight"})
        return layer

    @classmethod
    def from_fp8_rowwise(cls, weight: torch.Tensor, scale: torch.Tensor, compute: torch.dtype,
                         leading: torch.Tensor | None = None) -> "QuantLinear":
        """The DiT loader's `weight_dtype = fp8_e4m3fn_fast`: fp8 e4m3 `weight` (N, K) with one fp32 scale per output
        channel `scale` (N, 1), multiplied by `torch._scaled_mm` where the device has fp8 GEMMs (fast_gemm.py).
        `leading`: rows (M, K) before those, kept in `compute` (a fused qkv's q and k: `fast_gemm.float_rows`); then
        `weight` names no parameter (the layer's `weight` is the logical meta tensor)."""
        layer = cls(weight.shape[1], weight.shape[0] + (0 if leading is None else leading.shape[0]), compute)
        if leading is None:
            layer.add_segment("float8_e4m3fn_rowwise", {"weight": weight, "weight_scale": scale}, {},
                              names={"weight": "weight", "weight_scale": "weight_scale"})
            return layer
        layer.add_segment("float", {"weight": leading.to(compute)}, {})
        layer.add_segment("float8_e4m3fn_rowwise", {"weight": weight, "weight_scale": scale}, {})
        return layer

    @classmethod
    def fp8_rowwise_from_dense(cls, weight: torch.Tensor, compute: torch.dtype, keep_rows: int = 0) -> "QuantLinear":
        """A float `weight` (N, K) as an fp8 rowwise layer: its first `keep_rows` rows in `compute`, the others
        quantized per output channel (from `weight`'s own values, not from a `compute` copy)."""
        codes, scale = quantize_weight(weight[keep_rows:].detach())
        return cls.from_fp8_rowwise(codes, scale, compute, weight[:keep_rows].detach() if keep_rows else None)

    def as_fp8_rowwise(self, keep_rows: int = 0) -> "QuantLinear":
        """This layer (of an fp8 file: e4m3 segments with per-tensor scales, or float rows) as fp8 rowwise: e4m3
        codes and their scales used as they are (each tensor scale repeated over its rows), other rows quantized per
        output channel; its first `keep_rows` rows dequantized to the compute dtype instead (`fast_gemm.float_rows`)."""
        compute = self._logical.dtype
        leading = self.weight_rows(0, keep_rows, compute) if keep_rows else None
        codes, scales = [], []
        for seg, first, last in self._pieces(keep_rows, self.out_features):
            t = self._tensors(seg, first, last)
            rows = last - first
            if seg.fmt == "float8_e4m3fn":
                scale = t.get("weight_scale")
                scale = torch.ones((), device=t["weight"].device) if scale is None else scale.reshape(())
                codes.append(t["weight"])
                scales.append(scale.float().expand(rows, 1))
            else:
                dense = format_of(seg.fmt).dequantize(t, seg.options, torch.float32)
                code, scale = quantize_weight(dense)
                codes.append(code)
                scales.append(scale)
        return QuantLinear.from_fp8_rowwise(torch.cat(codes), torch.cat(scales).contiguous(), compute, leading)


class QuantEmbedding(_Segmented):
    """A token table stored in int8 (`int8_tensorwise`, ConvRot or not) or fp8: the ids' rows are gathered first and
    only those are dequantized (for int8 by comfy-kitchen's `dequantize_embedding`, which also un-rotates them).

    `weight` is a zero-strided view of one compute-dtype value on the table's device: its `device`, `dtype` and
    `shape` are right for code that asks (`text_encoder.py` reads device and dtype); it holds no table values.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, padding_idx=None, device=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self._logical = torch.empty(num_embeddings, embedding_dim, dtype=dtype, device="meta")
        self.register_buffer("_probe", torch.zeros((), dtype=dtype, device=device), persistent=False)
        self.segments: list[QSegment] = []

    @property
    def weight(self) -> torch.Tensor:
        return self._probe.expand(self.num_embeddings, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seg = self.segments[0]
        fmt, dtype = format_of(seg.fmt), self._logical.dtype
        if hasattr(fmt, "embed"):  # a format with its own gather-then-dequantize
            return fmt.embed(self._tensors(seg, 0, seg.end), seg.options, ids, dtype)
        rows = fmt.dequantize(self._tensors(seg, 0, None, index=ids.reshape(-1)), seg.options, dtype)
        return rows.view(*ids.shape, self.embedding_dim)


def fp8_rowwise_linears(model: nn.Module, keep, kept_rows=float_rows) -> int:
    """Replace, in place, each dense `Linear` of `model` whose weight's name `keep(name)` accepts by an fp8 rowwise
    `QuantLinear` (per-channel scales from its weight; computes in the weight's dtype), its first
    `kept_rows(name, rows)` rows left in that dtype (the recipe's q and k rows). For weights already in memory: the
    control net, and the measurements that put other layers in fp8; the DiT loader quantizes while it reads.
    Returns how many were replaced."""
    chosen = [(name, module) for name, module in model.named_modules()
              if isinstance(module, Linear) and not isinstance(module, StoredLinear)
              and keep(f"{name}.weight")]
    for name, module in chosen:
        rows = kept_rows(f"{name}.weight", module.weight.shape[0])
        parent, _, leaf = name.rpartition(".")
        layer = QuantLinear.fp8_rowwise_from_dense(module.weight, module.weight.dtype, rows)
        layer.adapters = module.adapters
        setattr(model.get_submodule(parent) if parent else model, leaf, layer)
    return len(chosen)


def set_gemm(model: nn.Module, setting: str) -> None:
    """Set `gemm` ("auto", "kernel", "dequantize") on every quantized Linear of `model`."""
    if setting not in GEMM_MODES:
        raise ValueError(f"quantized GEMM must be one of {', '.join(GEMM_MODES)}, got {setting!r}")
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.gemm = setting


def gemm_summary(model: nn.Module, device) -> dict[str, str]:
    """{format: "kernel", "dequantize" or "kernel/dequantize"} over the quantized Linears of `model` on `device`:
    what they run (for the run report); empty for a model without quantized layers."""
    seen: dict[str, set] = {}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            for fmt, mode in module.gemm_modes(device).items():
                seen.setdefault(fmt, set()).add(mode)
    return {fmt: "/".join(sorted(modes)) for fmt, modes in sorted(seen.items())}
