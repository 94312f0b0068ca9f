"""Load the Qwen-Image 2.1 DiT from the files users have.

Two layouts (docs/checkpoints.md):
- ComfyUI single file (`qwen_image_2.1_bf16.safetensors`, `..._turbo_bf16...`): bare keys, or keys under
  `model.diffusion_model.`; each block's MLP is one fused `img_mlp.gate_up` [gate; up].
- diffusers folder (`Qwen-Image-2.1/` with `model_index.json`, or its `transformer/` folder): sharded
  safetensors with an index, split `img_mlp.gate_layer` / `img_mlp.proj`, `transformer/config.json`.
A GGUF file (ComfyUI names, quantized) is read by `gguf.py` with the shared key plan (`dit_keys.py`), config
inference and Base/Turbo rule.

Everything is decided from headers first (what the file is, its config, every tensor's shape and dtype),
so a bad file is refused before any weight is allocated. The model is then built on the meta device and
each parameter is filled straight from the file (tensor by tensor, through safetensors' lazy `safe_open` in
`checkpoint.WeightReader`), so at most one extra tensor is alive at a time. Finding the files, JSON, dtype
choice and tensor reading are the shared `checkpoint.py`; this module owns the DiT's detection, key map and
config inference.
"""

import math
import re
from dataclasses import replace
from pathlib import Path

import torch

from ..layers.fast_gemm import float_rows, quantize_weight
from ..layers.formats import GEMM_MODES
from ..layers.kitchen import QuantLinear, set_gemm
from ..transformer.dit import DiTConfig, QwenImage21DiT
from .checkpoint import (
    FILE_DTYPES,
    FLOAT_DTYPES,
    FP8_FILE_DTYPES,
    CheckpointError,
    WeightFiles,
    WeightReader,
    check_dtypes,
    choose_dtype,
    find_weights,
    quantization_marker,
    read_json,
    read_weight_headers,
    rename_keys,
)
from .deferred import FileWeights, materialize_on_input, placeholder
from .dit_keys import DiTSource, check_shapes, file_plan, infer_config, strip_prefix, variant_from_name
from .trained_for import read_trained_for

# What the DiT loads as; fp8_e4m3fn stores the FP8_PARAMS weights in fp8 and computes in bf16.
DTYPES = (*FLOAT_DTYPES, torch.float8_e4m3fn)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Linear weights stored in fp8 when asked: the block GEMMs (95% of the parameters). Embeddings, norms, the
# shared modulation table and the output head stay in bf16, as they steer every token. The same weights may
# already be fp8 in a file (plain fp8 releases, without scales); anything else must be a float type.
FP8_PARAMS = re.compile(r"blocks\.\d+\.(qkv|to_out|gate_up|down)\.weight")
# fp8_e4m3fn_fast also multiplies the FP8_PARAMS layers in fp8 (layers/fast_gemm.py), except the q and k rows of
# each fused qkv, which it keeps in the compute dtype (fast_gemm.float_rows); the layers above stay in bf16
# for the same reason, and fp8 GEMMs would buy nothing there (one row per sample for the modulation); on the toy,
# every Linear in fp8 cost 0.9 dB more (docs/measurements.md).
# It applies to float files and to fp8 files (their codes and scales used as they are), not to other quantized ones.
FP8_FAST = "fp8_e4m3fn_fast"
FP8_FILE_FORMATS = {"float8_e4m3fn", "float8_e5m2"}
DIFFUSERS_FOLDER = ("a diffusers Qwen-Image-2.1 folder (transformer/config.json + "
                    "diffusion_pytorch_model*.safetensors)")
# What to load when a quantized file cannot run here.
QUANTIZED_INSTEAD = ("qwen_image_2.1_int8_convrot.safetensors (qwen_image_2.1_turbo_int8_convrot for Turbo) or "
                     "the bf16 file")


def _config_from_json(path: Path, inferred: DiTConfig) -> DiTConfig:
    """Cross-check `transformer/config.json` with the shapes; it adds what shapes cannot say."""
    data = read_json(path, "transformer config.json")
    if data.get("_class_name", "QwenImage21Transformer2DModel") != "QwenImage21Transformer2DModel":
        raise CheckpointError(f"{path} describes a {data['_class_name']}, not a QwenImage21Transformer2DModel.")
    if data.get("patch_size", 1) != 1:
        raise CheckpointError(f"{path}: patch_size {data['patch_size']} (Qwen-Image 2.1 uses unpatched latents).")
    config = replace(
        inferred,
        axes_dims_rope=tuple(data.get("axes_dims_rope", inferred.axes_dims_rope)),
        eps=float(data.get("eps", inferred.eps)),
        causal_condition=bool(data.get("causal_condition", inferred.causal_condition)),
    )
    for field, ours in (("num_layers", config.num_layers), ("num_attention_heads", config.num_heads),
                        ("attention_head_dim", config.head_dim), ("in_channels", config.in_channels),
                        ("context_in_dim", config.context_in_dim), ("mlp_ratio", config.mlp_ratio)):
        if field in data and data[field] != ours:
            raise CheckpointError(f"{path}: {field} = {data[field]} but the weights have {ours}.")
    return config


def _locate(path) -> tuple[WeightFiles, DiTSource]:
    """The weight files and what the source is; a diffusers root's model_index.json tells Base from Turbo."""
    weights = find_weights(path, "transformer", DIFFUSERS_FOLDER)
    if weights.single_file:
        return weights, DiTSource(weights.path, "comfyui", *variant_from_name(weights.path))
    variant, why = variant_from_name(weights.root)
    grid = None
    if weights.model_index is not None:
        sigmas = read_json(weights.model_index, "model_index.json").get("sample_sigmas")
        variant, why = ("turbo" if sigmas else "base"), "model_index.json sample_sigmas"
        grid = _sigmas(sigmas, weights.model_index)
    scheduler = weights.root / "scheduler" / "scheduler_config.json"
    if grid is None and not weights.single_file and scheduler.is_file():
        grid = _sigmas(read_json(scheduler, "scheduler config").get("sample_sigmas"), scheduler)
        if grid is not None:
            variant, why = "turbo", "scheduler_config.json sample_sigmas"
    return weights, DiTSource(weights.root, "diffusers", variant, why, sigmas=grid)


def _sigmas(value, path: Path) -> tuple[float, ...] | None:
    """A stored Turbo grid: finite, decreasing, in (0, 1], at most 1000 (a terminal 0 is dropped); None if absent."""
    if not value:
        return None
    ok = isinstance(value, list) and len(value) <= 1001 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    grid = tuple(float(v) for v in value) if ok else ()
    if grid and grid[-1] == 0.0:
        grid = grid[:-1]
    if not grid or not all(0.0 < v <= 1.0 for v in grid) or any(b >= a for a, b in zip(grid, grid[1:])):
        raise CheckpointError(f"{path}: sample_sigmas must be a list of decreasing numbers in (0, 1], got "
                              f"{str(value)[:200]}. Download the file again.")
    return grid


def is_gguf(path) -> bool:
    """A GGUF file: named `.gguf`, or starting with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"GGUF"
    except OSError:
        return False


def load_dit(path, weight_dtype: str = "default", device="cpu", attention: str = "auto",
             quantized_gemm: str = "auto", defer: bool = False) -> QwenImage21DiT:
    """Load a Qwen-Image 2.1 DiT file or diffusers folder; `model.source` says what was loaded.

    `weight_dtype`: "default" (the file's float type), "bf16", "fp16", "fp32", "fp8_e4m3fn" (block weights
    stored in fp8, computed in bf16), "fp8_e4m3fn_fast" (block weights in fp8 with per-channel scales, multiplied
    in fp8 with per-row activation scales where the GPU has fp8 GEMMs, else as fp8_e4m3fn)
    or a torch dtype. A GGUF file goes to `gguf.load_gguf_dit`.
    `quantized_gemm` ("auto", "kernel", "dequantize"): how a quantized file's layers multiply (layers/formats.py
    `gemm_mode`; "auto": int8 kernels on CUDA, dequantized per layer on a CPU or MPS); `layers.kitchen.set_gemm`
    changes it later.
    `defer`: check everything, but leave the weights on the file until the memory plan places them
    (`model.file_weights`, deferred.py: read straight to the GPU or to pinned host memory, never a whole copy in
    host memory first); `device` is then unused. Float files kept in a float type only: an fp8 or quantized file,
    and `weight_dtype` fp8_e4m3fn / fp8_e4m3fn_fast (quantized while reading), load at once.
    """
    if quantized_gemm not in GEMM_MODES:
        raise ValueError(f"quantized_gemm must be one of {', '.join(GEMM_MODES)}, got {quantized_gemm!r}.")
    if is_gguf(path):
        from .gguf import load_gguf_dit  # imports the gguf package, needed only for GGUF files

        return load_gguf_dit(path, weight_dtype, device, attention)
    weights, source = _locate(path)
    raw, metadata = read_weight_headers(weights)
    where = str(source.path.name)
    source = replace(source, trained_for=read_trained_for(metadata, where))
    file_keys = rename_keys(raw, strip_prefix, where)  # {key without the ComfyUI prefix: key in the file}
    tensors = {key: raw[file_key] for key, file_key in file_keys.items()}
    quant = None
    if quantization_marker(tensors, metadata) is not None:  # a ComfyUI quantized file (model/loaders/kitchen.py)
        from .kitchen import plan_quantization  # comfy-kitchen is imported only for quantized files

        with WeightReader(raw) as blobs:
            quant = plan_quantization(tensors, metadata, lambda key: blobs.read(file_keys[key]), where,
                                      QUANTIZED_INSTEAD, rename=strip_prefix)
        tensors = quant.logical(tensors)  # the scales dropped, each quantized weight with its [out, in] shape
        source = replace(source, quantized=tuple(quant.formats))
    config = infer_config(tensors, where)
    if weights.config is not None:
        config = _config_from_json(weights.config, config)
    fused = "transformer_blocks.0.img_mlp.gate_up.weight" in tensors
    plan = file_plan(config, fused)
    check_shapes(plan, tensors, config, where)
    floats, fp8_ok = tuple(FILE_DTYPES), tuple(FILE_DTYPES) + tuple(FP8_FILE_DTYPES)
    check_dtypes(tensors, {key: fp8_ok if FP8_PARAMS.fullmatch(name) else floats
                           for name, keys in plan.items() for key in keys}, where, "DiT")

    stored = choose_dtype(weight_dtype, tensors["img_in.weight"].dtype, DTYPES, "DiT")
    fp8 = stored == torch.float8_e4m3fn
    fast = weight_dtype == FP8_FAST
    if fp8 and quant is not None and not (fast and set(quant.formats) <= FP8_FILE_FORMATS):
        raise ValueError(f"{where} is already quantized ({', '.join(quant.formats)}); weight_dtype {weight_dtype} "
                         "does not apply to it (fp8_e4m3fn_fast does to an fp8 file). Use default, bf16, fp16 or fp32 "
                         "(the compute dtype of its other layers).")
    compute = torch.bfloat16 if fp8 else stored
    backend = "sdpa" if attention == "auto" else attention
    with torch.device("meta"):
        model = QwenImage21DiT(config, dtype=compute, attention=backend)
    try:
        if defer and not fp8 and quant is None:
            model.file_weights = _deferred(model, plan, file_keys, raw, compute, where)
            model.register_forward_pre_hook(materialize_on_input(model.file_weights), with_kwargs=True)
        else:
            with WeightReader(raw) as reader:
                _fill(model, plan, file_keys, reader, compute, fp8 and quant is None, torch.device(device), quant,
                      fast)
    except BaseException:
        del model  # nothing half-loaded stays alive, also on KeyboardInterrupt
        raise
    set_gemm(model, quantized_gemm)
    model.compute_dtype = compute
    model.source = source
    return model.eval()


def _copy_parts(target: torch.Tensor, keys, read) -> None:
    """`target` filled from the file tensors `keys` stacked along dim 0 (a fused weight is several file tensors)."""
    row = 0
    for key in keys:
        part = read(key)
        if target.dtype == torch.float8_e4m3fn:
            part = part.float().clamp_(-FP8_MAX, FP8_MAX)
        target[row : row + part.shape[0]].copy_(part)
        row += part.shape[0]
        del part


def _fp8_rowwise_layer(name: str, shape, keys, read, compute, device) -> QuantLinear:
    """fp8_e4m3fn_fast on a float (or plain fp8) file's layer, read part by part (each part whole rows): its first
    `float_rows` rows (a fused qkv's q and k) copied in the compute dtype, the others quantized per output channel
    (an fp8 file's own codes copied with scale 1)."""
    keep = float_rows(name, shape[0])
    leading = torch.empty((keep, shape[1]), dtype=compute, device=device) if keep else None
    codes = torch.empty((shape[0] - keep, shape[1]), dtype=torch.float8_e4m3fn, device=device)
    scale = torch.ones(codes.shape[0], 1, device=device)
    row = 0
    for key in keys:
        part = read(key)
        head = min(max(keep - row, 0), part.shape[0])
        if head:
            leading[row : row + head].copy_(part[:head])
        rest, at = part[head:], row + head - keep
        if rest.shape[0]:
            if rest.dtype != torch.float8_e4m3fn:
                rest, rest_scale = quantize_weight(rest.to(device).float())  # e5m2 has no amax on a CPU
                scale[at : at + rest.shape[0]] = rest_scale
            else:
                rest = rest.float().clamp_(-FP8_MAX, FP8_MAX)
            codes[at : at + rest.shape[0]].copy_(rest)
        row += part.shape[0]
        del part, rest
    return QuantLinear.from_fp8_rowwise(codes, scale, compute, leading)


def _deferred(model, plan, file_keys: dict[str, str], raw, compute, where: str) -> FileWeights:
    """Every planned parameter a placeholder on the file, and how to read it (deferred.py)."""
    entries = []
    for name, keys in plan.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        param = torch.nn.Parameter(placeholder(getattr(module, attr).shape, compute), requires_grad=False)
        setattr(module, attr, param)
        entries.append((param, lambda target, reader, keys=keys: _copy_parts(
            target, keys, lambda key: reader.read(file_keys[key]))))
    return FileWeights(raw, entries, f"DiT ({where})")


def _fill(model, plan, file_keys: dict[str, str], reader: WeightReader, compute, fp8: bool, device,
          quant=None, fast: bool = False) -> None:
    """Each parameter built in memory of its own and filled part by part (the file's views are only copied from).

    A quantized file's layers become `kitchen.QuantLinear`s (one segment per file tensor, kept in the file's
    formats). fp8_e4m3fn on a float file makes the same fp8 `QuantLinear` as an fp8 file's layers (without a
    scale; plain torch, comfy-kitchen not needed). `fast` (fp8_e4m3fn_fast) makes the block linears fp8 rowwise
    layers instead: a float file's rows quantized per output channel part by part (each part is whole rows), an fp8
    file's codes and scales kept."""
    def read(key):
        return reader.read(file_keys[key])

    if quant is not None:
        quant.check_targets(model, plan)  # before any weight is read
    for name, keys in plan.items():
        if quant is not None and quant.fill_linear(model, name, keys, read, compute, device):
            if fast and FP8_PARAMS.fullmatch(name):
                layer = model.get_submodule(name.rpartition(".")[0])
                _replace_linear(model, name, layer.as_fp8_rowwise(float_rows(name, layer.out_features)))
            continue
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        shape = getattr(module, attr).shape
        if fast and FP8_PARAMS.fullmatch(name):
            _replace_linear(model, name, _fp8_rowwise_layer(name, shape, keys, read, compute, device))
            continue
        dtype = torch.float8_e4m3fn if fp8 and FP8_PARAMS.fullmatch(name) else compute
        target = torch.empty(shape, dtype=dtype, device=device)
        _copy_parts(target, keys, read)
        if dtype == torch.float8_e4m3fn:
            _replace_linear(model, name, QuantLinear.from_fp8(target, compute))
        else:
            setattr(module, attr, torch.nn.Parameter(target, requires_grad=False))


def _replace_linear(model, name: str, layer) -> None:
    """Put `layer` where the Linear owning parameter `name` is."""
    parent, _, leaf = name.rpartition(".")[0].rpartition(".")
    setattr(model.get_submodule(parent), leaf, layer)
