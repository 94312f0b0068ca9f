"""The layers of ComfyUI's per-layer quantized checkpoints: `QuantLinear` (a `linear.StoredLinear`, so LoRA adapters
and the DiT's row-range calls work unchanged) and `QuantEmbedding`, each file tensor one segment in its stored
dtype with its own scales, run through comfy-kitchen's kernels (imported lazily, on first use). What the files hold
and how they are checked before any weight is read: `loaders/kitchen.py`.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .linear import StoredLinear, row_overlaps

FP8_DTYPES = {"float8_e4m3fn": ("F8_E4M3", torch.float8_e4m3fn), "float8_e5m2": ("F8_E5M2", torch.float8_e5m2)}
INSTALL = ("Install it with `pip install \"comfy-kitchen>=0.2.31\"` (inside ComfyUI: with ComfyUI's own python; "
           "current ComfyUI lists it in its requirements) and restart ComfyUI.")
# The axis of each role that runs along the weight's rows (None: one value for the whole tensor).
ROW_AXIS = {"weight": 0, "weight_scale": 0, "input_scale": None, "weight_s_rel": 0, "weight_s_channel": 0,
            "weight_codebook": None, "weight_correction": 1}


def kitchen(what: str = "Quantized weights"):
    """comfy-kitchen, imported on first use (an ImportError saying how to install it when it is missing)."""
    try:
        import comfy_kitchen
    except ImportError as error:
        raise ImportError(f"{what} run through the comfy-kitchen package, which cannot be imported ({error}). "
                          f"{INSTALL}") from None
    return comfy_kitchen


# -- running a segment ------------------------------------------------------------------------------------------
def _dequantize(fmt: str, t: dict, options: dict, dtype: torch.dtype) -> torch.Tensor:
    """The rows in `t` (each role already cut to them) as a dense `dtype` weight, by comfy-kitchen's own code."""
    if fmt == "float":
        weight = t["weight"]
        return weight if weight.dtype == dtype else weight.to(dtype)
    ck = kitchen()
    rows = tuple(t["weight"].shape)
    if fmt == "int8_tensorwise":
        from comfy_kitchen.tensor import TensorWiseINT8Layout

        params = TensorWiseINT8Layout.Params(scale=t["weight_scale"], orig_dtype=dtype, orig_shape=rows,
                                             convrot=options["convrot"],
                                             convrot_groupsize=options["convrot_groupsize"])
        return TensorWiseINT8Layout.dequantize(t["weight"], params)
    if fmt in FP8_DTYPES:
        return ck.dequantize_per_tensor_fp8(t["weight"], t["weight_scale"].reshape(()), dtype)
    if fmt == "asym_w4a8_int8":
        return ck.dequantize_w4a8_int8_weight(
            t["weight"], t["weight_s_rel"], t["weight_s_channel"], codebook=t.get("weight_codebook"),
            correction=t.get("weight_correction"), group_size=options["group_size"],
            convrot_groupsize=options["convrot_groupsize"], output_dtype=dtype)
    if fmt == "convrot_w4a4":
        return ck.dequantize_convrot_w4a4_weight(t["weight"], t["weight_scale"].reshape(-1),
                                                 options["convrot_groupsize"], options["quant_group_size"], dtype)
    raise ValueError(f"unknown quantized format {fmt!r}")


def _project(fmt: str, x: torch.Tensor, t: dict, options: dict) -> torch.Tensor:
    """`x @ W.T` for the rows in `t`, in `x`'s dtype, by the format's comfy-kitchen kernel."""
    if fmt == "float" or options.get("full_precision") or fmt in FP8_DTYPES:
        return F.linear(x, _dequantize(fmt, t, options, x.dtype))
    ck = kitchen()
    if fmt == "int8_tensorwise":
        return ck.int8_linear(x, t["weight"], t["weight_scale"], out_dtype=x.dtype, convrot=options["convrot"],
                              convrot_groupsize=options["convrot_groupsize"])
    if fmt == "asym_w4a8_int8":
        correction = t.get("weight_correction")
        return ck.w4a8_int8_linear(
            x, t["weight"], t["weight_s_rel"], t["weight_s_channel"], codebook=t.get("weight_codebook"),
            correction=None if correction is None else correction.contiguous(), group_size=options["group_size"],
            convrot_groupsize=options["convrot_groupsize"], out_dtype=x.dtype)
    if fmt == "convrot_w4a4":
        out = ck.convrot_w4a4_linear(x, t["weight"], t["weight_scale"].reshape(-1),
                                     convrot_groupsize=options["convrot_groupsize"],
                                     quant_group_size=options["quant_group_size"],
                                     linear_dtype=options["linear_dtype"])
        return out.to(x.dtype)
    raise ValueError(f"unknown quantized format {fmt!r}")


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
        """The segment's tensors cut to its rows `[first, last)` (or gathered at `index`); whole-tensor scales as
        they are."""
        rows = seg.end - seg.start
        out = {}
        for role, name in seg.names.items():
            tensor = getattr(self, name)
            axis = ROW_AXIS.get(role)
            if axis is not None and tensor.dim() > axis and tensor.shape[axis] == rows:
                if index is not None:
                    tensor = tensor.index_select(axis, index)
                elif (first, last) != (0, rows):
                    tensor = tensor.narrow(axis, first, last - first)
            out[role] = tensor
        return out

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
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__(in_features, out_features, dtype)
        self.bias = None

    def project(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        pieces = [_project(seg.fmt, x, self._tensors(seg, first, last), seg.options)
                  for seg, first, last in self._pieces(start, end)]
        if not pieces:
            out = x.new_empty(*x.shape[:-1], 0)
        else:
            out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
        if self.bias is not None:
            out = out + self.bias[start:end].to(out.dtype)
        return out

    def weight_rows(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        pieces = [_dequantize(seg.fmt, self._tensors(seg, first, last), seg.options, dtype)
                  for seg, first, last in self._pieces(start, end)]
        if not pieces:
            device = getattr(self, self.segments[0].names["weight"]).device
            return torch.empty(0, self.in_features, dtype=dtype, device=device)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    @classmethod
    def from_fp8(cls, weight: torch.Tensor, compute: torch.dtype) -> "QuantLinear":
        """The DiT loader's `weight_dtype = fp8_e4m3fn` on a float file: `weight` already rounded to fp8 with scale
        1 (the plain cast), run through the same fp8 path as an fp8 file's layers."""
        layer = cls(weight.shape[1], weight.shape[0], compute)
        scale = torch.ones((), dtype=torch.float32, device=weight.device)
        layer.add_segment("float8_e4m3fn", {"weight": weight, "weight_scale": scale}, {"full_precision": False},
                          names={"weight": "weight", "weight_scale": "weight_scale"})
        return layer


class QuantEmbedding(_Segmented):
    """A token table stored in int8 (`int8_tensorwise`, ConvRot or not) or fp8: the ids' rows are gathered first and
    only those are dequantized (comfy-kitchen's `dequantize_embedding` for int8, which also un-rotates them).

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
        t = self._tensors(seg, 0, seg.end)
        dtype = self._logical.dtype
        if seg.fmt == "int8_tensorwise":
            kitchen()
            from comfy_kitchen.tensor import TensorWiseINT8Layout

            params = TensorWiseINT8Layout.Params(scale=t["weight_scale"], orig_dtype=dtype,
                                                 orig_shape=tuple(t["weight"].shape), convrot=seg.options["convrot"],
                                                 convrot_groupsize=seg.options["convrot_groupsize"])
            return TensorWiseINT8Layout.dequantize_embedding(t["weight"], params, ids)
        flat = ids.reshape(-1)
        rows = _dequantize(seg.fmt, self._tensors(seg, 0, None, index=flat), seg.options, dtype)
        return rows.view(*ids.shape, self.embedding_dim)
