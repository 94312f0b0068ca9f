"""A tiny random Qwen3-VL text encoder, written in every file layout we load, a tokenizer for it, and diffusers'
pipeline around them.

The model keeps the real structure at toy size: 3 decoder layers of width 32 (4 query / 2 KV heads of 16), a
3-block vision tower of width 128 with 16 heads, patch 16, merge 2 (so one VLM token is still 32x32 pixels) and
three DeepStack mergers. The values no shape reveals (rope theta, eps, M-RoPE split, DeepStack layers, vision
heads) follow the rules `loaders/text_encoder.py` applies to a single file, so a single file of this model loads to
the same config. Every weight is random, norm scales included, so a mis-mapped tensor cannot hide behind an
identity init.

The tokenizer is generated, never copied: `write_qwen2_tokenizer` (in demo/tiny_tokenizer.py, shared with the
demo's tiny model set) trains a small byte-level BPE with the `tokenizers` library on `TOKENIZER_CORPUS` (Qwen2's
normalizer and pre-tokenizer, so the merges fit the way `Qwen2Tokenizer` splits text) and writes it as Qwen's
tokenizer folders hold it: vocab.json + merges.txt + tokenizer_config.json. Qwen's added tokens keep their real ids
(151643 `<|endoftext|>` ... 151655 `<|image_pad|>` ... 151668 `</think>`): a single file carries no config, so the
loader builds a `Qwen3VLConfig` whose image/vision token ids are the released ones, and the encoder checks the
tokenizer against them. The vocabulary is therefore padded to 151643 entries with `<unused N>` tokens that
byte-level BPE can never produce (a space is never a byte-level symbol), and the model's embedding stays 151936 rows
wide like the real one.
The real Qwen vocabulary is only used by the tests that need it, from the folder `QI21_QWEN_TOKENIZER` names.
"""

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
from transformers.processing_utils import ProcessorMixin

# The generated tokenizer lives with the tiny checkpoint set (one copy); re-exported for the tests that use it.
from qi21.demo.tiny_tokenizer import FIRST_ADDED_ID, QWEN_ADDED_TOKENS, TOKENIZER_CORPUS, write_qwen2_tokenizer  # noqa: F401
from qi21.model.encoders import transformers_compat as compat
from qi21.model.loaders.text_encoder import IMAGE_PROCESSOR_DEFAULTS

#: Test setting (read by the tests only): a folder with the real Qwen2 tokenizer (vocab.json + merges.txt +
#: tokenizer_config.json, e.g. ComfyUI's comfy/text_encoders/qwen25_tokenizer, or tokenizer.json, e.g. the
#: Qwen-Image 2.1 processor/ folder). Tests that count real Qwen tokens run only when it is set.
REAL_TOKENIZER_ENV = "QI21_QWEN_TOKENIZER"

def real_tokenizer_dir() -> Path | None:
    """The folder `QI21_QWEN_TOKENIZER` names, None when unset."""
    value = os.environ.get(REAL_TOKENIZER_ENV, "").strip()
    return Path(value).expanduser() if value else None


# What a Qwen3-VL chat template renders for a system message (the only thing the pipeline renders with it: it
# counts the system-turn tokens to drop).
CHAT_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}{%- if m.content is string %}{{- m.content }}"
    "{%- else %}{%- for c in m.content %}{%- if c.type == 'text' %}{{- c.text }}{%- endif %}{%- endfor %}"
    "{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def tiny_config() -> Qwen3VLConfig:
    text = dict(vocab_size=151936, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=262144,
                **compat.text_rope_settings(5_000_000.0, [4, 2, 2]))
    vision = dict(depth=3, hidden_size=128, intermediate_size=96, num_heads=16, out_hidden_size=32, patch_size=16,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=[0, 1, 2])
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


def tiny_reference_model(seed: int = 0) -> Qwen3VLForConditionalGeneration:
    """transformers' full model (LM head included), fp32, random weights."""
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(tiny_config()).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                is_scale = name.endswith("weight")  # norm scales around 1, biases around 0
                param.copy_(0.2 * torch.randn_like(param) + (1.0 if is_scale else 0.0))
            elif "embed_tokens" in name:
                param.copy_(torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / param[0].numel() ** 0.5)
    return model


def comfy_key(key: str) -> str:
    """transformers' key -> ComfyUI's single-file key (language model flattened under `model.`)."""
    return key.replace("model.language_model.", "model.", 1)


def write_single_file(model, path: Path, layout: str) -> Path:
    """`layout` "comfyui" (flattened language keys) or "hf" (transformers' names), LM head included."""
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if layout == "comfyui":
        state = {comfy_key(k): v for k, v in state.items()}
    save_file(state, str(path))
    return path


def write_tokenizer(source: Path, folder: Path, style: str) -> None:
    """The tokenizer in `source` (vocab.json + merges.txt + tokenizer_config.json) written to `folder` as
    "old": the same three files (older repositories, ComfyUI); "new": tokenizer.json as transformers 5's
    `save_pretrained` writes it."""
    if style == "old":
        shutil.copytree(source, folder, dirs_exist_ok=True)
    else:
        compat.qwen2_tokenizer_class().from_pretrained(str(source), local_files_only=True).save_pretrained(str(folder))


def write_diffusers_folder(model, root: Path, tokenizer_dir: Path, processor_style: str) -> Path:
    """A `Qwen-Image-2.1/`-style folder: model_index.json, text_encoder/ (2 shards + index), processor/.

    `tokenizer_dir` is the tokenizer to write (see `write_tokenizer`).
    `processor_style` "old": `preprocessor_config.json` and vocab.json + merges.txt; "new": one
    `processor_config.json` holding the image processor's settings under "image_processor", and tokenizer.json.
    """
    (root / "text_encoder").mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "QwenImage21Pipeline"}))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(root / "text_encoder" / file))
        weight_map.update({k: file for k in keys})
    (root / "text_encoder" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model.config.to_json_file(str(root / "text_encoder" / "config.json"))
    processor = root / "processor"
    write_tokenizer(tokenizer_dir, processor, processor_style)
    settings = dict(IMAGE_PROCESSOR_DEFAULTS, image_processor_type="Qwen2VLImageProcessorFast")
    if processor_style == "old":
        (processor / "preprocessor_config.json").write_text(json.dumps(settings))
    else:
        (processor / "processor_config.json").write_text(json.dumps(
            {"image_processor": settings, "processor_class": "Qwen3VLProcessor"}))
    return root


def reference_processor(monkeypatch, tokenizer_dir: Path) -> Qwen3VLProcessor:
    """transformers' `Qwen3VLProcessor` with the tokenizer in `tokenizer_dir`, the PIL image processor and no video
    processor.

    Its constructor type-checks the video processor against a class that only exists with torchvision, which this
    project does not install; the check is skipped for that argument alone. Images never reach the video path.
    """
    original = ProcessorMixin.check_argument_for_proper_class

    def check(self, name, arg):
        return None if name == "video_processor" and arg is None else original(self, name, arg)

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", check)
    tokenizer = compat.qwen2_tokenizer_class().from_pretrained(str(tokenizer_dir), local_files_only=True)
    image_processor = compat.pil_image_processor(**IMAGE_PROCESSOR_DEFAULTS)
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                            chat_template=CHAT_TEMPLATE)
