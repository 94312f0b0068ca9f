"""The quantized GEMMs that run faster than bf16 where a GPU has them: fp8 e4m3 with per-row scales (the DiT loader's
`fp8_e4m3fn_fast`) and int8 through `torch._int_mm` (a second engine for int8 ConvRot layers beside comfy-kitchen's).

fp8 recipe (torchao's float8 rowwise, not ComfyUI core's): the weight holds one fp32 scale per output channel
(`amax / 448`, set at load, or a scaled fp8 file's own scale), the activations one scale per row computed on every
call from that row's amax; `torch._scaled_mm(x_q, w_q.T, scale_a (M, 1), scale_b (1, N))` multiplies in fp8 and
writes bf16. Core's `fp8_e4m3fn_fast` instead clamps the activations to +-448 and casts them with a scale of 1, one
per tensor: Qwen's activations reach thousands in places and sit far below 1 in others, so both ends break (core
issues 9190, 11255; docs/measurements.md has the toy's numbers for both recipes).

Not every row goes to fp8: the query and key rows of each block's fused `qkv` projection stay in the compute dtype
(`float_rows`). Their products are the attention logits, which softmax turns into weights exponentially, so e4m3's
3-bit mantissa on those weights moves the attention: on the trained toy, the 5 pictures below 40 dB with every block
linear in fp8 went from 33.2-39.3 dB to 42.6-51.0 dB with q and k in bf16, while keeping to_out, gate_up or down in
bf16 instead raised the worst by 1-3.5 dB, and qkv computed from bf16 activations (weights still fp8) by 4: it is the
weights' rounding (docs/measurements.md).
q and k are 2/13 of a block's GEMM FLOPs; the value rows, to_out and the MLP (11/13) multiply in fp8.

fp8 GEMMs exist on NVIDIA GPUs of compute capability 8.9 and up (Ada, Hopper, Blackwell). `torch._scaled_mm` also runs
on a CPU, slowly; normal runs there (and on MPS, and older GPUs) dequantize the weight before a plain GEMM instead, and
the run report says so. `force_scaled_mm()` is the test seam that sends CPU runs through `_scaled_mm`, so the numerics
are checked here.

Pure torch: no comfy-kitchen needed.
"""

import re
from contextlib import contextmanager

import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0
_AMAX_FLOOR = 1e-12  # an all-zero row gets a tiny scale (its codes are all 0), not a division by zero
_forced = {"scaled_mm": False, "int8_engine": None}

# Which int8 GEMM an int8 layer's "kernel" mode runs on a CUDA device, by compute capability: "kitchen"
# (comfy-kitchen's `int8_linear`; its CUDA kernel is built for sm80 on every GPU) or "int_mm" (`torch._int_mm`,
# cuBLASLt's int8 GEMM, which has Hopper and Ada kernels). Entries come from measurement (benchmarks/gpu_check.py
# `fp8` section prints both per device); a capability without an entry keeps comfy-kitchen, today's path.
INT8_ENGINE_BY_CAPABILITY: dict[tuple[int, int], str] = {}
INT8_ENGINES = ("kitchen", "int_mm")

# the fused q/k/v projection of a DiT or control-net block (their parameter names; see `float_rows`)
_FUSED_QKV = re.compile(r"(?:.+\.)?blocks\.\d+\.qkv\.weight")


def float_rows(name: str, rows: int) -> int:
    """How many leading rows of the layer whose weight is named `name` (`rows` in all) the fp8 rowwise recipe keeps in
    the compute dtype: a block's fused qkv projection keeps its q and k rows (the first two thirds; see the module),
    every other layer none."""
    return 2 * rows // 3 if _FUSED_QKV.fullmatch(name) else 0


@contextmanager
def force_scaled_mm(on: bool = True):
    """Test seam: inside, `scaled_mm_runs_on` is `on` for every device, so a CPU runs fp8 layers through
    `torch._scaled_mm` (the numerics tests) or a GPU runs them dequantized (a reference)."""
    before = _forced["scaled_mm"]
    _forced["scaled_mm"] = on
    try:
        yield
    finally:
        _forced["scaled_mm"] = before


@contextmanager
def force_int8_engine(engine: str):
    """Test seam: inside, int8 layers in "kernel" mode run `engine` ("kitchen" or "int_mm") on every device."""
    if engine not in INT8_ENGINES:
        raise ValueError(f"int8 engine must be one of {', '.join(INT8_ENGINES)}, got {engine!r}")
    before = _forced["int8_engine"]
    _forced["int8_engine"] = engine
    try:
        yield
    finally:
        _forced["int8_engine"] = before


def scaled_mm_runs_on(device) -> bool:
    """Whether fp8 layers multiply through `torch._scaled_mm` on `device` (else they dequantize; see the module)."""
    forced = _forced["scaled_mm"]
    if forced is not False:
        return bool(forced)
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def int8_engine(device) -> str:
    """The int8 GEMM a layer's "kernel" mode runs on `device`: "kitchen" or "int_mm" (INT8_ENGINE_BY_CAPABILITY)."""
    if _forced["int8_engine"] is not None:
        return _forced["int8_engine"]
    device = torch.device(device)
    if device.type != "cuda":
        return "kitchen"
    return INT8_ENGINE_BY_CAPABILITY.get(torch.cuda.get_device_capability(device), "kitchen")


def quantize_rows(x: torch.Tensor, top: float = E4M3_MAX, dtype: torch.dtype = torch.float8_e4m3fn):
    """`x` (M, K) as codes of `dtype` with one fp32 scale per row `(M, 1)`: scale = row amax / `top`, codes =
    x / scale (rounded to nearest by the cast for fp8, by `round` for int8), so `codes * scale` approximates `x`."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(_AMAX_FLOOR)
    scale = amax / top
    scaled = x.float() / scale
    if dtype == torch.int8:
        return scaled.round_().clamp_(-128.0, 127.0).to(torch.int8), scale
    return scaled.clamp_(-top, top).to(dtype), scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight (N, K) as fp8 e4m3 codes with one fp32 scale per output channel `(N, 1)`."""
    return quantize_rows(weight)


def fp8_rowwise_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       shared: dict | None = None) -> torch.Tensor:
    """`x @ (weight * weight_scale).T` through `torch._scaled_mm`, `x` quantized per row on this call; in `x`'s
    dtype. `weight`: fp8 e4m3 (N, K) (row-major, so its transpose is the column-major operand `_scaled_mm` takes);
    `weight_scale`: fp32 (N, 1). `shared` keeps the quantized `x` for the other row segments of the same call."""
    flat = x.reshape(-1, x.shape[-1])
    if shared is not None and "fp8_rows" in shared:
        codes, scale = shared["fp8_rows"]
    else:
        codes, scale = quantize_rows(flat)
        if shared is not None:
            shared["fp8_rows"] = (codes, scale)
    # CUDA's rowwise kernel writes bf16 only; a CPU writes any float dtype (fp32 keeps the tests' comparison exact)
    out_dtype = torch.bfloat16 if x.device.type == "cuda" else x.dtype
    out = torch._scaled_mm(codes, weight.t(), scale_a=scale, scale_b=weight_scale.reshape(1, -1).float(),
                           out_dtype=out_dtype)
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def int_mm_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """W8A8 through `torch._int_mm`: `x` (already rotated for ConvRot) quantized per row to int8 as comfy-kitchen
    does it (amax / 127, rounded), times the int8 weight (N, K), int32 sums scaled by row scale x weight scale (one
    per tensor or per output channel); in `x`'s dtype. CUDA's `_int_mm` takes more than 16 rows and K, N in
    multiples of 8; smaller calls are padded with zero rows to 24."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    codes, scale = quantize_rows(flat, INT8_MAX, torch.int8)
    pad = 24 - rows if x.device.type == "cuda" and rows <= 16 else 0
    if pad:
        codes = torch.nn.functional.pad(codes, (0, 0, 0, pad))
    sums = torch._int_mm(codes, weight.t())[:rows]
    out = sums.float() * (scale * weight_scale.float().reshape(1, -1))
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
