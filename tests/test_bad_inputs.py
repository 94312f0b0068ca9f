"""The bad-input matrix, through the node classes: every wrong file, image or setting gets an error (or, where
the input is usable, a note) that names the input and what was expected, before any heavy work, and leaves
nothing loaded. The README's troubleshooting table is this file in prose.

Covered elsewhere, and not repeated here: Qwen-Image 1.x DiTs, quantized DiTs and interrupted DiT loads
(test_dit_loading.py); Wan 2.1 / Qwen-Image 1.x and video VAEs, contradicting config.json (test_vae.py);
missing tokenizers, 2-channel images, masks of the wrong size (test_text_encoder.py); a Base model in the Turbo
sampler (test_nodes.py); NaN at a later step of the bare loop (test_sampling.py). Empty images and an 11th
reference are in test_nodes.py too; here they must also fail before the VAE is touched.
"""

import logging
import pickle
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

import graph_fixtures as gf
from qi21.model.encoders.references import prepare_reference
from qi21.model.loaders.safetensors_io import CheckpointError
from qi21.model.sampling import loop as sampling
from qi21.model.transformer.dit import QwenImage21DiT
from qi21.model.vae.autoencoder import QwenImage21VAE
from qi21.nodes import bridge, placement
from qi21.nodes.conditioning import QI21Reference, QI21TextEncode
from qi21.nodes.decode import QI21VAEDecode
from qi21.nodes.loaders import QI21ModelLoader, QI21TextEncoderLoader, QI21VAELoader
from qi21.nodes.placement import KEPT_CACHES
from qi21.nodes.samplers import QI21Sampler, QI21TurboSampler

BROKEN_REPO = "Qwen-Image-2.1-Broken"


def _zeros(path, shapes):
    save_file({key: torch.zeros(shape) for key, shape in shapes.items()}, str(path))


@pytest.fixture(scope="module")
def models_root(tiny_models, tmp_path_factory):
    """A copy of the tiny set (the shared one is never written to) with wrong, broken and foreign files added."""
    root = tmp_path_factory.mktemp("bad_inputs") / "models"
    shutil.copytree(tiny_models["root"], root)
    foreign = {
        "diffusion_models/flux1-dev.safetensors": {"double_blocks.0.img_attn.qkv.weight": (12, 4),
                                                   "single_blocks.0.linear1.weight": (12, 4)},
        "text_encoders/qwen_2.5_vl_7b.safetensors": {"model.embed_tokens.weight": (8, 4),
                                                     "model.layers.0.self_attn.q_proj.weight": (4, 4),
                                                     "visual.blocks.0.attn.qkv.weight": (12, 4),
                                                     "visual.merger.mlp.0.weight": (4, 4)},
        "vae/sdxl_vae.safetensors": {"encoder.conv_in.weight": (4, 3, 3, 3),
                                     "decoder.up_blocks.0.resnets.0.norm1.weight": (4,),
                                     "decoder.conv_out.weight": (3, 4, 3, 3)},
    }
    for name, shapes in foreign.items():
        _zeros(root / name, shapes)
    own = {"diffusion_models": "model", "text_encoders": "text_encoder", "vae": "vae"}
    for folder, component in own.items():
        for other_folder, other in own.items():  # every other component, filed under this loader's folder
            if other != component:
                shutil.copy(root / other_folder / gf.SINGLE[other], root / folder / f"wrong_{other}.safetensors")
        data = (root / folder / gf.SINGLE[component]).read_bytes()
        (root / folder / "truncated.safetensors").write_bytes(data[: len(data) * 2 // 3])
        torch.save({"img_in.weight": torch.ones(2)}, root / folder / "weights.ckpt")  # zip pickle
        (root / folder / "weights.pt").write_bytes(pickle.dumps({"img_in.weight": [1.0]}, protocol=2))  # legacy
    broken = root / "diffusers" / BROKEN_REPO
    shutil.copytree(root / "diffusers" / "Qwen-Image-2.1", broken)
    (broken / "transformer" / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    (broken / "text_encoder" / "model-00002-of-00002.safetensors").unlink()
    (broken / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    bridge.set_models_root(root)
    yield root
    bridge.set_models_root(None)


@pytest.fixture(scope="module")
def loaded(models_root):
    return gf.load("model", "turbo", "text_encoder", "vae")


@pytest.fixture(autouse=True)
def _empty_store():
    KEPT_CACHES.clear()
    yield
    KEPT_CACHES.clear()


# -- loaders ------------------------------------------------------------------------------------------------------
MODEL, TEXT_ENCODER, VAE = ("diffusion_models", QI21ModelLoader), ("text_encoders", QI21TextEncoderLoader), \
    ("vae", QI21VAELoader)
NEXT_STEP = {
    "diffusion_models": "Put Qwen-Image 2.1 transformer files",
    "text_encoders": "Use text_encoders/qwen3vl_8b_bf16.safetensors",
    "vae": "Use qwen_image_2.1_vae_bf16.safetensors",
}
PICKLE = ("not a safetensors file", "use the .safetensors release")
TRUNCATED = ("is truncated", "download it again")


def loader_case(loader, name, *says):
    """A wrong file for one loader and what the message must say besides the file name."""
    kind, node = loader
    return pytest.param(kind, node, name, says, id=f"{node.__name__}-{name}")


LOADER_CASES = [
    loader_case(MODEL, "flux1-dev.safetensors", "is a Flux-style DiT, not a Qwen-Image 2.1 DiT",
                NEXT_STEP["diffusion_models"]),
    loader_case(MODEL, "wrong_vae.safetensors", "is a VAE, not a Qwen-Image 2.1 DiT", NEXT_STEP["diffusion_models"]),
    loader_case(MODEL, "wrong_text_encoder.safetensors", "is a text encoder", "not a Qwen-Image 2.1 DiT"),
    loader_case(TEXT_ENCODER, "qwen_2.5_vl_7b.safetensors", "Qwen2.5-VL text encoder (Qwen-Image 1.x)",
                NEXT_STEP["text_encoders"]),
    loader_case(TEXT_ENCODER, "wrong_model.safetensors", "is a Qwen-Image 2.1 DiT", "not the Qwen3-VL text encoder"),
    loader_case(TEXT_ENCODER, "wrong_vae.safetensors", "is a VAE, not the Qwen3-VL text encoder",
                NEXT_STEP["text_encoders"]),
    loader_case(VAE, "sdxl_vae.safetensors",
                "GroupNorm VAE (Stable Diffusion / Flux style), not the Qwen-Image 2.1 VAE", NEXT_STEP["vae"]),
    loader_case(VAE, "wrong_model.safetensors", "is a Qwen-Image 2.1 DiT", "not the Qwen-Image 2.1 VAE",
                NEXT_STEP["vae"]),
    loader_case(VAE, "wrong_text_encoder.safetensors", "is a text encoder", "not the Qwen-Image 2.1 VAE"),
    *[loader_case(loader, "truncated.safetensors", *TRUNCATED) for loader in (MODEL, TEXT_ENCODER, VAE)],
    *[loader_case(loader, name, *PICKLE) for loader in (MODEL, TEXT_ENCODER, VAE)
      for name in ("weights.ckpt", "weights.pt")],
    loader_case(MODEL, f"diffusers/{BROKEN_REPO}", "diffusion_pytorch_model-00002-of-00002.safetensors",
                "are missing", "Finish the download"),
    loader_case(TEXT_ENCODER, f"diffusers/{BROKEN_REPO}", "model-00002-of-00002.safetensors", "are missing",
                "Finish the download"),
    loader_case(VAE, f"diffusers/{BROKEN_REPO}", "no .safetensors weights found",
                "diffusion_pytorch_model.safetensors"),
]


def _forbid(*args, **kwargs):
    raise AssertionError("a weight was read or a pickle was loaded before the file was refused")


@pytest.mark.parametrize("kind, node, name, says", LOADER_CASES)
def test_a_wrong_file_is_refused_by_name_before_any_weight_is_read(models_root, monkeypatch, kind, node, name, says):
    assert name in bridge.model_choices(kind) and node.validate_inputs(name, weight_dtype="fp32") is True
    # Headers decide: no tensor is read (safe_open), nothing is unpickled (torch.load, pickle).
    for target in ("safetensors.safe_open", "torch.load",
                   "pickle.load", "pickle.loads", "pickle.Unpickler"):
        monkeypatch.setattr(target, _forbid)
    built = []  # not even an empty (meta) model may be built before the file is refused
    for model_class in (QwenImage21DiT, QwenImage21VAE, Qwen3VLModel):
        monkeypatch.setattr(model_class, "__init__", lambda self, *a, **k: built.append(self) or _forbid())
    files = gf.open_files()
    with pytest.raises(CheckpointError) as error:
        node.execute(name, "fp32")
    message = str(error.value)
    where = name.split("/")[-1]
    assert where in message, f"the message must name {where}: {message}"
    for fragment in says:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert built == [] and gf.open_files() == files  # nothing loaded, no file handle left open


@pytest.mark.parametrize("node, name", [
    pytest.param(QI21ModelLoader, gf.SINGLE["model"], id="model"),
    pytest.param(QI21VAELoader, gf.SINGLE["vae"], id="vae"),
    pytest.param(QI21TextEncoderLoader, gf.SINGLE["text_encoder"], id="text_encoder"),
])
def test_a_load_failing_halfway_frees_the_half_built_model_while_the_error_is_reported(models_root, monkeypatch,
                                                                                       node, name):
    """ComfyUI holds the exception while it reports it; the half-filled model must not live that long."""
    failing_halfway = gf.safe_open_failing_at(5, OSError, "disk read error")
    monkeypatch.setattr("safetensors.safe_open", failing_halfway)
    models = gf.live_models()
    with pytest.raises(OSError, match="disk read error") as error:
        node.execute(name, "fp32")
    assert gf.live_models() == models, "the half-built model is still referenced by the exception"
    assert error.traceback[-1].lineno > 0  # where it failed is still reported


def test_loader_widgets_out_of_their_lists_are_refused_as_comfyui_would(models_root):
    """ComfyUI skips its own combo/min/max checks for nodes whose validate_inputs takes **kwargs (ours)."""
    assert "weight_dtype = 'fp4': expected one of default, bf16, fp16, fp32, fp8_e4m3fn" in \
        QI21ModelLoader.validate_inputs(gf.SINGLE["model"], weight_dtype="fp4")
    assert "attention = 'xformers': expected one of auto, sdpa, flex" in \
        QI21ModelLoader.validate_inputs(gf.SINGLE["model"], weight_dtype="bf16", attention="xformers")
    assert "weight_dtype = 'fp16'" in QI21VAELoader.validate_inputs(gf.SINGLE["vae"], weight_dtype="fp16")
    absent = f"cuda:{torch.cuda.device_count()}"  # one past the GPUs this machine has (cuda:0 on a CPU machine)
    assert f"device = '{absent}'" in QI21TextEncoderLoader.validate_inputs(gf.SINGLE["text_encoder"], device=absent)
    assert QI21TextEncoderLoader.validate_inputs(gf.SINGLE["text_encoder"], weight_dtype="fp32", device="cpu") is True


# -- references ---------------------------------------------------------------------------------------------------
def image(width, height, channels=3, seed=0, batch=1):
    return torch.rand(batch, height, width, channels, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def vae_untouched(loaded, monkeypatch):
    """Fails the test if the VAE is moved or runs: the refusal must come first."""
    monkeypatch.setattr(placement, "on_device", _forbid)
    monkeypatch.setattr(loaded["vae"], "encode", _forbid)
    return loaded["vae"]


@pytest.mark.parametrize("shape", [pytest.param((1, 0, 64, 3), id="no rows"),
                                   pytest.param((1, 64, 0, 4), id="no columns"),
                                   pytest.param((0, 64, 64, 3), id="empty batch")])
def test_an_empty_reference_is_refused_before_the_vae_runs(vae_untouched, shape):
    with pytest.raises(ValueError, match=r"empty \(shape"):
        QI21Reference.execute(vae_untouched, torch.zeros(shape), 1024)


def test_an_eleventh_reference_is_refused_before_the_vae_runs(loaded, monkeypatch):
    ten = QI21Reference.execute(loaded["vae"], image(256, 256), 256)[0] * 10
    monkeypatch.setattr(placement, "on_device", _forbid)
    with pytest.raises(ValueError, match=r"11 references are chained; Qwen-Image 2.1 takes at most 10 .*Remove one"):
        QI21Reference.execute(loaded["vae"], image(256, 256), 256, references=ten)


@pytest.mark.parametrize("size, resolution, says", [
    pytest.param((1, 1), 0, r"1x1 keeping its own size \(resolution 0\) becomes 0x0: .*minimum of 65536 "
                 r".*Use resolution >= 256", id="1x1 own size: too few pixels"),
    pytest.param((1, 300), 1024, r"1x300 at resolution 1024 becomes 64x17728: more elongated than 200:1"
                 r".*Crop the image first", id="1x300: too elongated"),
    pytest.param((200, 250), 0, r"200x250 keeping its own size .* becomes 192x224: .*Use resolution >= 288\.",
                 id="200x250 own size: too few pixels"),
    pytest.param((32, 45), 4096, r"32x45 at resolution 4096 becomes 3456x4864: .*above the vision processor's "
                 r"maximum of 16777216.*Use resolution <= 4064", id="32x45 at 4096: too many pixels"),
])
def test_a_reference_the_vision_processor_would_rescale_is_refused_with_the_fix(vae_untouched, size, resolution,
                                                                                 says):
    with pytest.raises(ValueError, match=says):
        QI21Reference.execute(vae_untouched, image(*size), resolution)


def test_a_1x1_reference_with_a_resolution_becomes_a_flat_swatch(loaded):
    """Nothing to refuse: the resize gives a flat colour at the requested size, as the reference pipeline would."""
    colour = torch.tensor([0.2, 0.6, 1.0]).reshape(1, 1, 1, 3)
    ref = QI21Reference.execute(loaded["vae"], colour, 256)[0][0]
    assert ref.prepared.size == (256, 256) and ref.shape == (16, 16)
    pixels = ref.prepared.pixels[0, :3]
    assert torch.all(pixels == pixels[:, :1, :1]) and torch.isfinite(ref.tokens).all()


@pytest.mark.parametrize("size, grid", [pytest.param((64, 512), (46, 6), id="portrait"),
                                        pytest.param((512, 64), (6, 46), id="landscape")])
def test_a_1_to_8_reference_keeps_its_aspect_at_the_requested_area(loaded, size, grid):
    ref = QI21Reference.execute(loaded["vae"], image(*size), 256)[0][0]
    width, height = ref.prepared.size
    assert ref.shape == grid and width % 32 == 0 and height % 32 == 0 and width * height >= 65536
    assert ref.prepared.vlm_tokens * 4 == ref.tokens.shape[0]  # the slots still line up with the latent grid


def test_grey_references_one_channel_equals_three_equal_channels(loaded):
    """Decision: a 1-channel IMAGE is read as grey, exactly what LoadImage makes of a grey PNG (3 equal channels)."""
    grey = image(288, 256, channels=1)
    one = QI21Reference.execute(loaded["vae"], grey, 0)[0][0]
    three = QI21Reference.execute(loaded["vae"], grey.expand(-1, -1, -1, 3), 0)[0][0]
    assert torch.equal(one.prepared.pixels, three.prepared.pixels) and torch.equal(one.tokens, three.tokens)
    vlm = np.array(one.prepared.vlm_image)
    assert vlm.shape == (256, 288, 3) and (vlm == vlm[..., :1]).all()
    assert torch.all(one.prepared.pixels[0, 3] == 1.0)  # opaque


def test_rgba_reference_keeps_its_alpha_for_the_vae_and_is_flattened_on_white_for_the_vlm(loaded):
    rgba = image(256, 256, channels=4)
    rgba[..., 3] = 1.0
    rgba[:, :, :128, 3] = 0.0
    ref = QI21Reference.execute(loaded["vae"], rgba, 0)[0][0]
    alpha = ref.prepared.pixels[0, 3]  # in [-1, 1]
    assert torch.all(alpha[:, :128] == -1.0) and torch.all(alpha[:, 128:] == 1.0)
    assert (np.array(ref.prepared.vlm_image)[:, :128] == 255).all()  # transparent -> white for the vision tower


def test_a_batch_uses_its_first_image_and_says_so(loaded, caplog):
    batch = image(256, 256, batch=3)
    with caplog.at_level(logging.WARNING, logger="qi21"):
        from_batch = QI21Reference.execute(loaded["vae"], batch, 0)[0]
    assert "a batch of 3 images was given; only the first is used" in caplog.text
    first = QI21Reference.execute(loaded["vae"], batch[:1], 0)[0]
    assert len(from_batch) == 1 and torch.equal(from_batch[0].tokens, first[0].tokens)


@pytest.mark.parametrize("resolution, size", [pytest.param(0, (288, 256), id="own size"),
                                              pytest.param(256, (256, 256), id="resolution 256")])
def test_a_reference_off_the_32_grid_is_resized_onto_it(loaded, resolution, size):
    ref = QI21Reference.execute(loaded["vae"], image(300, 270), resolution)[0][0]
    assert ref.prepared.size == size and ref.shape == (size[1] // 16, size[0] // 16)


def test_a_vae_that_encodes_a_reference_to_nan_is_named(loaded):
    weight = loaded["vae"].encoder.conv_in.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight[0, 0, 0, 0] = float("nan")
        with pytest.raises(FloatingPointError, match=r"The VAE encoded the 256x256 reference to NaN/inf latents"):
            QI21Reference.execute(loaded["vae"], image(256, 256), 0)
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def test_a_text_encoder_that_returns_nan_is_named_not_blamed_on_the_dit(loaded):
    weight = loaded["text_encoder"].model.language_model.layers[0].mlp.down_proj.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.fill_(float("inf"))
        with pytest.raises(FloatingPointError, match=r"text encoder returned NaN/inf states for the prompt 'a cat'"):
            QI21TextEncode.execute(loaded["text_encoder"], "a cat", None)
    finally:
        with torch.no_grad():
            weight.copy_(saved)


# -- samplers -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def positive():
    return gf.synthetic_conditioning([prepare_reference(image(256, 256), None, 0)], seed=1)


BASE_DEFAULTS = dict(seed=7, steps=2, cfg=1.0, width=256, height=256, batch_size=1)
TURBO_DEFAULTS = dict(seed=7, width=256, height=256, batch_size=1)


def sampler_error(node, says, **change):
    """One wrong sampler setting and the message (a regex) it must get."""
    (name, value), = change.items()
    return pytest.param(node, change, says, id=f"{node.__name__}-{name}={value}")


SAMPLER_ERRORS = [
    sampler_error(QI21Sampler, r"width = 16: use 0 \(follow the reference / 1024\) or a size from 32 to 4096",
                  width=16),
    sampler_error(QI21Sampler, r"height = 8192: use 0 .* or a size from 32 to 4096", height=8192),
    sampler_error(QI21TurboSampler, r"width = 31: use 0", width=31),
    sampler_error(QI21Sampler, r"steps = 0: at least 1 step is needed \(40 is the official setting\)", steps=0),
    sampler_error(QI21Sampler, r"steps = 500: expected a value from 1 to 200", steps=500),
    sampler_error(QI21Sampler, r"cfg = 0.5: true CFG scales below 1 are not meaningful; use 1 \(off\) or more",
                  cfg=0.5),
    sampler_error(QI21Sampler, r"cfg = nan: true CFG", cfg=float("nan")),
    sampler_error(QI21Sampler, r"batch_size = 0: expected a value from 1 to 64", batch_size=0),
    sampler_error(QI21TurboSampler, r"seed = -1: expected a value from 0 to 18446744073709551615", seed=-1),
    sampler_error(QI21TurboSampler, r"prefix_cache = 'maybe': expected one of on, off", prefix_cache="maybe"),
]


@pytest.mark.parametrize("node, change, says", SAMPLER_ERRORS)
def test_sampler_settings_are_refused_before_the_model_moves(loaded, positive, monkeypatch, node, change, says):
    """Linked values and scripts reach `execute` without ComfyUI's validation, so it checks again, first."""
    model = loaded["model" if node is QI21Sampler else "turbo"]
    for owner, moves_the_model in ((placement, "on_device"), (placement, "place"), (bridge, "load_managed")):
        monkeypatch.setattr(owner, moves_the_model, _forbid)
    monkeypatch.setattr(sampling, "initial_noise", _forbid)  # the run draws it (loop.run)
    kwargs = dict(BASE_DEFAULTS if node is QI21Sampler else TURBO_DEFAULTS, **change)
    with pytest.raises(ValueError, match=says):
        node.execute(model, positive, **kwargs)
    assert re.search(says, node.validate_inputs(**kwargs))  # the same words in ComfyUI's validation


def _notes(output):
    return output.ui["qi21_report"][0].get("notes", [])


def test_a_size_off_the_32_grid_is_floored_with_a_note(loaded, positive):
    out = QI21Sampler.execute(loaded["model"], positive, **dict(BASE_DEFAULTS, width=300, height=270))
    assert out[0]["samples"].shape[-2:] == (256 // 16, 288 // 16)
    assert "size 300x270 floored to 288x256 (multiples of 32)" in _notes(out)


def test_a_negative_prompt_without_cfg_above_1_is_ignored_with_a_note(loaded, positive):
    negative = gf.synthetic_conditioning(seed=2)
    plain = QI21Sampler.execute(loaded["model"], positive, **BASE_DEFAULTS)
    ignored = QI21Sampler.execute(loaded["model"], positive, **BASE_DEFAULTS, negative=negative)
    assert "negative prompt ignored: true CFG needs cfg > 1" in _notes(ignored)
    assert torch.equal(plain[0]["samples"], ignored[0]["samples"])
    lonely_cfg = QI21Sampler.execute(loaded["model"], positive, **dict(BASE_DEFAULTS, cfg=3.0))
    assert "cfg 3.0 ignored: true CFG needs a negative prompt" in _notes(lonely_cfg)


def test_a_turbo_model_in_the_base_sampler_is_warned(loaded, positive, caplog):
    with caplog.at_level(logging.WARNING, logger="qi21"):
        out = QI21Sampler.execute(loaded["turbo"], positive, **BASE_DEFAULTS)
    expected = "a turbo model in the base sampler: use the Qwen-Image 2.1 Turbo Sampler for it"
    assert any(expected in note for note in _notes(out)) and expected in caplog.text
    base = QI21Sampler.execute(loaded["model"], positive, **BASE_DEFAULTS)
    assert not any("sampler:" in note for note in _notes(base))


def test_nan_from_the_dit_stops_at_the_step_it_happens_with_the_cache_freed(loaded, positive):
    calls = {"n": 0}

    def overflow_at_third_step(module, args, output):
        calls["n"] += 1
        return output * float("inf") if calls["n"] == 3 else output

    handle = loaded["turbo"].register_forward_hook(overflow_at_third_step)
    try:
        with pytest.raises(sampling.NonFiniteLatentsError, match=r"NaN/inf at step 3 of 8 \(sigma 0\.9542\)"):
            QI21TurboSampler.execute(loaded["turbo"], positive, **TURBO_DEFAULTS, keep_cache=True)
    finally:
        handle.remove()
    assert calls["n"] == 3 and gf.filled_caches() == [] and len(KEPT_CACHES) == 0


def test_nan_weights_stop_at_step_1_not_as_a_black_image(loaded, positive):
    weight = loaded["model"].proj_out.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight[0, 0] = float("nan")
        with pytest.raises(sampling.NonFiniteLatentsError,
                           match=r"at step 1 of 2 .*running \S+ \(\w+ compute\); .*download the model file again"):
            QI21Sampler.execute(loaded["model"], positive, **BASE_DEFAULTS)
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def test_decode_refuses_nan_latents_instead_of_a_black_image(loaded):
    latents = torch.zeros(1, 64, 16, 16)
    latents[0, 5, 3, 3] = float("nan")
    with pytest.raises(ValueError, match="QI21VAEDecode: the latents hold NaN/inf values"):
        QI21VAEDecode.execute(loaded["vae"], {"samples": latents})
