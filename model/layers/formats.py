"""The weight formats of ComfyUI's per-layer quantized files, one object each, in one table (`FORMATS`).

Each format says everything the pack needs to know about it, and nothing else does:
- what the file stores (`weight_dtypes`, `packed`: logical inputs per stored column, the `required` and
  `optional` roles next to `L.weight`) and `check`: the header checks of one layer (shapes and dtypes of its
  scales, its JSON options), which the loader (loaders/kitchen.py) runs before any weight is read;
- `cut`: a layer's tensors cut to a range of its rows (`row_axes`: the axis of each role that runs along the
  rows; None for whole-tensor values), so fused layers and the DiT's row-range calls work;
- `dequantize` (the rows as a dense weight, by comfy-kitchen's own dequantization where it has one) and
  `project` (`x @ W.T` for those rows: the format's own kernel where it pays, else the dequantized weight and a
  plain GEMM);
- `needs_kitchen` (whether comfy-kitchen must be installed to run it at all), `kernel` (the comfy-kitchen op whose
  backends the loader asks about);
- for the memory planner: `label` (the short name in reports), `element_bytes` and `row_bytes` (stored bytes
  per weight element and per output row).

int8 GEMMs are fast only where tensor cores run them (CUDA); on a CPU or Apple's MPS comfy-kitchen's eager int8
GEMM is ~40x slower than a float GEMM. `int8_kernels(device)` is that rule; a layer's `gemm` setting ("auto",
"kernel", "dequantize") overrides it, and `gemm_mode` says what a layer runs on a device.

comfy-kitchen is imported lazily (`kitchen()`), only by formats that need it, when a layer first runs. fp8,
NVFP4 and MXFP8 are dequantized in plain torch by comfy-kitchen's formulas (tests/test_quantized.py checks them
bit for bit against its own dequantization): its eager dequantization costs a CPU 30-60% of the GEMM it feeds.
"""

import torch
import torch.nn.functional as F

from .fast_gemm import int8_engine, int_mm_linear
from .quant_tables import by_table, byte_table, power_of_4, rotate_inputs, unswizzle

INSTALL = ("Install it with `pip install \"comfy-kitchen>=0.2.31\"` (inside ComfyUI: with ComfyUI's own python; "
           "current ComfyUI lists it in its requirements) and restart ComfyUI.")
FLOATS = ("F32", "F16", "BF16")  # stored dtypes a scale may have
GEMM_MODES = ("auto", "kernel", "dequantize")


def kitchen(what: str = "Quantized weights"):
    """comfy-kitchen, imported on first use (an ImportError saying how to install it when it is missing)."""
    try:
        import comfy_kitchen
    except ImportError as error:
        raise ImportError(f"{what} run through the comfy-kitchen package, which cannot be imported ({error}). "
                          f"{INSTALL}") from None
    return comfy_kitchen


def kitchen_installed() -> bool:
    """Whether comfy-kitchen can be imported (asked before choosing a GEMM only it has)."""
    try:
        kitchen()
    except ImportError:
        return False
    return True


def int8_kernels(device: torch.device) -> bool:
    """Whether int8 GEMM kernels are worth running on `device` (CUDA); elsewhere dequantizing is faster."""
    return torch.device(device).type == "cuda"


def blackwell(device: torch.device) -> bool:
    """Whether `device` is an NVIDIA GPU with FP4/MX tensor cores (compute capability 10.0 or newer)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (10, 0)


class Format:
    """One stored weight format (see the module docstring). Subclasses set the attributes and override
    `check`, `dequantize` and, where they have a kernel, `project`."""

    name = ""
    label = ""
    weight_dtypes: tuple = ()
    packed = 1
    required: tuple = ()
    optional: tuple = ()
    row_axes: dict = {"weight": 0}
    needs_kitchen = True
    kernel: str | None = None  # the comfy-kitchen op the loader asks its backends about
    own_gemm = False  # whether `project` has a GEMM of its own (else it always dequantizes)
    element_bytes = 2.0
    row_bytes = 0
    embedding = False  # may hold a text encoder's token table

    def check(self, layer, rows: int, inputs: int) -> dict:
        """The layer's options, after checking its scales (`layer`: the loader's checker, with `expect`, `fail`,
        `option`, `int_option`, `has` and `show`)."""
        return {}

    def cut(self, tensors: dict, rows: int, first: int, last: int, index: torch.Tensor | None = None) -> dict:
        """`tensors` cut to rows `[first, last)` (or gathered at `index`); whole-tensor values as they are."""
        out = {}
        for role, tensor in tensors.items():
            axis = self.row_axes.get(role)
            if axis is not None and tensor.dim() > axis and tensor.shape[axis] == rows:
                if index is not None:
                    tensor = tensor.index_select(axis, index)
                elif (first, last) != (0, rows):
                    tensor = tensor.narrow(axis, first, last - first)
            out[role] = tensor
        return out

    def dequantize(self, t: dict, options: dict, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def project(self, x: torch.Tensor, t: dict, options: dict, mode: str, shared: dict | None = None) -> torch.Tensor:
        """`x @ W.T` for the rows in `t`, in `x`'s dtype; `mode` "kernel" or "dequantize" (see `gemm_mode`);
        `shared`: a dict the row segments of one call share (for work on `x` they all need)."""
        return F.linear(x, self.dequantize(t, options, x.dtype))

    def uses_kernel(self, device: torch.device, options: dict) -> bool:
        """Whether `project` runs the format's own GEMM on `device` in "auto" mode."""
        return False

    def kernel_runs_on(self, device: torch.device) -> bool:
        """Whether the format's own GEMM can run on `device` at all (asked when a setting forces it)."""
        return True


class Float(Format):
    """Rows a quantized file keeps in a float dtype (one of a fused layer's tensors left unquantized)."""

    name, label = "float", "float"
    needs_kitchen = False

    def dequantize(self, t, options, dtype):
        weight = t["weight"]
        return weight if weight.dtype == dtype else weight.to(dtype)


class FP8(Format):
    """`float8_e4m3fn` / `float8_e5m2`: one fp32 scale per tensor, `W = q.to(dtype) * scale`; weight-only (the GEMM
    runs in the compute dtype, as ComfyUI does without fp8 matmuls). Plain torch: no comfy-kitchen needed. The DiT
    loader's own fp8 option stores the same layer without a scale (the plain cast)."""

    label, needs_kitchen, element_bytes, embedding = "fp8", False, 1.0, True
    optional = ("weight_scale", "input_scale")

    def __init__(self, name: str, stored: str, dtype: torch.dtype, label: str):
        self.name, self.weight_dtypes, self.dtype, self.label = name, (stored,), dtype, label

    def check(self, layer, rows, inputs):
        if not layer.has("weight_scale"):
            layer.fail(f"the {self.name} layer {layer.name} has no {layer.name}.weight_scale")
        layer.expect("weight_scale", FLOATS, ((), (1,)), "one fp32 scale for the whole tensor")
        if layer.has("input_scale"):
            layer.expect("input_scale", FLOATS, ((), (1,)), "one fp32 input scale")
        return {}

    def dequantize(self, t, options, dtype):
        weight = t["weight"]
        kind = "fp8" if self.dtype == torch.float8_e4m3fn else "fp8_e5m2"
        weight = by_table(weight, byte_table(kind, dtype, weight.device)) if weight.dim() == 2 else weight.to(dtype)
        scale = t.get("weight_scale")
        return weight if scale is None else weight.mul_(scale.reshape(()).to(dtype))


class Int8(Format):
    """`int8_tensorwise`, ConvRot or not: one scale per tensor or per row. Kernel: comfy-kitchen's `int8_linear`
    (activations quantized per row, W8A8). Dequantized: `q * scale`, the ConvRot rotation applied to the inputs."""

    name, label, weight_dtypes, kernel, embedding = "int8_tensorwise", "int8", ("I8",), "int8_linear", True
    own_gemm = True
    required = ("weight_scale",)
    row_axes = {"weight": 0, "weight_scale": 0}
    element_bytes, row_bytes = 1.0, 4

    def check(self, layer, rows, inputs):
        layer.expect("weight_scale", FLOATS, ((), (1,), (rows, 1), (rows,)),
                     f"one fp32 scale for the tensor or one per row ({rows})")
        options = {"convrot": bool(layer.option("convrot", False)),
                   "convrot_groupsize": layer.int_option("convrot_groupsize", 256)}
        if options["convrot"] and (not power_of_4(options["convrot_groupsize"])
                                   or inputs % options["convrot_groupsize"]):
            layer.fail(f"{layer.name} has convrot_groupsize {options['convrot_groupsize']}, which must be a power of "
                       f"4 dividing its {inputs} inputs")
        return options

    def _params(self, t, options, dtype):
        from comfy_kitchen.tensor import TensorWiseINT8Layout

        return TensorWiseINT8Layout, TensorWiseINT8Layout.Params(
            scale=t["weight_scale"], orig_dtype=dtype, orig_shape=tuple(t["weight"].shape),
            convrot=options["convrot"], convrot_groupsize=options["convrot_groupsize"])

    def dequantize(self, t, options, dtype):
        kitchen()
        layout, params = self._params(t, options, dtype)
        return layout.dequantize(t["weight"], params)

    def uses_kernel(self, device, options):
        return int8_kernels(device)

    def project(self, x, t, options, mode, shared=None):
        if mode == "kernel" and int8_engine(x.device) == "int_mm":
            if options["convrot"]:
                x = rotate_inputs(x, options["convrot_groupsize"], shared)
            return int_mm_linear(x, t["weight"], t["weight_scale"])
        if mode == "kernel":
            return kitchen().int8_linear(x, t["weight"], t["weight_scale"], out_dtype=x.dtype,
                                         convrot=options["convrot"], convrot_groupsize=options["convrot_groupsize"])
        scale = t["weight_scale"].to(x.dtype)
        weight = t["weight"].to(x.dtype).mul_(scale.reshape(-1, 1) if scale.dim() else scale)
        if options["convrot"]:
            x = rotate_inputs(x, options["convrot_groupsize"], shared)
        return F.linear(x, weight)

    def embed(self, t, options, ids, dtype):
        """Rows `ids` of a token table: gathered first, then scaled and un-rotated (comfy-kitchen's own)."""
        kitchen()
        layout, params = self._params(t, options, dtype)
        return layout.dequantize_embedding(t["weight"], params, ids)


class W4A8(Format):
    """`asym_w4a8_int8`: two 4-bit codes per byte (a 16-level codebook, or `code - 8`), fp8 group scales, fp32
    channel scales, optional corrections, ConvRot-rotated. Kernel: comfy-kitchen's `w4a8_int8_linear` (int8
    activations). Dequantized: the codes decoded to the int8 grid the kernel uses (codebook value x group scale,
    rounded), times the channel scale plus the correction, the rotation applied to the inputs."""

    name, label, weight_dtypes, packed, kernel = "asym_w4a8_int8", "w4a8", ("I8",), 2, "w4a8_int8_linear"
    own_gemm = True
    required = ("weight_s_rel", "weight_s_channel")
    optional = ("weight_codebook", "weight_correction")
    row_axes = {"weight": 0, "weight_s_rel": 0, "weight_s_channel": 0, "weight_correction": 1}
    element_bytes, row_bytes = 0.5 + 1 / 16, 4

    def check(self, layer, rows, inputs):
        group, rotation = layer.int_option("group_size", 16), layer.int_option("convrot_groupsize", 256)
        if group < 4 or (16 % group and group % 16) or inputs % 16 or inputs % group or not power_of_4(rotation) \
                or inputs % rotation:
            layer.fail(f"{layer.name} ({inputs} inputs) has group_size {group} and convrot_groupsize {rotation}; "
                       "W4A8 needs inputs divisible by 16, by the group size (4 or more, dividing 16 or a multiple of "
                       "16) and by the rotation size (a power of 4)")
        groups = inputs // group
        layer.expect("weight_s_rel", ("F8_E4M3", "U8", "F32"), ((rows, groups),),
                     f"fp8 or fp32 group scales of shape [{rows}, {groups}]")
        layer.expect("weight_s_channel", ("F32",), ((rows,),), f"fp32 channel scales of shape [{rows}]")
        if layer.has("weight_codebook"):
            layer.expect("weight_codebook", ("F32",), ((16,),), "a 16-level fp32 codebook")
        if layer.has("weight_correction"):
            layer.expect("weight_correction", FLOATS, ((groups, rows),), f"corrections of shape [{groups}, {rows}]")
        return {"group_size": group, "convrot_groupsize": rotation}

    def dequantize(self, t, options, dtype):
        return kitchen().dequantize_w4a8_int8_weight(
            t["weight"], t["weight_s_rel"], t["weight_s_channel"], codebook=t.get("weight_codebook"),
            correction=t.get("weight_correction"), group_size=options["group_size"],
            convrot_groupsize=options["convrot_groupsize"], output_dtype=dtype)

    def uses_kernel(self, device, options):
        return int8_kernels(device)

    def project(self, x, t, options, mode, shared=None):
        if mode == "kernel":
            correction = t.get("weight_correction")
            return kitchen().w4a8_int8_linear(
                x, t["weight"], t["weight_s_rel"], t["weight_s_channel"], codebook=t.get("weight_codebook"),
                correction=None if correction is None else correction.contiguous(),
                group_size=options["group_size"], convrot_groupsize=options["convrot_groupsize"], out_dtype=x.dtype)
        rotated = rotate_inputs(x, options["convrot_groupsize"], shared)
        return F.linear(rotated, self.rotated_weight(t, options, x.dtype))

    @staticmethod
    def rotated_weight(t, options, dtype):
        """The weight before its rotation, in `dtype`: what the int8 kernel multiplies, as floats."""
        packed = t["weight"]
        rows, half = packed.shape
        codebook = t.get("weight_codebook")
        levels = torch.arange(16, dtype=torch.float32) - 8.0 if codebook is None else codebook
        table = byte_table("nibbles", torch.float32, packed.device, levels)  # low nibble first
        group = options["group_size"]
        s_rel = t["weight_s_rel"]
        s_rel = by_table(s_rel, byte_table("fp8", torch.float32, s_rel.device)) if s_rel.dtype != torch.float32 \
            else s_rel
        grid = by_table(packed, table).view(rows, -1, group).mul_(s_rel.unsqueeze(-1)).round_()
        # the int8 grid's clamp, a no-op for most layers: eagerly skipped when the bound shows it, always applied in a
        # compiled block (the test reads two values on the host, a graph break there; fused, the clamp costs nothing)
        if torch.compiler.is_compiling() or float(levels.abs().max()) * float(s_rel.abs().max()) > 127:
            grid = grid.clamp_(-127, 127)
        weight = grid.mul_(t["weight_s_channel"].float().view(rows, 1, 1))
        correction = t.get("weight_correction")
        if correction is not None:
            weight += correction.t().unsqueeze(-1).float()
        return weight.view(rows, 2 * half).to(dtype)


class W4A4(Format):
    """`convrot_w4a4`: int4 weights and activations, per-row scales (comfy-kitchen's `convrot_w4a4_linear`, where
    one of its backends has it; the loader refuses the file otherwise)."""

    name, label, weight_dtypes, packed, kernel = "convrot_w4a4", "w4a4", ("I8",), 2, "convrot_w4a4_linear"
    own_gemm = True
    required = ("weight_scale",)
    row_axes = {"weight": 0, "weight_scale": 0}
    element_bytes, row_bytes = 0.5, 4

    def check(self, layer, rows, inputs):
        layer.expect("weight_scale", FLOATS, ((rows,), (rows, 1)), f"one scale per row ({rows})")
        rotation = layer.int_option("convrot_groupsize", 256)
        options = {"convrot_groupsize": rotation, "quant_group_size": layer.int_option("quant_group_size", 64),
                   "linear_dtype": layer.option("linear_dtype", "int4")}
        if options["quant_group_size"] != 64 or options["linear_dtype"] not in ("int4", "int8") \
                or not power_of_4(rotation) or inputs % rotation or inputs % 64:
            layer.fail(f"{layer.name} ({inputs} inputs) has convrot_groupsize {rotation}, quant_group_size "
                       f"{options['quant_group_size']} and linear_dtype {layer.show(options['linear_dtype'])}; ConvRot "
                       "W4A4 "
                       "needs groups of 64, int4 or int8, and a power-of-4 rotation dividing the inputs")
        return options

    def dequantize(self, t, options, dtype):
        return kitchen().dequantize_convrot_w4a4_weight(t["weight"], t["weight_scale"].reshape(-1),
                                                        options["convrot_groupsize"], options["quant_group_size"],
                                                        dtype)

    def uses_kernel(self, device, options):
        return True  # the format's whole point; dequantizing keeps only its weight savings

    def project(self, x, t, options, mode, shared=None):
        if mode == "dequantize":
            return super().project(x, t, options, mode, shared)
        out = kitchen().convrot_w4a4_linear(x, t["weight"], t["weight_scale"].reshape(-1),
                                            convrot_groupsize=options["convrot_groupsize"],
                                            quant_group_size=options["quant_group_size"],
                                            linear_dtype=options["linear_dtype"])
        return out.to(x.dtype)


class BlockScaled(Format):
    """What NVFP4 and MXFP8 share: block scales stored in cuBLAS's swizzled layout (tiles of 128 rows x 4 blocks,
    each tile contiguous), so a row range is cut at whole 128-row tiles, dequantized, then narrowed. Their
    tensor-core GEMMs need a Blackwell GPU (`blackwell`); elsewhere each layer is dequantized right before its
    GEMM by comfy-kitchen's own dequantization (what ComfyUI does there)."""

    TILE = 128
    block = 16
    row_axes = {"weight": 0}
    own_gemm = True

    def check_blocks(self, layer, rows, inputs, scale_dtypes):
        if rows % 16 or inputs % 32:
            layer.fail(f"{layer.name} is [{rows}, {inputs}]; a {self.name} weight this pack runs has rows in multiples "
                       "of 16 and inputs in multiples of 32 (a padded layer)")
        tiles = (-(-rows // self.TILE) * self.TILE, -(-(inputs // self.block) // 4) * 4)
        layer.expect("weight_scale", scale_dtypes, (tiles,),
                     f"block scales in the swizzled layout, shape [{tiles[0]}, {tiles[1]}]")
        if layer.has("input_scale"):
            layer.expect("input_scale", FLOATS, ((), (1,)), "one fp32 input scale")
        if layer.has("pre_quant_scale"):
            layer.expect("pre_quant_scale", FLOATS, ((inputs,),), f"one smoothing scale per input ({inputs})")

    def cut(self, tensors, rows, first, last, index=None):
        if index is not None:
            raise ValueError(f"{self.name} layers are Linear weights only")
        out = dict(tensors)
        if (first, last) == (0, rows):
            return out
        lo = first // self.TILE * self.TILE
        hi = min(rows, -(-last // self.TILE) * self.TILE)
        out["weight"] = tensors["weight"][lo:hi]
        out["weight_scale"] = tensors["weight_scale"][lo : -(-hi // self.TILE) * self.TILE]
        if (first, last) != (lo, hi):
            out["_narrow"] = (first - lo, last - first)  # what to keep of the dequantized tiles
        return out

    def dequantize(self, t, options, dtype):
        """The rows as a dense weight, AWQ-style input smoothing (`pre_quant_scale`) folded into its columns, so
        `x @ W.T` is the layer's output."""
        dense = self.dequantize_tiles(t, dtype)
        if "_narrow" in t:
            dense = dense.narrow(0, *t["_narrow"])
        smooth = t.get("pre_quant_scale")
        return dense if smooth is None else dense * smooth.to(dtype)

    def dequantize_tiles(self, t, dtype):
        raise NotImplementedError

    def uses_kernel(self, device, options):
        return self.kernel_runs_on(device)

    def kernel_runs_on(self, device):
        return blackwell(device) and kitchen_installed()

    def project(self, x, t, options, mode, shared=None):
        if mode == "kernel" and "_narrow" not in t and x.dtype in (torch.bfloat16, torch.float16):
            smooth = t.get("pre_quant_scale")
            if smooth is not None:  # AWQ-style smoothing of the inputs before they are quantized
                x = x * smooth.to(x.dtype)
            flat = x.reshape(-1, x.shape[-1])
            return self.tensor_core_linear(flat, t, x.dtype).reshape(*x.shape[:-1], -1)
        return F.linear(x, self.dequantize(t, options, x.dtype))

    def tensor_core_linear(self, x, t, dtype):
        raise NotImplementedError


class NVFP4(BlockScaled):
    """`nvfp4`: E2M1 values, two per byte (even input in the high nibble), an fp8 scale per 16 inputs (swizzled) and
    an fp32 global scale `weight_scale_2`; `W = value x block scale x global scale`."""

    name, label, weight_dtypes, packed, kernel = "nvfp4", "nvfp4", ("U8",), 2, "dequantize_nvfp4"
    required = ("weight_scale", "weight_scale_2")
    optional = ("input_scale", "pre_quant_scale")
    element_bytes = 0.5 + 1 / 16

    def check(self, layer, rows, inputs):
        self.check_blocks(layer, rows, inputs, ("F8_E4M3", "U8"))
        layer.expect("weight_scale_2", FLOATS, ((), (1,)), "one fp32 global scale")
        return {}

    needs_kitchen = False  # dequantized in torch; only the Blackwell GEMM needs comfy-kitchen

    def dequantize_tiles(self, t, dtype):
        """comfy-kitchen's `dequantize_nvfp4` formula, by table: value x (global scale x block scale), in `dtype`."""
        weight = t["weight"]
        rows, inputs = weight.shape[0], weight.shape[1] * 2
        blocks = unswizzle(t["weight_scale"].view(torch.float8_e4m3fn), rows, inputs // 16)
        scale = t["weight_scale_2"].reshape(()).to(dtype) * blocks.to(dtype)
        values = by_table(weight, byte_table("e2m1", dtype, weight.device))
        return values.view(rows, -1, 16).mul_(scale.unsqueeze(-1)).view(rows, inputs)

    def tensor_core_linear(self, x, t, dtype):
        ck = kitchen()
        scale = t.get("input_scale")
        scale = (x.abs().amax().float() / (448.0 * 6.0)) if scale is None else scale.reshape(()).float()
        pad = (-x.shape[0]) % 16
        xq, x_blocks = ck.quantize_nvfp4(F.pad(x, (0, 0, 0, pad)) if pad else x, scale)
        out = ck.scaled_mm_nvfp4(xq, t["weight"], tensor_scale_a=scale,
                                 tensor_scale_b=t["weight_scale_2"].reshape(()).float(), block_scale_a=x_blocks,
                                 block_scale_b=t["weight_scale"].view(torch.float8_e4m3fn), out_dtype=dtype)
        return out[: x.shape[0]]


class MXFP8(BlockScaled):
    """`mxfp8`: fp8 e4m3 values with a power-of-two (E8M0) scale per 32 inputs (swizzled)."""

    name, label, weight_dtypes, kernel = "mxfp8", "mxfp8", ("F8_E4M3",), "dequantize_mxfp8"
    required = ("weight_scale",)
    optional = ("input_scale",)
    block, element_bytes = 32, 1 + 1 / 32

    def check(self, layer, rows, inputs):
        self.check_blocks(layer, rows, inputs, ("U8", "F8_E8M0"))
        return {}

    needs_kitchen = False  # dequantized in torch; only the Blackwell GEMM needs comfy-kitchen

    def dequantize_tiles(self, t, dtype):
        """comfy-kitchen's `dequantize_mxfp8` formula, by table: fp32 value x 2^(scale byte - 127), then `dtype`."""
        weight = t["weight"]
        rows, inputs = weight.shape
        exponents = unswizzle(t["weight_scale"].view(torch.uint8), rows, inputs // 32).int()
        scale = torch.where(exponents == 0, 0, exponents << 23).view(torch.float32)  # E8M0 -> fp32, 0 for byte 0
        values = by_table(weight, byte_table("fp8", torch.float32, weight.device))
        return values.view(rows, -1, 32).mul_(scale.unsqueeze(-1)).view(rows, inputs).to(dtype)

    def tensor_core_linear(self, x, t, dtype):
        ck = kitchen()
        pad = (-x.shape[0]) % 32
        xq, x_blocks = ck.quantize_mxfp8(F.pad(x, (0, 0, 0, pad)) if pad else x)
        out = ck.scaled_mm_mxfp8(xq, t["weight"], x_blocks, t["weight_scale"].view(torch.float8_e8m0fnu),
                                 out_dtype=dtype)
        return out[: x.shape[0]]


FP8_FORMATS = {"float8_e4m3fn": FP8("float8_e4m3fn", "F8_E4M3", torch.float8_e4m3fn, "fp8"),
               "float8_e5m2": FP8("float8_e5m2", "F8_E5M2", torch.float8_e5m2, "fp8 e5m2")}
#: Every format a quantized file may name, by its `comfy_quant` "format".
FORMATS: dict[str, Format] = {fmt.name: fmt for fmt in (Int8(), *FP8_FORMATS.values(), W4A8(), W4A4(), NVFP4(),
                                                       MXFP8())}
FLOAT = Float()
