"""Load the Qwen-Image 2.1 DiT from the files users have.

Two layouts (docs/checkpoints.md):
- ComfyUI single file (`qwen_image_2.1_bf16.safetensors`, `..._turbo_bf16...`): bare keys, or keys under
  `model.diffusion_model.`; each block's MLP is one fused `img_mlp.gate_up` [gate; up].
- diffusers folder (`Qwen-Image-2.1/` with `model_index.json`, or its `transformer/` folder): sharded
  safetensors with an index, split `img_mlp.gate_layer` / `img_mlp.proj`, `transformer/config.json`.
A GGUF file (ComfyUI names, quantized) is read by `gguf_loading.py` with this module's key plan, config
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
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .checkpoint import (
    FILE_DTYPES,
    FP8_FILE_DTYPES,
    CheckpointError,
    TensorInfo,
    WeightFiles,
    WeightReader,
    check_dtypes,
    choose_dtype,
    count_indexed,
    find_weights,
    identify_checkpoint,
    infos_of,
    quantization_marker,
    read_json,
    read_weight_headers,
    rename_keys,
)
from .dit import DiTConfig, QwenImage21DiT

COMFY_PREFIX = "model.diffusion_model."
DETECT_KEYS = ("txt_in.text_norm.weight", "modulation.1.weight", "transformer_blocks.0.attn.norm_q.weight",
               "img_in.weight", "proj_out.weight")
# What the DiT loads as; fp8_e4m3fn stores the FP8_PARAMS weights in fp8 and computes in bf16.
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Linear weights stored in fp8 when asked: the block GEMMs (95% of the parameters). Embeddings, norms, the
# shared modulation table and the output head stay in bf16, as they steer every token. The same weights may
# already be fp8 in a file (plain fp8 releases, without scales); anything else must be a float type.
FP8_PARAMS = re.compile(r"blocks\.\d+\.(qkv|to_out|gate_up|down)\.weight")
DIFFUSERS_FOLDER = ("a diffusers Qwen-Image-2.1 folder (transformer/config.json + "
                    "diffusion_pytorch_model*.safetensors)")
# What to load when a quantized file cannot run here.
QUANTIZED_INSTEAD = ("qwen_image_2.1_int8_convrot.safetensors (qwen_image_2.1_turbo_int8_convrot for Turbo) or "
                     "the bf16 file")


@dataclass(frozen=True)
class DiTSource:
    """What was loaded: the path, its layout, the variant ("base", "turbo" or "unknown") and how we know."""

    path: Path
    layout: str  # "comfyui", "diffusers" or "gguf"
    variant: str
    variant_from: str
    # A diffusers folder's own Turbo grid (`sample_sigmas` of model_index.json, else of the scheduler config),
    # without the terminal 0; None when the files give none (single files, Base).
    sigmas: tuple[float, ...] | None = None
    quantized: tuple[str, ...] = ()  # the formats of a ComfyUI quantized file ("int8_tensorwise", ...)


def _file_plan(config: DiTConfig, fused_mlp: bool) -> dict[str, list[str]]:
    """Our parameter name -> the file keys concatenated (along rows) to make it."""
    plan = {
        "time_embed.linear_1.weight": ["time_text_embed.timestep_embedder.linear_1.weight"],
        "time_embed.linear_2.weight": ["time_text_embed.timestep_embedder.linear_2.weight"],
        "txt_in.text_norm.weight": ["txt_in.text_norm.weight"],
        "txt_in.in_layer.weight": ["txt_in.in_layer.weight"],
        "txt_in.out_layer.weight": ["txt_in.out_layer.weight"],
        "img_in.weight": ["img_in.weight"],
        "modulation.weight": ["modulation.1.weight"],
        "norm_out.weight": ["norm_out.linear.weight"],
        "proj_out.weight": ["proj_out.weight"],
    }
    for i in range(config.num_layers):
        src, dst = f"transformer_blocks.{i}.", f"blocks.{i}."
        plan[dst + "qkv.weight"] = [src + f"attn.to_{x}.weight" for x in "qkv"]
        plan[dst + "norm_q"] = [src + "attn.norm_q.weight"]
        plan[dst + "norm_k"] = [src + "attn.norm_k.weight"]
        plan[dst + "to_out.weight"] = [src + "attn.to_out.0.weight"]
        plan[dst + "gate_up.weight"] = (
            [src + "img_mlp.gate_up.weight"] if fused_mlp
            else [src + "img_mlp.gate_layer.weight", src + "img_mlp.proj.weight"]
        )
        plan[dst + "down.weight"] = [src + "img_mlp.out.weight"]
    return plan


def convert_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A file-layout state dict (diffusers or ComfyUI, any prefix) as our parameter names, in memory."""
    state_dict = {_strip(k): v for k, v in state_dict.items()}
    config = infer_config(infos_of(state_dict))
    fused = "transformer_blocks.0.img_mlp.gate_up.weight" in state_dict
    return {name: torch.cat([state_dict[k] for k in keys]) for name, keys in _file_plan(config, fused).items()}


def _strip(key: str) -> str:
    return key.removeprefix(COMFY_PREFIX)


def infer_config(tensors: dict[str, TensorInfo], where: str = "checkpoint") -> DiTConfig:
    """The DiT config from tensor shapes alone (keys without prefix)."""
    missing = [key for key in DETECT_KEYS if key not in tensors]
    mlp_keys = ("transformer_blocks.0.img_mlp.gate_up.weight", "transformer_blocks.0.img_mlp.proj.weight")
    if missing or not any(key in tensors for key in mlp_keys):
        raise CheckpointError(
            f"{where} is {identify_checkpoint(tensors)}, not a Qwen-Image 2.1 DiT"
            + (f" (missing {', '.join(missing)})" if missing else "")
            + ". Put Qwen-Image 2.1 transformer files (qwen_image_2.1_bf16.safetensors or a diffusers "
            "Qwen-Image-2.1 folder) in models/diffusion_models."
        )
    head_dim = tensors["transformer_blocks.0.attn.norm_q.weight"].shape[0]
    width, in_channels = tensors["img_in.weight"].shape
    layers = count_indexed(tensors, r"transformer_blocks\.(\d+)\.")
    if "transformer_blocks.0.img_mlp.gate_up.weight" in tensors:
        hidden = tensors["transformer_blocks.0.img_mlp.gate_up.weight"].shape[0] // 2
    else:
        hidden = tensors["transformer_blocks.0.img_mlp.proj.weight"].shape[0]
    if width % head_dim or hidden % width or head_dim % 32:
        raise CheckpointError(
            f"{where}: width {width}, head size {head_dim} and MLP size {hidden} do not fit together."
        )
    # RoPE axes are not in the weights: the release splits its 128-dim heads 16/56/56, i.e. 1/8 + 7/16 + 7/16.
    rope_axes = (head_dim // 8, head_dim * 7 // 16, head_dim * 7 // 16)
    return DiTConfig(
        in_channels=in_channels,
        out_channels=tensors["proj_out.weight"].shape[0],
        num_layers=layers,
        num_heads=width // head_dim,
        head_dim=head_dim,
        context_in_dim=tensors["txt_in.text_norm.weight"].shape[0],
        mlp_ratio=hidden // width,
        axes_dims_rope=rope_axes,
    )


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


def _variant_from_name(path: Path) -> tuple[str, str]:
    name = path.name.lower()
    if "turbo" in name:
        return "turbo", "file name"
    if re.search(r"qwen[-_ ]?image[-_ ]?2\.?1", name):
        return "base", "file name"
    return "unknown", "nothing in the files says"


def _locate(path) -> tuple[WeightFiles, DiTSource]:
    """The weight files and what the source is; a diffusers root's model_index.json tells Base from Turbo."""
    weights = find_weights(path, "transformer", DIFFUSERS_FOLDER)
    if weights.single_file:
        return weights, DiTSource(weights.path, "comfyui", *_variant_from_name(weights.path))
    variant, why = _variant_from_name(weights.root)
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


def load_dit(path, weight_dtype: str = "default", device="cpu", attention: str = "auto") -> QwenImage21DiT:
    """Load a Qwen-Image 2.1 DiT file or diffusers folder; `model.source` says what was loaded.

    `weight_dtype`: "default" (the file's float type), "bf16", "fp16", "fp32", "fp8_e4m3fn" (block weights
    stored in fp8, computed in bf16) or a torch dtype. A GGUF file goes to `gguf_loading.load_gguf_dit`.
    """
    if is_gguf(path):
        from .gguf_loading import load_gguf_dit  # imports the gguf package, needed only for GGUF files

        return load_gguf_dit(path, weight_dtype, device, attention)
    weights, source = _locate(path)
    raw, metadata = read_weight_headers(weights)
    where = str(source.path.name)
    file_keys = rename_keys(raw, _strip, where)  # {key without the ComfyUI prefix: key in the file}
    tensors = {key: raw[file_key] for key, file_key in file_keys.items()}
    quant = None
    if quantization_marker(tensors, metadata) is not None:  # a ComfyUI quantized file (model/quantized.py)
        from .quantized import plan_quantization  # comfy-kitchen is imported only for quantized files

        with WeightReader(raw) as blobs:
            quant = plan_quantization(tensors, metadata, lambda key: blobs.read(file_keys[key]), where,
                                      QUANTIZED_INSTEAD, rename=_strip)
        tensors = quant.logical(tensors)  # the scales dropped, each quantized weight with its [out, in] shape
        source = replace(source, quantized=tuple(quant.formats))
    config = infer_config(tensors, where)
    if weights.config is not None:
        config = _config_from_json(weights.config, config)
    fused = "transformer_blocks.0.img_mlp.gate_up.weight" in tensors
    plan = _file_plan(config, fused)
    _check_shapes(plan, tensors, config, where)
    floats, fp8_ok = tuple(FILE_DTYPES), tuple(FILE_DTYPES) + tuple(FP8_FILE_DTYPES)
    check_dtypes(tensors, {key: fp8_ok if FP8_PARAMS.fullmatch(name) else floats
                           for name, keys in plan.items() for key in keys}, where, "DiT")

    stored = choose_dtype(weight_dtype, tensors["img_in.weight"].dtype, DTYPES, "DiT")
    fp8 = stored == torch.float8_e4m3fn
    if fp8 and quant is not None:
        raise ValueError(f"{where} is already quantized ({', '.join(quant.formats)}); weight_dtype fp8_e4m3fn does "
                         "not apply to it. Use default, bf16, fp16 or fp32 (the compute dtype of its other layers).")
    compute = torch.bfloat16 if fp8 else stored
    backend = "sdpa" if attention == "auto" else attention
    with torch.device("meta"):
        model = QwenImage21DiT(config, dtype=compute, attention=backend)
    try:
        with WeightReader(raw) as reader:
            _fill(model, plan, file_keys, reader, compute, fp8, torch.device(device), quant)
    except BaseException:
        del model  # nothing half-loaded stays alive, also on KeyboardInterrupt
        raise
    model.compute_dtype = compute
    model.source = source
    return model.eval()


def _check_shapes(plan, tensors, config: DiTConfig, where: str) -> None:
    needed = {key for keys in plan.values() for key in keys}
    missing = sorted(needed - tensors.keys())
    if missing:
        raise CheckpointError(
            f"{where}: {len(missing)} DiT tensors are missing (e.g. {', '.join(missing[:3])}); the file is incomplete "
            "or from another model. Re-download it."
        )
    unexpected = sorted(tensors.keys() - needed)
    if unexpected:
        raise CheckpointError(
            f"{where}: {len(unexpected)} tensors that a Qwen-Image 2.1 DiT does not have "
            f"(e.g. {', '.join(unexpected[:3])}); this is not a plain Qwen-Image 2.1 transformer."
        )
    with torch.device("meta"):
        reference = QwenImage21DiT(config).state_dict()
    for name, keys in plan.items():
        rows = sum(tensors[k].shape[0] for k in keys)
        expected = tuple(reference[name].shape)
        got = (rows, *tensors[keys[0]].shape[1:])
        if got != expected or any(tensors[k].shape[1:] != tensors[keys[0]].shape[1:] for k in keys):
            raise CheckpointError(
                f"{where}: {keys[0]} has shape {tensors[keys[0]].shape}, expected rows of {expected}."
            )


def _fill(model, plan, file_keys: dict[str, str], reader: WeightReader, compute, fp8: bool, device,
          quant=None) -> None:
    """Each parameter built in memory of its own and filled part by part (the file's views are only copied from).

    A quantized file's layers become `quantized.QuantLinear`s (one segment per file tensor, kept in the file's
    formats). fp8_e4m3fn on a float file runs through the same fp8 Linear when comfy-kitchen is installed, else
    the plain fp8 weight (upcast per GEMM)."""
    if quant is not None:
        quant.check_targets(model, plan)  # before any weight is read
    fp8_linear = None
    if fp8:
        from .quantized import QuantLinear, kitchen_installed

        fp8_linear = QuantLinear.from_fp8 if kitchen_installed() else None
    for name, keys in plan.items():
        if quant is not None and quant.fill_linear(model, name, keys, lambda key: reader.read(file_keys[key]),
                                                   compute, device):
            continue
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        dtype = torch.float8_e4m3fn if fp8 and FP8_PARAMS.fullmatch(name) else compute
        target = torch.empty(getattr(module, attr).shape, dtype=dtype, device=device)
        row = 0
        for key in keys:
            part = reader.read(file_keys[key])
            if dtype == torch.float8_e4m3fn:
                part = part.float().clamp_(-FP8_MAX, FP8_MAX)
            target[row : row + part.shape[0]].copy_(part)
            row += part.shape[0]
            del part
        if dtype == torch.float8_e4m3fn and fp8_linear is not None:
            parent, _, leaf = module_name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, fp8_linear(target, compute))
        else:
            setattr(module, attr, torch.nn.Parameter(target, requires_grad=False))
