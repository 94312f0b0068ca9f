"""Reference preparation and the Qwen3-VL text encoder, against diffusers 0.42.1 as the oracle.

The oracle is diffusers' own `QwenImage21Pipeline.encode_prompt` (templates, left padding, the identity hook
on the final norm, system-turn drop, image-pad mask) around a tiny random `Qwen3VLForConditionalGeneration`,
fed the references exactly as `QwenImage21Pipeline.__call__` prepares them (RGBA, `calculate_dimensions`,
`image_processor.resize`). One difference from a stock install: diffusers' processor is transformers'
`Qwen3VLProcessor`, whose constructor insists on a torchvision video processor. Without torchvision it is
built with transformers' PIL Qwen2-VL image processor and no video processor (te_fixtures.reference_processor
skips only that type check); the text and image path it runs is the stock one.

Ours loads the same weights from files written in each real layout and must agree within 1e-5 (fp32, CPU).

The tokenizer is a small byte-level BPE in Qwen2's format that te_fixtures generates per session (Qwen's added
tokens at their real ids); nothing fetched is checked in. The few checks that count real Qwen tokens run when
the test setting QI21_QWEN_TOKENIZER names a real Qwen2 tokenizer folder, and are skipped otherwise.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from diffusers import QwenImage21Pipeline
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions
from PIL import Image

from qi21.model.encoders.prompt_template import SYSTEM_PROMPT, SYSTEM_TURN, prompt_text
from qi21.model.encoders.references import MIN_VLM_PIXELS, prepare_reference, reference_size
from qi21.model.loaders.safetensors_io import CheckpointError
from qi21.model.loaders.text_encoder import config_from_shapes, find_tokenizer_dir, load_processor, load_text_encoder
from te_fixtures import (
    QWEN_ADDED_TOKENS,
    REAL_TOKENIZER_ENV,
    real_tokenizer_dir,
    reference_processor,
    tiny_reference_model,
    write_diffusers_folder,
    write_qwen2_tokenizer,
    write_single_file,
)

ATOL = 1e-5
CPU = torch.device("cpu")


def random_image(height, width, channels, seed=0) -> np.ndarray:
    """uint8 [H, W, C]; RGBA gets fully transparent, half and opaque pixels."""
    rng = np.random.default_rng(seed)
    array = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    if channels == 4:
        array[..., 3] = rng.choice([0, 128, 255], size=(height, width))
    return array


def comfy_image(array: np.ndarray) -> torch.Tensor:
    """A ComfyUI IMAGE [1, H, W, C] in [0, 1], as LoadImage makes it from 8-bit data."""
    return torch.from_numpy(array.astype(np.float32) / 255.0).unsqueeze(0)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """The generated Qwen2-format BPE tokenizer (vocab.json + merges.txt + tokenizer_config.json)."""
    return write_qwen2_tokenizer(tmp_path_factory.mktemp("qwen2_bpe"))


@pytest.fixture(scope="session")
def real_tokenizer():
    """The real Qwen2 tokenizer folder named by QI21_QWEN_TOKENIZER; skips the test when the setting is unset."""
    folder = real_tokenizer_dir()
    if folder is None:
        pytest.skip(f"needs the real Qwen2 vocabulary: set {REAL_TOKENIZER_ENV} to a folder holding vocab.json + "
                    "merges.txt + tokenizer_config.json (ComfyUI's comfy/text_encoders/qwen25_tokenizer) or "
                    "tokenizer.json (the Qwen-Image 2.1 processor/ folder)")
    return find_tokenizer_dir([], tokenizer_dir=folder)  # a wrong folder fails here instead of skipping


def make_oracle(model, tokenizer_dir) -> QwenImage21Pipeline:
    with pytest.MonkeyPatch.context() as patch:
        processor = reference_processor(patch, tokenizer_dir)
    return QwenImage21Pipeline(scheduler=None, vae=None, text_encoder=model, processor=processor, transformer=None)


@pytest.fixture(scope="module")
def oracle(tokenizer_dir):
    return make_oracle(tiny_reference_model(), tokenizer_dir)


@pytest.fixture(scope="module")
def files(oracle, tokenizer_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("te")
    write_single_file(oracle.text_encoder, root / "qwen3vl_tiny.safetensors", "comfyui")
    shutil.copytree(tokenizer_dir, root / "qwen3vl_tiny_tokenizer")
    (root / "hf").mkdir()
    write_single_file(oracle.text_encoder, root / "hf" / "qwen3vl_tiny.safetensors", "hf")
    write_diffusers_folder(oracle.text_encoder, root / "diffusers_old", tokenizer_dir, "old")
    write_diffusers_folder(oracle.text_encoder, root / "diffusers_new", tokenizer_dir, "new")
    return root


@pytest.fixture(scope="module")
def encoder(files):
    return load_text_encoder(files / "qwen3vl_tiny.safetensors", dtype="fp32")


def diffusers_references(pipe, arrays, resolution):
    """The condition images as `QwenImage21Pipeline.__call__` hands them to `encode_prompt`."""
    images = []
    for array in arrays:
        image = Image.fromarray(array).convert("RGBA")
        width, height, _ = calculate_dimensions(resolution * resolution, image.size[0] / image.size[1])
        images.append(pipe.image_processor.resize(image, width=width, height=height))
    return images


def assert_matches_diffusers(pipe, encoder, prompts, arrays=(), resolution=288):
    images = diffusers_references(pipe, arrays, resolution) if arrays else None
    with torch.no_grad():
        embeds, mask, slots = pipe.encode_prompt(prompts, image=images, device=CPU)
    ours = encoder.encode_batch(prompts, [prepare_reference(comfy_image(a), resolution=resolution) for a in arrays])
    assert ours.embeds.shape == embeds.shape
    assert (ours.embeds - embeds).abs().max().item() <= ATOL
    expected_mask = torch.ones_like(slots) if mask is None else mask.bool()  # None: nothing was padded
    assert torch.equal(ours.prompt_mask, expected_mask)
    assert torch.equal(ours.image_slots, slots)
    for b, single in enumerate(ours.prompts):  # the per-prompt form is the batch row without its padding
        length = int(ours.prompt_mask[b].sum())
        assert torch.equal(single.embeds, ours.embeds[b, :length])
        assert torch.equal(single.image_slots, ours.image_slots[b, :length])
    return ours


# -- reference preparation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("size,resolution", [((410, 300), 1024), ((300, 410), 288), ((1000, 1000), 512),
                                             ((1920, 1080), 1024), ((333, 517), 640), ((257, 1031), 800)],
                         ids=lambda value: "x".join(map(str, value)) if isinstance(value, tuple) else f"at {value}")
def test_reference_size_is_diffusers_calculate_dimensions(size, resolution):
    width, height, _ = calculate_dimensions(resolution * resolution, size[0] / size[1])
    assert reference_size(*size, resolution) == (width, height)
    assert width % 32 == 0 and height % 32 == 0


def test_resolution_zero_keeps_the_size_floored_to_32_and_an_x32_image_untouched():
    assert reference_size(410, 300, 0) == (384, 288)
    array = random_image(288, 352, 3)
    prepared = prepare_reference(comfy_image(array), resolution=0)
    assert prepared.size == (352, 288)
    expected = torch.from_numpy(array.astype(np.float32) / 255.0 * 2 - 1).permute(2, 0, 1)
    assert torch.allclose(prepared.pixels[0, :3], expected, atol=1e-6)


@pytest.mark.parametrize("channels", [3, 4])
def test_prepared_pixels_and_vlm_image_equal_the_pipeline_resize(oracle, channels):
    array = random_image(300, 410, channels, seed=channels)
    prepared = prepare_reference(comfy_image(array), resolution=320)
    (resized,) = diffusers_references(oracle, [array], 320)
    vae_pixels = oracle.image_processor.preprocess(resized, width=resized.width, height=resized.height)
    assert prepared.pixels.shape == (1, 4, resized.height, resized.width)
    assert torch.equal(prepared.pixels, vae_pixels)
    white = Image.new("RGB", resized.size, (255, 255, 255))
    white.paste(resized, mask=resized.getchannel("A"))
    assert prepared.vlm_image.mode == "RGB"
    assert np.array_equal(np.array(prepared.vlm_image), np.array(white))
    if channels == 3:
        assert torch.all(prepared.pixels[:, 3] == 1.0)  # RGB gets an opaque alpha


def test_mask_becomes_alpha_and_the_vlm_sees_it_over_white():
    array = random_image(256, 288, 3)
    mask = torch.zeros(1, 256, 288)
    mask[:, :64] = 1.0  # ComfyUI: 1 = transparent
    prepared = prepare_reference(comfy_image(array), mask=mask, resolution=0)
    alpha = prepared.pixels[0, 3]
    assert torch.all(alpha[:64] == -1.0) and torch.all(alpha[64:] == 1.0)
    vlm = np.array(prepared.vlm_image)
    assert np.all(vlm[:64] == 255) and np.array_equal(vlm[64:], array[64:])
    assert torch.allclose(prepared.pixels[0, :3, 64:], comfy_image(array)[0, 64:].permute(2, 0, 1) * 2 - 1, atol=1e-6)
    # LoadImage's 64x64 all-zero placeholder mask means opaque; a real mask of the wrong size is refused
    opaque = prepare_reference(comfy_image(array), mask=torch.zeros(64, 64), resolution=0)
    assert torch.all(opaque.pixels[0, 3] == 1.0)
    with pytest.raises(ValueError, match="resize the mask"):
        prepare_reference(comfy_image(array), mask=torch.rand(64, 64), resolution=0)


def test_first_image_of_a_batch_is_the_reference():
    first, second = random_image(256, 256, 3, seed=1), random_image(256, 256, 3, seed=2)
    batch = torch.cat([comfy_image(first), comfy_image(second)])
    assert np.array_equal(np.array(prepare_reference(batch, resolution=0).vlm_image), first)


def test_small_reference_is_refused_with_the_resolution_that_works():
    image = comfy_image(random_image(300, 410, 3))
    with pytest.raises(ValueError, match=rf"minimum of {MIN_VLM_PIXELS}.*Use resolution >= 288\."):
        prepare_reference(image, resolution=256)  # 288x224 = 64512 pixels
    assert prepare_reference(image, resolution=288).size == (352, 256)
    with pytest.raises(ValueError, match=r"resolution 0.*Use resolution >= "):
        prepare_reference(comfy_image(random_image(200, 250, 3)), resolution=0)


@pytest.mark.parametrize("shape", [(0, 10, 3), (10, 0, 4), (1, 0, 0, 3)])
def test_empty_reference_is_refused(shape):
    with pytest.raises(ValueError, match="empty"):
        prepare_reference(torch.zeros(shape), resolution=1024)


def test_reference_channels_must_be_3_or_4():
    with pytest.raises(ValueError, match="C = 3 or 4"):
        prepare_reference(torch.zeros(64, 64, 2))


# -- prompts ------------------------------------------------------------------------------------------------------
def test_templates_are_the_published_strings():
    head = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
    tail = "<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_text("A cat") == head + "A cat" + tail
    assert prompt_text("") == head + " " + tail
    two = "<image1><|vision_start|><|image_pad|><|vision_end|> <image2><|vision_start|><|image_pad|><|vision_end|>"
    assert prompt_text("p", [1, 1]) == head + two + "p" + tail


def test_generated_tokenizer_is_a_qwen2_bpe_with_the_real_special_ids(tokenizer_dir, encoder):
    tokenizer = encoder.tokenizer
    for token_id, text, _ in QWEN_ADDED_TOKENS:
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == [token_id], text
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, len(tokenizer)) == (151643, 151645, 151669)
    assert encoder.image_token_id == encoder.model.config.image_token_id == 151655
    text = "A red fox jumps over the lazy dog, naïvely: 日本 🦊"  # words outside the corpus fall back to bytes
    ids = tokenizer(text)["input_ids"]
    assert max(ids) < 1024 and tokenizer.decode(ids) == text


def test_system_turn_is_dropped_and_the_prompt_tokens_are_kept(oracle, encoder):
    tokenizer = encoder.tokenizer
    # as diffusers derives it: the system message rendered by the processor's chat template, tokenized
    sys_message = [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]}]
    derived = len(oracle.processor.apply_chat_template(sys_message, tokenize=True, return_dict=False)[0])
    system = tokenizer(SYSTEM_TURN)["input_ids"]
    assert encoder.drop_tokens == derived == oracle._drop_idx == len(system)
    assert len(system) > 3  # <|im_start|> "system" ... <|im_end|> "\n": the prompt is split into BPE tokens
    for prompt in ("A cat", "", "a much longer prompt about <image1> and a dog"):
        full = tokenizer(prompt_text(prompt))["input_ids"]
        assert full[: len(system)] == system
        user_turn = f"<|im_start|>user\n{prompt or ' '}<|im_end|>\n<|im_start|>assistant\n"
        kept = tokenizer(user_turn)["input_ids"]
        encoded = encoder.encode(prompt)
        assert encoded.token_ids.tolist() == full[len(system):] == kept
        assert encoded.embeds.shape == (len(kept), encoder.hidden_size)
        assert tokenizer.decode(encoded.token_ids) == user_turn


def test_real_tokenizer_drops_14_system_tokens_and_a_cat_keeps_10(files, real_tokenizer):
    encoder = load_text_encoder(files / "qwen3vl_tiny.safetensors", dtype="fp32", tokenizer_dir=real_tokenizer)
    assert encoder.drop_tokens == 14
    assert encoder.encode("A cat").embeds.shape == (10, encoder.hidden_size)  # docs/checkpoints.md: template


def test_real_tokenizer_matches_diffusers(oracle, files, real_tokenizer):
    real_oracle = make_oracle(oracle.text_encoder, real_tokenizer)
    encoder = load_text_encoder(files / "qwen3vl_tiny.safetensors", dtype="fp32", tokenizer_dir=real_tokenizer)
    assert real_oracle._drop_idx == encoder.drop_tokens == 14
    assert_matches_diffusers(real_oracle, encoder, ["A cat", "", "a much longer prompt about <image1> and a dog"])
    arrays = [random_image(256, 256, 3, seed=0), random_image(300, 260, 4, seed=1)]
    assert_matches_diffusers(real_oracle, encoder, ["Put <image1> on the left", "x"], arrays)


def test_text_to_image_batch_matches_diffusers(oracle, encoder):
    ours = assert_matches_diffusers(oracle, encoder, ["A cat", "", "a much longer prompt about <image1> and a dog"])
    assert not ours.image_slots.any()
    assert not ours.prompt_mask.all()  # different lengths: the padded form is exercised


@pytest.mark.parametrize("channels", [(3,), (4, 3), (3, 4, 4)], ids=["1-rgb", "2-rgba-rgb", "3-rgb-rgba-rgba"])
def test_references_match_diffusers(oracle, encoder, channels):
    shapes = [(256, 256), (300, 260), (250, 330)]
    arrays = [random_image(*shape, c, seed=i) for i, (shape, c) in enumerate(zip(shapes, channels))]
    prompts = ["Put <image1> on the left", "x"] if len(arrays) == 2 else ["<image1> in the style of the last one"]
    ours = assert_matches_diffusers(oracle, encoder, prompts, arrays)
    slots = [prepare_reference(comfy_image(a), resolution=288).vlm_tokens for a in arrays]
    assert ours.image_slots.sum(dim=1).tolist() == [sum(slots)] * len(prompts)


def test_x32_reference_round_trip_gives_one_slot_per_2x2_latent_tokens(encoder):
    prepared = prepare_reference(comfy_image(random_image(288, 352, 4)), resolution=0)  # x32, not x64
    encoded = encoder.encode("<image1> at dusk", [prepared])
    slots = int(encoded.image_slots.sum())
    assert slots == (288 // 32) * (352 // 32) == prepared.vlm_tokens == 99
    h, w = prepared.latent_grid
    assert (h, w) == (288 // 16, 352 // 16) and h * w == 4 * slots
    # the slots form one contiguous run between <|vision_start|> and <|vision_end|>
    where = encoded.image_slots.nonzero().flatten()
    assert where[-1] - where[0] + 1 == slots


def test_inputs_that_would_break_the_slot_count_are_refused(encoder):
    small = Image.fromarray(random_image(224, 224, 3))  # x32, but below 65536 pixels: the VLM would upscale it
    with pytest.raises(ValueError, match=r"gets 64 VLM image tokens but its latent grid needs 49"):
        encoder.encode("p", [small])
    with pytest.raises(ValueError, match="multiples of 32"):
        encoder.encode("p", [Image.fromarray(random_image(250, 260, 3))])
    with pytest.raises(ValueError, match=r"1 extra <\|image_pad\|> token"):
        encoder.encode("a <|image_pad|> typed by hand")


# -- loading ---------------------------------------------------------------------------------------------------------
def test_every_layout_loads_to_the_same_encoder(files, encoder, tokenizer_dir):
    arrays = [random_image(256, 320, 4, seed=5)]
    references = [prepare_reference(comfy_image(a), resolution=288) for a in arrays]
    expected = encoder.encode_batch(["<image1> on a table", "two"], references)
    for path in (files / "hf" / "qwen3vl_tiny.safetensors", files / "diffusers_old", files / "diffusers_new",
                 files / "diffusers_new" / "text_encoder"):
        other = load_text_encoder(path, dtype="fp32", fallback_tokenizer_dir=tokenizer_dir)
        got = other.encode_batch(["<image1> on a table", "two"], references)
        assert torch.equal(got.embeds, expected.embeds), path
        assert torch.equal(got.image_slots, expected.image_slots), path


def test_loading_is_lazy_and_skips_the_head(files, encoder):
    model = encoder.model
    assert not hasattr(model, "lm_head") and isinstance(model.language_model.norm, torch.nn.Identity)
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert all(not p.requires_grad for p in model.parameters())
    bf16 = load_text_encoder(files / "qwen3vl_tiny.safetensors", dtype="bf16")
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert bf16.encode("A cat").embeds.dtype == torch.bfloat16


def test_released_8b_config_is_inferred_from_shapes():
    shapes = {
        "language_model.embed_tokens.weight": (151936, 4096),
        "language_model.layers.0.self_attn.q_norm.weight": (128,),
        "language_model.layers.35.self_attn.q_norm.weight": (128,),
        "language_model.layers.0.self_attn.q_proj.weight": (4096, 4096),
        "language_model.layers.0.self_attn.k_proj.weight": (1024, 4096),
        "language_model.layers.0.mlp.gate_proj.weight": (12288, 4096),
        "visual.patch_embed.proj.weight": (1152, 3, 2, 16, 16),
        "visual.pos_embed.weight": (2304, 1152),
        "visual.blocks.26.norm1.weight": (1152,),
        "visual.blocks.0.mlp.linear_fc1.weight": (4304, 1152),
        "visual.merger.linear_fc1.weight": (4608, 4608),
        "visual.merger.linear_fc2.weight": (4096, 4608),
        "visual.deepstack_merger_list.2.norm.weight": (4608,),
    }
    config = config_from_shapes(shapes)
    text, vision = config.text_config, config.vision_config
    assert (text.num_hidden_layers, text.hidden_size, text.num_attention_heads, text.num_key_value_heads,
            text.head_dim, text.intermediate_size, text.vocab_size) == (36, 4096, 32, 8, 128, 12288, 151936)
    assert text.rope_parameters["mrope_section"] == [24, 20, 20] and text.rope_parameters["rope_theta"] == 5e6
    assert (vision.depth, vision.hidden_size, vision.num_heads, vision.intermediate_size, vision.out_hidden_size,
            vision.spatial_merge_size, vision.patch_size) == (27, 1152, 16, 4304, 4096, 2, 16)
    assert list(vision.deepstack_visual_indexes) == [8, 16, 24]


def _write(path, tensors):
    from safetensors.torch import save_file
    save_file({k: torch.zeros(v) for k, v in tensors.items()}, str(path))
    return path


def test_foreign_files_are_refused_by_name(tmp_path, tokenizer_dir):
    dit = _write(tmp_path / "qwen_image_2.1_bf16.safetensors",
                 {"txt_in.text_norm.weight": (4,), "modulation.1.weight": (4, 4)})
    qwen25 = _write(tmp_path / "qwen_2.5_vl_7b.safetensors",
                    {"model.embed_tokens.weight": (8, 4), "model.layers.0.self_attn.q_proj.weight": (4, 4),
                     "visual.blocks.0.attn.qkv.weight": (12, 4), "visual.merger.mlp.0.weight": (4, 4)})
    vae = _write(tmp_path / "qwen_image_2.1_vae.safetensors", {"decoder.conv_in.weight": (4, 4, 3, 3)})
    for path, found in ((dit, "Qwen-Image 2.1 DiT"), (qwen25, "Qwen2.5-VL"), (vae, "a VAE")):
        with pytest.raises(CheckpointError, match=rf"{path.name} is .*{found}.*not the Qwen3-VL text encoder"):
            load_text_encoder(path, fallback_tokenizer_dir=tokenizer_dir)
    truncated = tmp_path / "qwen3vl_8b_bf16.safetensors"
    truncated.write_bytes(dit.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match="truncated"):
        load_text_encoder(truncated)
    pickle = tmp_path / "qwen3vl.safetensors"
    torch.save({"a": torch.zeros(2)}, pickle)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        load_text_encoder(pickle)


def test_tokenizer_is_found_beside_the_file_or_in_the_fallback(files, tokenizer_dir, tmp_path):
    single = tmp_path / "qwen3vl_tiny.safetensors"
    shutil.copy(files / "qwen3vl_tiny.safetensors", single)
    with pytest.raises(CheckpointError, match=r"No tokenizer found.*qwen3vl_tiny_tokenizer.*tokenizer"):
        load_text_encoder(single)
    fallback = load_text_encoder(single, dtype="fp32", fallback_tokenizer_dir=tokenizer_dir)
    shutil.copytree(tokenizer_dir, tmp_path / "tokenizer")
    beside = load_text_encoder(single, dtype="fp32")
    assert torch.equal(fallback.encode("A cat").embeds, beside.encode("A cat").embeds)


@pytest.mark.parametrize("style", ["preprocessor_config.json", "processor_config.json"])
def test_image_processor_settings_are_read_from_either_processor_file(tokenizer_dir, tmp_path, style):
    settings = {"size": {"shortest_edge": 3136, "longest_edge": 12845056}, "patch_size": 16, "merge_size": 2,
                "image_processor_type": "Qwen2VLImageProcessorFast"}
    shutil.copytree(tokenizer_dir, tmp_path / "processor")
    payload = settings if style == "preprocessor_config.json" else {"image_processor": settings}
    (tmp_path / "processor" / style).write_text(json.dumps(payload))
    _, image_processor = load_processor(tmp_path / "processor")
    assert image_processor.size["shortest_edge"] == 3136 and image_processor.size["longest_edge"] == 12845056
    _, defaults = load_processor(tokenizer_dir)  # no processor file: the released values
    assert defaults.size["shortest_edge"] == MIN_VLM_PIXELS and list(defaults.image_mean) == [0.5, 0.5, 0.5]


def test_an_explicit_tokenizer_folder_must_hold_a_tokenizer(files, tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer.json, nor vocab.json"):
        load_text_encoder(files / "qwen3vl_tiny.safetensors", tokenizer_dir=tmp_path)


# -- reuse of the references' leading run (model/encoders/prompt_cache.py) ---------------------------------------------
def counted_vision(encoder, monkeypatch):
    calls = []
    real = encoder.model.get_image_features

    def counting(pixel_values, grid, **kwargs):
        calls.append(tuple(grid[0].tolist()))
        return real(pixel_values, grid, **kwargs)

    monkeypatch.setattr(encoder.model, "get_image_features", counting)
    return calls


def test_a_new_instruction_runs_only_its_tokens_and_equals_a_full_encode(oracle, encoder, monkeypatch):
    arrays = [random_image(256, 256, 3, seed=1), random_image(300, 260, 4, seed=2)]
    refs = [prepare_reference(comfy_image(a), resolution=288) for a in arrays]
    encoder.prompt_cache.clear()
    calls = counted_vision(encoder, monkeypatch)
    first = encoder.encode("Put <image1> beside <image2> at dawn", refs)
    assert encoder.last_reused_tokens == 0 and len(calls) == 2
    lead = int(first.image_slots.nonzero()[-1]) + 2  # through the last <|vision_end|>
    second = encoder.encode("Put <image2> on the left and make it a winter scene", refs)
    assert encoder.last_reused_tokens == lead + encoder.drop_tokens and len(calls) == 2  # no vision tower at all
    assert torch.equal(second.embeds[:lead], first.embeds[:lead])  # bit for bit: the DiT reuses those rows too
    # positive and negative after the same references in one call share the run as well
    both = assert_matches_diffusers(oracle, encoder, ["Put <image2> on the left and make it a winter scene", " "],
                                    arrays)
    assert encoder.last_reused_tokens == lead + encoder.drop_tokens and len(calls) == 2
    encoder.prompt_cache.budget_bytes = 0  # reuse off: the plain full encode
    try:
        full = encoder.encode("Put <image2> on the left and make it a winter scene", refs)
    finally:
        encoder.prompt_cache.budget_bytes = 2**31
    assert (second.embeds - full.embeds).abs().max().item() <= ATOL
    assert torch.equal(both.prompts[0].embeds, second.embeds)
    del calls[2:]  # the full encode ran the tower inside transformers' forward
    # another second reference: its vision output and everything after the first reference is computed again
    other = [refs[0], prepare_reference(comfy_image(random_image(300, 260, 4, seed=9)), resolution=288)]
    encoder.encode("Put <image1> beside <image2> at dawn", other)
    assert encoder.last_reused_tokens == 0 and len(calls) == 3
    assert encoder.prompt_cache.nbytes <= encoder.prompt_cache.budget_bytes
    encoder.prompt_cache.clear()


def test_the_prompt_cache_stays_in_its_budget_and_an_interrupted_encode_keeps_no_run(encoder):
    refs = [prepare_reference(comfy_image(random_image(256, 256, 3, seed=4)), resolution=288)]
    cache = encoder.prompt_cache
    cache.clear()
    encoder.encode("<image1> in fog", refs)
    one_run = cache.nbytes
    cache.clear()
    layers = {"n": 0}

    class Stop(Exception):
        pass

    def stop_in_the_language_model():
        layers["n"] += 1
        if layers["n"] == len(encoder.model.visual.blocks) + 2:  # the second decoder layer of the leading run
            raise Stop

    with pytest.raises(Stop), encoder.interruptible(stop_in_the_language_model):
        encoder.encode("<image1> in fog", refs)
    assert [key.split(":")[0] for key in cache._entries] == ["vision"]  # no half-run leading run
    cache.budget_bytes = one_run - 1  # too small for both entries: the older goes
    try:
        encoder.encode("<image1> in fog", refs)
        assert cache.nbytes <= cache.budget_bytes and len(cache) == 1
    finally:
        cache.budget_bytes = 2**31
        cache.clear()


def test_the_lead_key_names_the_references_and_the_text_before_them(encoder):
    from qi21.model.encoders.pipeline import Reference, encode_prompt

    def reference(seed):
        prepared = prepare_reference(comfy_image(random_image(256, 256, 3, seed=seed)), resolution=288)
        h, w = prepared.latent_grid
        return Reference(prepared, torch.zeros(h * w, 64), (h, w))

    one, two = reference(1), reference(2)
    key = encode_prompt(encoder, "<image1> at night", [one]).lead_key
    assert key == encode_prompt(encoder, "<image1> under snow, much later", [one]).lead_key  # other words
    assert key != encode_prompt(encoder, "<image1> at night", [two]).lead_key  # another reference
    assert key != encode_prompt(encoder, "<image1> at night", [one, two]).lead_key
    assert encode_prompt(encoder, "a cat", []).lead_key is None
    encoder.prompt_cache.clear()
