"""The few places where the transformers releases the pack supports (4.57 to 5.x) differ, each behind one function.

Qwen3-VL entered transformers in 4.57.0; that is the oldest release the text encoder runs on, and CI runs the
text-encoder and loader tests on it (`.ci/run`, docs/development.md "Lowest supported versions"). Between 4.57 and
the 5.x releases these changed, and the pack takes each on both sides:

- the PIL/numpy Qwen2-VL image processor is `image_processing_qwen2_vl.Qwen2VLImageProcessor` up to 5.5 and
  `image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil` from 5.6 (where the old name became the torchvision
  one). The old class in 4.57 overwrites a `size` argument with its defaults; it keeps `min_pixels`/`max_pixels`.
- the `tokenizers`-backed Qwen2 BPE tokenizer is `Qwen2TokenizerFast` in 4.x and `Qwen2Tokenizer` in 5.x (4.x's
  `Qwen2Tokenizer` is the pure-Python one, which reads vocab.json + merges.txt only, never a tokenizer.json).
- the rotary settings of a config are `rope_theta` + `rope_scaling` in 4.x and one `rope_parameters` dict in 5.x.
- `get_rope_index(input_ids, image_grid_thw)` up to 5.2; from 5.3 it takes `mm_token_type_ids` second, and the
  model's forward takes that argument too.
- `get_image_features` returns (per-image tokens, per-layer DeepStack features of all images) in 4.x; in 5.x an
  output with `pooler_output` and `deepstack_features` (split per image in the later 5.x releases).
- the key/value cache argument and output are `past_key_values` up to 5.2x and `cache` after.
- the vision tower's rotary embedding is built from `(dim, theta)` up to 5.14 and from its config after.

Everything is detected from the installed release itself (a signature, a module, the major version), never
assumed, so a new release that keeps either form keeps working.
"""

import inspect

import torch
import transformers

#: transformers' major version: 4 spells the rotary settings as rope_theta + rope_scaling and names its
#: tokenizers-backed tokenizer Qwen2TokenizerFast
MAJOR = int(transformers.__version__.split(".")[0])


def qwen2_tokenizer_class():
    """The `tokenizers`-backed Qwen2 BPE tokenizer class (reads tokenizer.json, or vocab.json + merges.txt)."""
    if MAJOR < 5:
        from transformers import Qwen2TokenizerFast

        return Qwen2TokenizerFast
    from transformers import Qwen2Tokenizer

    return Qwen2Tokenizer


def pil_image_processor(**settings):
    """transformers' PIL/numpy Qwen2-VL image processor (never the torchvision one) with these settings; `size` is
    `{"shortest_edge", "longest_edge"}` in pixels."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    except ImportError:  # before 5.6 the PIL processor had the plain name
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

        size = settings.get("size") or {}
        # 4.57 replaces a given `size` by its defaults and honours min_pixels / max_pixels only
        return Qwen2VLImageProcessor(**settings, min_pixels=size.get("shortest_edge"),
                                     max_pixels=size.get("longest_edge"))
    return Qwen2VLImageProcessorPil(**settings)


def text_rope_settings(theta: float, mrope_section: list[int]) -> dict:
    """The text config's rotary keyword arguments for interleaved M-RoPE, in the installed release's spelling."""
    rope = {"rope_type": "default", "mrope_section": list(mrope_section), "mrope_interleaved": True}
    if MAJOR < 5:
        return {"rope_theta": theta, "rope_scaling": rope}
    return {"rope_parameters": {**rope, "rope_theta": theta}}


def config_dict(config: dict) -> dict:
    """A Qwen3-VL config.json's content as the installed release reads it: a 5.x file (`rope_parameters`) is
    rewritten to 4.x's `rope_theta` + `rope_scaling` there (4.x would ignore it and use its defaults); 5.x reads
    both spellings itself."""
    text = config.get("text_config")
    if MAJOR >= 5 or not isinstance(text, dict) or not isinstance(text.get("rope_parameters"), dict):
        return config
    rope = dict(text["rope_parameters"])
    text = {key: value for key, value in text.items() if key != "rope_parameters"}
    text["rope_theta"] = rope.pop("rope_theta", text.get("rope_theta", 5_000_000.0))
    text["rope_scaling"] = rope
    return {**config, "text_config": text}


def rope_settings(text_config) -> tuple[float, list[int]]:
    """(rope theta, M-RoPE section) of a loaded text config, either spelling."""
    rope = getattr(text_config, "rope_parameters", None) or {}
    scaling = getattr(text_config, "rope_scaling", None) or {}
    theta = rope.get("rope_theta", getattr(text_config, "rope_theta", None))
    return theta, list(rope.get("mrope_section") or scaling.get("mrope_section") or [])


def rebuild_rotary(module: torch.nn.Module) -> torch.nn.Module | None:
    """A fresh copy of a rotary-embedding module whose tables were made on the meta device; None for a module
    that is not one."""
    if hasattr(module, "config"):
        return type(module)(module.config)
    if not isinstance(getattr(module, "inv_freq", None), torch.Tensor):
        return None
    # the vision rotary embedding up to 5.14: built from (dim, theta) alone, with Qwen3-VL's theta the default;
    # its table holds dim / 2 inverse frequencies
    theta = getattr(module, "theta", None)
    dim = getattr(module, "dim", None) or 2 * module.inv_freq.numel()
    return type(module)(dim) if theta is None else type(module)(dim, theta)


def forward_takes(module: torch.nn.Module, name: str) -> bool:
    return name in inspect.signature(module.forward).parameters


def cache_argument(module: torch.nn.Module) -> str:
    """The name of a forward's key/value cache argument: `cache` (late 5.x) or `past_key_values`."""
    return "cache" if forward_takes(module, "cache") else "past_key_values"


def output_cache(output):
    """The key/value cache a forward returned, under either name."""
    kept = output.get("cache")
    return kept if kept is not None else output.get("past_key_values")


def cache_layers(cache) -> tuple:
    """((keys, values) per layer) of a transformers cache."""
    return tuple((layer.keys, layer.values) for layer in cache.layers)


def rope_index(model, input_ids: torch.Tensor, image_token_id: int, image_grid_thw: torch.Tensor) -> torch.Tensor:
    """M-RoPE position ids `(3, B, L)` for token ids with images."""
    if "mm_token_type_ids" in inspect.signature(model.get_rope_index).parameters:
        return model.get_rope_index(input_ids, (input_ids == image_token_id).long(), image_grid_thw)[0]
    return model.get_rope_index(input_ids, image_grid_thw)[0]


def image_features(model, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor):
    """(merged tokens per image, [per DeepStack layer: features per image]) from the vision tower."""
    got = model.get_image_features(pixel_values, image_grid_thw)
    if isinstance(got, tuple):  # 4.x
        tokens, deepstack = got
    else:
        tokens, deepstack = got.pooler_output, got.deepstack_features
    sizes = [len(t) for t in tokens]
    return tuple(tokens), [tuple(f) if isinstance(f, (tuple, list)) else tuple(torch.split(f, sizes))
                           for f in deepstack]


def run_with_vision(model, input_ids: torch.Tensor, position_ids: torch.Tensor, tokens, deepstack,
                    image_token_id: int):
    """The language model over `input_ids` (one row) with already computed vision outputs at the image tokens,
    returning its output with the key/value cache: what `Qwen3VLModel.forward` does with `pixel_values`, minus the
    vision tower (late 5.x can take the outputs as `mm_encoder_outputs`; this works on every release)."""
    embeds = model.get_input_embeddings()(input_ids)
    mask = input_ids == image_token_id
    merged = torch.cat(list(tokens)).to(embeds.device, embeds.dtype)
    embeds = embeds.masked_scatter(mask[..., None], merged)
    language = model.language_model
    return language(inputs_embeds=embeds, position_ids=position_ids, use_cache=True, visual_pos_masks=mask,
                    deepstack_visual_embeds=[torch.cat(list(layer)) for layer in deepstack])
