"""Load the Qwen-Image 2.1 text encoder (Qwen3-VL-8B) and its tokenizer from the files users have.

Weights, in either layout (docs/checkpoints.md):
- ComfyUI single file `text_encoders/qwen3vl_8b_bf16.safetensors`: language keys flattened to
  `model.layers.*`, `model.embed_tokens.*`, `model.norm.*`, vision keys `model.visual.*`; or the same file
  with transformers' names (`model.language_model.*`, `model.visual.*`, `lm_head.*`);
- diffusers folder `Qwen-Image-2.1/` (with `model_index.json`) or its `text_encoder/` folder: `config.json`
  plus `model.safetensors` or shards with `model.safetensors.index.json`.

The config comes from `config.json` when there is one; a single file has none, so everything its shapes
reveal is read from them (layers, widths, heads and KV heads via `q_norm`/`q_proj`/`k_proj`, vocab, vision
depth/width/patch/merge, deepstack count...) and the rest takes the released 8B values (the module constants
below: those of the release's `text_encoder/config.json`), scaled by a stated rule for other sizes (test
models). The model is built on the meta device and each parameter is read from the file (safetensors'
`safe_open`, through `checkpoint.WeightReader`) straight into its final dtype and device, one tensor at a time,
always into memory of its own. The final norm (replaced by an identity, see `text_encoder.py`) and the LM
head are never loaded. Finding the files, JSON, dtype choice and tensor reading are the shared `checkpoint.py`;
this module owns the key map, the config inference and the tokenizer/processor search.

Tokenizer and image processor, the first found of:
1. `tokenizer_dir` passed by the caller;
2. the diffusers `processor/` folder (beside `text_encoder/`), or the weights folder itself (a plain
   Qwen3-VL repository keeps them together);
3. beside a single file: `<file stem>_tokenizer/`, then `tokenizer/`, then `processor/`;
4. `fallback_tokenizer_dir` (the nodes pass ComfyUI's bundled `comfy/text_encoders/qwen25_tokenizer/`).
A folder qualifies with `tokenizer.json`, or `vocab.json` + `merges.txt`. Image-processor settings come from
its `preprocessor_config.json`, else the `image_processor` entry of `processor_config.json`, else the
released values (IMAGE_PROCESSOR_DEFAULTS); they are always built as transformers' PIL processor.
"""

import logging
import math
from pathlib import Path

import torch
from torch import nn
from transformers import Qwen3VLConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

from ..encoders import transformers_compat as compat
from ..encoders.text_encoder import QwenImageTextEncoder
from .checkpoint import (
    FILE_DTYPES,
    FLOAT_DTYPES,
    CheckpointError,
    WeightFiles,
    WeightReader,
    check_dtypes,
    choose_dtype,
    count_indexed,
    find_weights,
    identify_checkpoint,
    quantization_marker,
    read_json,
    read_weight_headers,
    rename_keys,
)
from .deferred import FileWeights, materialize_on_input, placeholder

log = logging.getLogger(__name__)

#: File-key prefix -> `Qwen3VLModel` parameter prefix, first match wins. None = not loaded (the LM head).
KEY_PREFIXES = (
    ("model.language_model.", "language_model."),
    ("model.visual.", "visual."),
    ("visual.", "visual."),
    ("model.embed_tokens.", "language_model.embed_tokens."),
    ("model.layers.", "language_model.layers."),
    ("model.norm.", "language_model.norm."),
    ("lm_head.", None),
    ("model.lm_head.", None),
)
#: All present (after renaming) in any Qwen3-VL file; DeepStack and q_norm tell it from Qwen2.5-VL.
DETECT_KEYS = (
    "language_model.embed_tokens.weight",
    "language_model.layers.0.self_attn.q_norm.weight",
    "visual.patch_embed.proj.weight",
    "visual.merger.linear_fc2.weight",
    "visual.deepstack_merger_list.0.norm.weight",
)
#: Released Qwen3-VL-8B values that no tensor shape shows (its `text_encoder/config.json`; ComfyUI's
#: `Qwen3VL_8BConfig` agrees).
ROPE_THETA = 5_000_000.0
MROPE_SECTION_8B = (24, 20, 20)  # of head_dim / 2 = 64 rotary pairs: temporal, height, width
RMS_NORM_EPS = 1e-6
MAX_POSITIONS = 262144
VISION_HEADS = 16  # every released Qwen3-VL tower (1024 and 1152 wide) has 16 heads
#: Vision depth -> layers whose outputs feed DeepStack (ComfyUI `QWEN3VL_VISION`: 8B/32B, 4B).
DEEPSTACK_INDEXES = {27: (8, 16, 24), 24: (5, 11, 17)}
#: Image processor settings of the release (its `processor/preprocessor_config.json`).
IMAGE_PROCESSOR_DEFAULTS = {
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "rescale_factor": 1 / 255, "resample": 3, "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}
IMAGE_PROCESSOR_KEYS = ("do_resize", "resample", "do_rescale", "rescale_factor", "do_normalize", "image_mean",
                        "image_std", "do_convert_rgb", "size", "min_pixels", "max_pixels", "patch_size",
                        "temporal_patch_size", "merge_size")
# What to load when a quantized file cannot run here.
QUANTIZED_INSTEAD = "qwen3vl_8b_int8_convrot.safetensors or qwen3vl_8b_bf16.safetensors"
DIFFUSERS_FOLDER = ("a diffusers Qwen-Image-2.1 text_encoder/ folder (config.json + model.safetensors, or shards "
                    "with model.safetensors.index.json)")


# -- where the files are ---------------------------------------------------------------------------------------
def locate_text_encoder(path) -> tuple[WeightFiles, list[Path]]:
    """(where the weights are, tokenizer folders to try in order) for a file or a folder."""
    weights = find_weights(path, "text_encoder", DIFFUSERS_FOLDER)
    if weights.single_file:
        file = weights.path
        return weights, [file.parent / f"{file.stem}_tokenizer", file.parent / "tokenizer", file.parent / "processor"]
    return weights, [weights.root / "processor", weights.folder]


def _is_tokenizer_dir(folder: Path) -> bool:
    return folder.is_dir() and ((folder / "tokenizer.json").is_file()
                                or ((folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()))


def find_tokenizer_dir(candidates: list[Path], tokenizer_dir=None, fallback_tokenizer_dir=None) -> Path:
    """The first folder holding a Qwen tokenizer (see the module docstring for the order)."""
    if tokenizer_dir is not None:
        if not _is_tokenizer_dir(Path(tokenizer_dir)):
            raise CheckpointError(f"{tokenizer_dir}: no tokenizer.json, nor vocab.json + merges.txt, in this folder.")
        return Path(tokenizer_dir)
    tried = list(candidates) + ([Path(fallback_tokenizer_dir)] if fallback_tokenizer_dir is not None else [])
    for folder in tried:
        if _is_tokenizer_dir(folder):
            return folder
    raise CheckpointError(
        "No tokenizer found for the Qwen-Image 2.1 text encoder; looked in " + ", ".join(str(f) for f in tried)
        + ". Put the Qwen-Image 2.1 `processor/` folder (or ComfyUI's comfy/text_encoders/qwen25_tokenizer) "
        "beside the weights as `tokenizer/`, or pass its folder."
    )


def _image_processor_settings(folder: Path) -> dict:
    """Image-processor keyword arguments: the folder's settings over the released defaults."""
    found = {}
    for name, entry in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        if (folder / name).is_file():
            found = read_json(folder / name, "image processor settings file")
            found = (found.get(entry) or {}) if entry else found
            if not isinstance(found, dict):
                raise CheckpointError(f"{folder / name}: its {entry!r} entry is not a JSON object of settings.")
            break
    settings = dict(IMAGE_PROCESSOR_DEFAULTS)
    settings.update({key: value for key, value in found.items() if key in IMAGE_PROCESSOR_KEYS})
    min_pixels, max_pixels = settings.pop("min_pixels", None), settings.pop("max_pixels", None)
    if min_pixels is not None or max_pixels is not None:  # older files spell the size as min/max pixels
        settings["size"] = {"shortest_edge": min_pixels or settings["size"]["shortest_edge"],
                            "longest_edge": max_pixels or settings["size"]["longest_edge"]}
    return settings


def load_processor(folder) -> tuple:
    """(tokenizer, PIL image processor) from a processor/tokenizer folder, offline."""
    folder = Path(folder)
    tokenizer = compat.qwen2_tokenizer_class().from_pretrained(str(folder), local_files_only=True)
    return tokenizer, compat.pil_image_processor(**_image_processor_settings(folder))


# -- what the weights are ----------------------------------------------------------------------------------------
def rename_key(key: str) -> str | None:
    """`Qwen3VLModel` parameter name for a file key, None for keys never loaded (LM head) or not ours."""
    for prefix, target in KEY_PREFIXES:
        if key.startswith(prefix):
            return None if target is None else target + key[len(prefix):]
    return None


def _plan(infos: dict, path: Path) -> dict[str, str]:
    """Our parameter name -> file key, refusing files that are not a Qwen3-VL text encoder."""
    plan = rename_keys(infos, rename_key, path.name)
    missing = [key for key in DETECT_KEYS if key not in plan]
    if missing:
        if any(".merger.mlp." in key for key in infos):
            found = "a Qwen2.5-VL text encoder (Qwen-Image 1.x)"
        elif "visual.patch_embed.proj.weight" in plan:
            found = "a Qwen-VL model without Qwen3-VL's DeepStack mergers or q/k norms"
        elif "language_model.embed_tokens.weight" in plan:
            found = "a language model without a vision tower"
        else:
            found = identify_checkpoint(infos)
        raise CheckpointError(
            f"{path.name} is {found}, not the Qwen3-VL text encoder of Qwen-Image 2.1 (missing {missing[0]}). Use "
            "text_encoders/qwen3vl_8b_bf16.safetensors or the diffusers folder's text_encoder/."
        )
    return plan


def _scaled_mrope(head_dim: int) -> list[int]:
    """The released [24, 20, 20] split of head_dim / 2 rotary pairs, kept in ratio for other head sizes."""
    half = head_dim // 2
    spatial = round(half * MROPE_SECTION_8B[1] / sum(MROPE_SECTION_8B))
    return [half - 2 * spatial, spatial, spatial]


def _deepstack_indexes(depth: int, count: int) -> list[int]:
    if DEEPSTACK_INDEXES.get(depth, ()) and len(DEEPSTACK_INDEXES[depth]) == count:
        return list(DEEPSTACK_INDEXES[depth])
    indexes = [i * depth // count for i in range(count)]
    log.warning("Qwen3-VL vision depth %d is not a released size: assuming DeepStack layers %s.", depth, indexes)
    return indexes


def config_from_shapes(shapes: dict[str, tuple], config: dict | None = None, where: str = "config.json",
                       ) -> Qwen3VLConfig:
    """A `Qwen3VLConfig` for these `Qwen3VLModel` parameter shapes, checked against `config` when given.

    Without `config` (a single file) the shapes give every size; the rest is the 8B release's (rope theta,
    eps, 16 vision heads, DeepStack layers), see the module constants. `where` names the config (or file) in
    errors.
    """
    try:
        return _config_from_shapes(shapes, config, where)
    except KeyError as error:
        raise CheckpointError(f"{where}: the text encoder tensor {error} is missing; the file is incomplete. "
                              "Download it again.") from None


def _config_from_shapes(s: dict[str, tuple], config: dict | None, where: str) -> Qwen3VLConfig:
    vocab, hidden = s["language_model.embed_tokens.weight"]
    head_dim = s["language_model.layers.0.self_attn.q_norm.weight"][0]
    vision_hidden, in_channels, temporal, patch, _ = s["visual.patch_embed.proj.weight"]
    merge = math.isqrt(s["visual.merger.linear_fc1.weight"][1] // vision_hidden)
    depth = count_indexed(s, r"visual\.blocks\.(\d+)\.")
    text = {
        "vocab_size": vocab, "hidden_size": hidden, "head_dim": head_dim,
        "num_hidden_layers": count_indexed(s, r"language_model\.layers\.(\d+)\."),
        "num_attention_heads": s["language_model.layers.0.self_attn.q_proj.weight"][0] // head_dim,
        "num_key_value_heads": s["language_model.layers.0.self_attn.k_proj.weight"][0] // head_dim,
        "intermediate_size": s["language_model.layers.0.mlp.gate_proj.weight"][0],
        "attention_bias": "language_model.layers.0.self_attn.q_proj.bias" in s,
    }
    vision = {
        "depth": depth, "hidden_size": vision_hidden, "in_channels": in_channels, "temporal_patch_size": temporal,
        "patch_size": patch, "spatial_merge_size": merge,
        "intermediate_size": s["visual.blocks.0.mlp.linear_fc1.weight"][0],
        "out_hidden_size": s["visual.merger.linear_fc2.weight"][0],
        "num_position_embeddings": s["visual.pos_embed.weight"][0],
    }
    deepstack = count_indexed(s, r"visual\.deepstack_merger_list\.(\d+)\.")
    if config is None:
        text.update(rms_norm_eps=RMS_NORM_EPS, max_position_embeddings=MAX_POSITIONS,
                    **compat.text_rope_settings(ROPE_THETA, _scaled_mrope(head_dim)))
        vision.update(num_heads=VISION_HEADS, deepstack_visual_indexes=_deepstack_indexes(depth, deepstack))
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    try:
        result = Qwen3VLConfig.from_dict(compat.config_dict(config))
    except (TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"{where} is not a Qwen3-VL config ({error}).") from None
    wrong = [f"text {k}: config {getattr(result.text_config, k)}, weights {v}" for k, v in text.items()
             if getattr(result.text_config, k) != v]
    wrong += [f"vision {k}: config {getattr(result.vision_config, k)}, weights {v}" for k, v in vision.items()
              if getattr(result.vision_config, k) != v]
    if len(result.vision_config.deepstack_visual_indexes) != deepstack:
        configured = len(result.vision_config.deepstack_visual_indexes)
        wrong.append(f"deepstack mergers: config {configured}, weights {deepstack}")
    if wrong:
        raise CheckpointError(f"{where} does not match the weights beside it: " + "; ".join(wrong) + ".")
    return result


# -- building and filling the model ------------------------------------------------------------------------------
def build_empty_model(config: Qwen3VLConfig, device) -> Qwen3VLModel:
    """`Qwen3VLModel` with parameters on the meta device, final norm replaced by an identity, and the computed
    buffers (rotary tables) already real on `device`."""
    with torch.device("meta"):
        model = Qwen3VLModel(config)
    model.language_model.norm = nn.Identity()  # Qwen-Image reads the state before it (text_encoder.py)
    for name, module in list(model.named_modules()):
        if any(buffer.is_meta for buffer in module.buffers(recurse=False)):
            # the rotary embeddings compute their tables from the config; rebuild them off the meta device
            rebuilt = compat.rebuild_rotary(module)
            if rebuilt is None:
                raise RuntimeError(
                    f"{name} ({type(module).__name__}) holds computed buffers the loader cannot rebuild."
                )
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, rebuilt.to(device))
    return model


def fill_model(model: nn.Module, plan: dict[str, str], infos: dict, dtype: torch.dtype, device, path: Path,
               defer: bool = False) -> None:
    """Read every parameter from its file into `dtype` on `device`, one tensor at a time; with `defer`, leave each a
    placeholder read when placed (`model.file_weights`, deferred.py)."""
    # parameters already filled (the quantized layers, see `load_text_encoder`) are skipped
    params = {name: param for name, param in model.named_parameters() if param.is_meta}
    missing = [name for name in params if name not in plan]
    if missing:
        raise CheckpointError(f"{path.name}: {len(missing)} text encoder tensors are missing, e.g. {missing[:3]}.")
    wrong = [f"{plan[n]} {tuple(infos[plan[n]].shape)} (expected {tuple(p.shape)})" for n, p in params.items()
             if tuple(infos[plan[n]].shape) != tuple(p.shape)]
    if wrong:
        raise CheckpointError(f"{path.name}: tensor shapes do not fit one Qwen3-VL model: {'; '.join(wrong[:3])}.")
    if defer:
        entries = []
        for name, param in params.items():
            parent, _, leaf = name.rpartition(".")
            kept = nn.Parameter(placeholder(param.shape, dtype), requires_grad=False)
            model.get_submodule(parent)._parameters[leaf] = kept
            entries.append((kept, lambda target, reader, key=plan[name]: target.copy_(reader.read(key))))
        model.file_weights = FileWeights(infos, entries, f"text encoder ({path.name})")
        # encoding calls the language model and the vision tower directly: each reads the weights if still waiting
        for part in (model, *model.children()):
            part.register_forward_pre_hook(materialize_on_input(model.file_weights), with_kwargs=True)
    else:
        with WeightReader(infos) as reader:
            for name in params:
                tensor = reader.load(plan[name], dtype, device)  # a copy of its own, never a view of the file
                parent, _, leaf = name.rpartition(".")
                model.get_submodule(parent)._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    left = [name for name, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"Text encoder tensors left unloaded: {left[:3]}.")


def _fill_quantized(model: nn.Module, plan: dict[str, str], quant, infos: dict, dtype: torch.dtype, device) -> None:
    """Swap each quantized layer of `model` (LM linears, the token table) for a `quantized.QuantLinear` /
    `QuantEmbedding` holding the file's tensors as they are (`infos`: every tensor of the files, scales included);
    everything is checked before the first is read."""
    quant.check_targets(model, plan, allow_embedding="language_model.embed_tokens")
    for name, key in plan.items():
        if key in quant.layers:
            module = model.get_submodule(name.rpartition(".")[0])
            if tuple(quant.layers[key].shape) != tuple(module.weight.shape):
                raise CheckpointError(f"{quant.where}: {key} holds a {list(quant.layers[key].shape)} weight, the model "
                                      f"needs {list(module.weight.shape)}; the file is not one Qwen3-VL model.")
    with WeightReader(infos) as reader:
        for name, key in plan.items():
            if key in quant.layers:
                bias = plan.get(name.removesuffix("weight") + "bias")
                quant.fill_linear(model, name, key, reader.read, dtype, device, bias_key=bias)


def load_text_encoder(path, weight_dtype="default", device="cpu", tokenizer_dir=None, fallback_tokenizer_dir=None,
                      *, dtype=None, defer: bool = False) -> QwenImageTextEncoder:
    """The Qwen-Image 2.1 text encoder from a single file or a diffusers folder, ready to `encode`.

    Args:
        path: `qwen3vl_8b_*.safetensors`, a diffusers `Qwen-Image-2.1/` folder or its `text_encoder/` folder.
        weight_dtype: "default" (the file's), "bf16", "fp16", "fp32" or a torch dtype. fp16 is not validated
            on the real weights (bf16 is the released precision).
        device: where the weights go; they are read there directly.
        tokenizer_dir: a tokenizer/processor folder that overrides the search.
        fallback_tokenizer_dir: tried last (ComfyUI's bundled `qwen25_tokenizer`, passed by the nodes).
        dtype: the former name of `weight_dtype`, still accepted from existing callers.
        defer: check everything, but leave the weights on the file until placed (deferred.py: read straight to
            the GPU, never a whole copy in host memory first). Float files only: a quantized one loads at once.
    """
    if dtype is not None:
        if weight_dtype != "default":
            raise TypeError("load_text_encoder: pass weight_dtype only (dtype is its former name).")
        weight_dtype = dtype
    weights, candidates = locate_text_encoder(path)
    path = Path(path)
    infos, metadata = read_weight_headers(weights)
    quant = None
    if quantization_marker(infos, metadata) is not None:  # a ComfyUI quantized file (model/loaders/kitchen.py)
        from .kitchen import plan_quantization  # comfy-kitchen is imported only for quantized files

        with WeightReader(infos) as blobs:
            quant = plan_quantization(infos, metadata, blobs.read, path.name, QUANTIZED_INSTEAD,
                                      used=lambda key: rename_key(key) is not None)
        file_infos, infos = infos, quant.logical(infos)  # the scales dropped, quantized weights [out, in]
    plan = _plan(infos, path)
    check_dtypes(infos, dict.fromkeys(plan.values(), tuple(FILE_DTYPES)), path.name, "text encoder")
    stored = infos[plan["language_model.embed_tokens.weight"]].dtype
    chosen = choose_dtype(weight_dtype, stored, FLOAT_DTYPES, "text encoder")
    shapes = {name: tuple(infos[key].shape) for name, key in plan.items()}
    if weights.config is not None:
        config = config_from_shapes(shapes, read_json(weights.config, "text encoder config.json"), str(weights.config))
    else:
        config = config_from_shapes(shapes, None, path.name)
    tokenizer, image_processor = load_processor(find_tokenizer_dir(candidates, tokenizer_dir, fallback_tokenizer_dir))
    model = build_empty_model(config, device)
    if quant is not None:
        _fill_quantized(model, plan, quant, file_infos, chosen, device)
    fill_model(model, plan, infos, chosen, device, path, defer=defer and quant is None)
    return QwenImageTextEncoder(model, tokenizer, image_processor, source=str(path))
