"""The fp8 rowwise format the DiT loader makes itself (`fp8_e4m3fn_fast`), and the lookup every quantized layer
uses: a format by the name its layer carries, and which GEMM it runs on a device (the formats a file may name are
formats.py's `FORMATS`)."""

import torch
import torch.nn.functional as F

from .fast_gemm import fp8_rowwise_linear, scaled_mm_runs_on
from .formats import FLOAT, FORMATS, Format
from .quant_tables import by_table, byte_table


class FP8Rowwise(Format):
    """The DiT loader's `fp8_e4m3fn_fast`: fp8 e4m3 weights with one fp32 scale per output channel `(N, 1)`, set at
    load (never named by a file). Kernel: `torch._scaled_mm` with the activations quantized per row on each call
    (fast_gemm.py), where the device has fp8 GEMMs; elsewhere the weight is dequantized before a plain GEMM."""

    name, label, weight_dtypes = "float8_e4m3fn_rowwise", "fp8 rowwise", ("F8_E4M3",)
    own_gemm, needs_kitchen = True, False
    required = ("weight_scale",)
    row_axes = {"weight": 0, "weight_scale": 0}
    element_bytes, row_bytes = 1.0, 4

    def dequantize(self, t, options, dtype):
        weight = t["weight"]
        values = by_table(weight, byte_table("fp8", torch.float32, weight.device))
        return values.mul_(t["weight_scale"].float()).to(dtype)

    def uses_kernel(self, device, options):
        return scaled_mm_runs_on(device)

    def kernel_runs_on(self, device):
        return scaled_mm_runs_on(device)

    def project(self, x, t, options, mode, shared=None):
        if mode == "kernel":
            return fp8_rowwise_linear(x, t["weight"], t["weight_scale"], shared)
        return F.linear(x, self.dequantize(t, options, x.dtype))



#: Formats the pack makes itself at load (no file names them, so the loader's checks never accept them).
OWN_FORMATS: dict[str, Format] = {fmt.name: fmt for fmt in (FP8Rowwise(),)}


def format_of(name: str) -> Format:
    return FLOAT if name == "float" else FORMATS[name] if name in FORMATS else OWN_FORMATS[name]


def gemm_mode(fmt: Format, options: dict, device: torch.device, setting: str = "auto") -> str:
    """What a layer of `fmt` runs on `device`: "kernel" (the format's own GEMM) or "dequantize" (the dense rows and
    a plain GEMM). `setting` ("auto", "kernel", "dequantize") overrides the automatic choice; formats without a
    kernel, and layers marked full precision, always dequantize."""
    if not fmt.own_gemm or options.get("full_precision"):
        return "dequantize"
    if setting == "dequantize":
        return setting
    if setting == "kernel" and fmt.kernel_runs_on(device):
        return setting
    return "kernel" if fmt.uses_kernel(device, options) else "dequantize"
