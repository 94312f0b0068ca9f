"""Load the Qwen-Image 2.1 DiT from the files users have.

Two layouts (CHECKPOINTS.md section 1):
- ComfyUI single file (`qwen_image_2.1_bf16.safetensors`, `..._turbo_bf16...`): bare keys, or keys under
  `model.diffusion_model.`; each block's MLP is one fused `img_mlp.gate_up` [gate; up].
- diffusers folder (`Qwen-Image-2.1/` with `model_index.json`, or its `transformer/` folder): sharded
  safetensors with an index, split `img_mlp.gate_layer` / `img_mlp.proj`, `transformer/config.json`.

Everything is decided from headers first (what the file is, its config, every tensor's shape), so a bad
file is refused before any weight is allocated. The model is then built on the meta device and each
parameter is filled straight from the file, so at most one extra tensor is alive at a time.
"""

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .dit import DiTConfig, QwenImage21DiT
from .safetensors_io import (
    CheckpointError,
    TensorInfo,
    identify_checkpoint,
    quantization_marker,
    read_headers,
    read_sharded_index,
)

COMFY_PREFIX = "model.diffusion_model."
DETECT_KEYS = ("txt_in.text_norm.weight", "modulation.1.weight", "transformer_blocks.0.attn.norm_q.weight",
               "img_in.weight", "proj_out.weight")
WEIGHT_DTYPES = ("default", "bf16", "fp16", "fp32", "fp8_e4m3fn")
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FILE_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Linear weights stored in fp8 when asked: the block GEMMs (95% of the parameters). Embeddings, norms, the
# shared modulation table and the output head stay in bf16, as they steer every token.
FP8_PARAMS = re.compile(r"blocks\.\d+\.(qkv|to_out|gate_up|down)\.weight")
TURBO_SIGMAS = (1.0, 0.978453, 0.95418, 0.926626, 0.89508, 0.845148, 0.704534, 0.414568)


@dataclass(frozen=True)
class DiTSource:
    """What was loaded: the path, its layout, the variant ("base", "turbo" or "unknown") and how we know."""

    path: Path
    layout: str  # "comfyui" or "diffusers"
    variant: str
    variant_from: str


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
            [src + "img_mlp.gate_up.weight"] if fused_mlp else [src + "img_mlp.gate_layer.weight", src + "img_mlp.proj.weight"]
        )
        plan[dst + "down.weight"] = [src + "img_mlp.out.weight"]
    return plan


def convert_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A file-layout state dict (diffusers or ComfyUI, any prefix) as our parameter names, in memory."""
    state_dict = {_strip(k): v for k, v in state_dict.items()}
    config = infer_config({k: TensorInfo(str(v.dtype), tuple(v.shape), Path("<memory>")) for k, v in state_dict.items()})
    fused = "transformer_blocks.0.img_mlp.gate_up.weight" in state_dict
    return {name: torch.cat([state_dict[k] for k in keys]) for name, keys in _file_plan(config, fused).items()}


def _strip(key: str) -> str:
    return key[len(COMFY_PREFIX):] if key.startswith(COMFY_PREFIX) else key


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
    layers = 1 + max(int(m.group(1)) for k in tensors if (m := re.match(r"transformer_blocks\.(\d+)\.", k)))
    if "transformer_blocks.0.img_mlp.gate_up.weight" in tensors:
        hidden = tensors["transformer_blocks.0.img_mlp.gate_up.weight"].shape[0] // 2
    else:
        hidden = tensors["transformer_blocks.0.img_mlp.proj.weight"].shape[0]
    if width % head_dim or hidden % width or head_dim % 32:
        raise CheckpointError(f"{where}: width {width}, head size {head_dim} and MLP size {hidden} do not fit together.")
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
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: unreadable config ({error}).")
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


def resolve_source(path: str | Path) -> tuple[list[Path], Path | None, DiTSource]:
    """Files to read, the config.json (if any) and what the source is."""
    path = Path(path)
    if path.is_file():
        variant, why = _variant_from_name(path)
        return [path], None, DiTSource(path, "comfyui", variant, why)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or folder.")
    root, folder = (path, path / "transformer") if (path / "transformer").is_dir() else (path.parent, path)
    variant, why = _variant_from_name(root)
    model_index = root / "model_index.json"
    if model_index.is_file():
        try:
            sigmas = json.loads(model_index.read_text()).get("sample_sigmas")
        except (OSError, json.JSONDecodeError) as error:
            raise CheckpointError(f"{model_index}: unreadable ({error}).")
        variant, why = ("turbo" if sigmas else "base"), "model_index.json sample_sigmas"
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        files = read_sharded_index(indexes[0])
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{folder}: no .safetensors weights found. Expected a diffusers Qwen-Image-2.1 folder "
            "(transformer/config.json + diffusion_pytorch_model*.safetensors)."
        )
    config_path = folder / "config.json"
    return files, (config_path if config_path.is_file() else None), DiTSource(root, "diffusers", variant, why)


def load_dit(path, weight_dtype: str = "default", device="cpu", attention: str = "auto") -> QwenImage21DiT:
    """Load a Qwen-Image 2.1 DiT file or diffusers folder; `model.source` says what was loaded."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}.")
    files, config_path, source = resolve_source(path)
    raw, metadata = read_headers(files)
    tensors = {_strip(key): info for key, info in raw.items()}
    where = str(source.path.name)
    marker = quantization_marker(tensors, metadata)
    if marker is not None:
        raise CheckpointError(
            f"{where} is a quantized checkpoint ({marker}); this pack loads bf16/fp16/fp32 files and stores fp8 "
            "itself (weight_dtype=fp8_e4m3fn). Use qwen_image_2.1_bf16.safetensors."
        )
    config = infer_config(tensors, where)
    if config_path is not None:
        config = _config_from_json(config_path, config)
    fused = "transformer_blocks.0.img_mlp.gate_up.weight" in tensors
    plan = _file_plan(config, fused)
    _check_shapes(plan, tensors, config, where)

    file_dtype = FILE_DTYPES.get(tensors["img_in.weight"].dtype, torch.bfloat16)
    compute = {"default": file_dtype, "fp8_e4m3fn": torch.bfloat16}.get(weight_dtype) or TORCH_DTYPES[weight_dtype]
    backend = "sdpa" if attention == "auto" else attention
    with torch.device("meta"):
        model = QwenImage21DiT(config, dtype=compute, attention=backend)
    try:
        _fill(model, plan, tensors, compute, weight_dtype == "fp8_e4m3fn", torch.device(device))
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
            raise CheckpointError(f"{where}: {keys[0]} has shape {tensors[keys[0]].shape}, expected rows of {expected}.")


def _fill(model, plan, tensors, compute, fp8: bool, device) -> None:
    from safetensors import safe_open

    handles = {}
    try:
        for name, keys in plan.items():
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            dtype = torch.float8_e4m3fn if fp8 and FP8_PARAMS.fullmatch(name) else compute
            shape = getattr(module, attr).shape
            target = torch.empty(shape, dtype=dtype, device=device)
            row = 0
            for key in keys:
                file = tensors[key].file
                if file not in handles:
                    handles[file] = safe_open(str(file), framework="pt", device="cpu")
                original = key if key in handles[file].keys() else COMFY_PREFIX + key
                part = handles[file].get_tensor(original)
                if dtype == torch.float8_e4m3fn:
                    part = part.float().clamp_(-FP8_MAX, FP8_MAX)
                target[row : row + part.shape[0]].copy_(part)
                row += part.shape[0]
                del part
            setattr(module, attr, torch.nn.Parameter(target, requires_grad=False))
    finally:
        handles.clear()
