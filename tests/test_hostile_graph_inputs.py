"""Hostile graph inputs of the soak's kinds (issue 34, item 4), each refused with a message naming the input and
followed by a clean run equal to the same run before it: file names that leave their folder (loaders, their
fingerprint, LoadImage in the headless runner), malformed SIGMAS, latents and masks."""

import json
import random

import pytest
import torch

import graph_fixtures as gf
import soak_fixtures as soak
from qi21.demo.workflow_runner import Runner
from qi21.nodes.controlnet import QI21ControlNetLoader
from qi21.nodes.loaders import QI21ModelLoader, QI21TextEncoderLoader, QI21VAELoader
from qi21.nodes.lora import QI21LoraLoader
from qi21.nodes.placement import KEPT_CACHES
from qi21.nodes.samplers import QI21Sampler

NAN = float("nan")


@pytest.fixture(scope="module")
def graph(models_root):
    return {"model": gf.load("model")["model"], "positive": gf.synthetic_conditioning(text_runs=[8])}


def _sample(graph, **inputs):
    inputs = {"width": 64, "height": 64, **inputs}
    out = QI21Sampler.execute(graph["model"], graph["positive"], 11, 2, 1.0, batch_size=1, **inputs)
    return out[0]["samples"]


@pytest.fixture
def clean(graph):
    """The clean run before the hostile one; the test checks the one after it against it."""
    KEPT_CACHES.clear()
    before = _sample(graph)
    yield lambda: torch.equal(_sample(graph), before) and len(KEPT_CACHES) == 0
    KEPT_CACHES.clear()


LOADERS = [(QI21ModelLoader, "model_name", "diffusion_models"), (QI21TextEncoderLoader, "text_encoder_name",
           "text_encoders"), (QI21VAELoader, "vae_name", "vae"), (QI21ControlNetLoader, "control_net_name",
           "model_patches"), (QI21LoraLoader, "lora_name", "loras")]


@pytest.mark.parametrize("node, name_input, kind", LOADERS, ids=[n.__name__ for n, _, _ in LOADERS])
@pytest.mark.parametrize("where", ["../outside.safetensors", "/tmp/qi21_outside.safetensors",
                                   "../vae/qwen_image_2.1_vae_bf16.safetensors"])
def test_a_file_name_outside_its_folder_is_never_read_nor_loaded(models_root, graph, clean, node, name_input, kind,
                                                                 where):
    outside = models_root / "outside.safetensors"
    outside.write_bytes(b"not read")
    try:
        name = where
        assert node.fingerprint_inputs(**{name_input: name}).startswith("unlisted:")  # nothing read to hash it
        assert f"{name!r} is not in the {kind} folders" in node.validate_inputs(**{name_input: name})
        inputs = {name_input: name, "weight_dtype": "fp32"} if node is not QI21LoraLoader else \
            {"model": graph["model"], name_input: name, "strength": 1.0}
        with pytest.raises(ValueError, match="is not in the"):
            node.execute(**inputs)
    finally:
        outside.unlink()
    assert clean()


@pytest.mark.parametrize("image", ["../../etc/passwd", "/etc/passwd", "sub/../../secret.png", ""])
def test_a_graph_whose_load_image_leaves_the_input_folder_is_refused_then_a_clean_graph_runs(models_root, tmp_path,
                                                                                            image):
    soak.write_images(tmp_path / "input")
    runner = Runner(tmp_path / "out", tmp_path / "input", quick=False)
    prompt, _ = soak.build_prompt(random.Random(1), "img2img", 0, (soak.IMAGES[0], False))
    path = tmp_path / "graph.json"
    prompt["4"]["inputs"]["image"] = image
    path.write_text(json.dumps(prompt))
    result = runner.run(path)
    assert not result.ok and "give a file name inside the input folder" in result.error
    prompt["4"]["inputs"]["image"] = soak.IMAGES[0]
    path.write_text(json.dumps(prompt))
    assert runner.run(path).ok


LATENT = torch.zeros(1, 64, 4, 4)
CASES = {
    "sigmas_2d": ({"sigmas": torch.tensor([[1.0, 0.5], [0.3, 0.0]])}, "sigmas must be one schedule"),
    "sigmas_batch": ({"sigmas": torch.tensor([[1.0, 0.5, 0.0]] * 2)}, "sigmas must be one schedule"),
    "sigmas_nan": ({"sigmas": torch.tensor([1.0, NAN, 0.0])}, "sigmas holds NaN"),
    "sigmas_up": ({"sigmas": torch.tensor([0.2, 0.5, 0.0])}, "strictly decreasing"),
    "sigmas_range": ({"sigmas": torch.tensor([1.0, -0.5, 0.0])}, r"must lie in \[0, 1\]"),
    "sigmas_one": ({"sigmas": torch.tensor([1.0])}, "at least two"),
    "latent_nan": ({"latent_image": {"samples": torch.full((1, 64, 4, 4), NAN)}}, "latent_image holds NaN"),
    "latent_sd": ({"latent_image": {"samples": torch.zeros(1, 4, 8, 8)}}, "4 channels"),
    "latent_5d": ({"latent_image": {"samples": torch.zeros(1, 64, 4, 4, 2)}}, "not a Qwen-Image 2.1 latent"),
    "latent_empty": ({"latent_image": {"samples": torch.zeros(0, 64, 4, 4)}}, "latent_image is empty"),
    "latent_no_samples": ({"latent_image": {"x": 1}}, "no 'samples' tensor"),
    "mask_nan": ({"latent_image": {"samples": LATENT, "noise_mask": torch.full((1, 1, 64, 64), NAN)}},
                 "noise_mask holds NaN"),
    "mask_negative": ({"latent_image": {"samples": LATENT, "noise_mask": -torch.ones(1, 1, 64, 64)}},
                      r"noise_mask values must lie in \[0, 1\]"),
    "mask_over_one": ({"latent_image": {"samples": LATENT, "noise_mask": 255 * torch.ones(64, 64)}},
                      r"noise_mask values must lie in \[0, 1\]"),
    "mask_rgb": ({"latent_image": {"samples": LATENT, "noise_mask": torch.ones(1, 3, 64, 64)}},
                 r"noise_mask must be \[H, W\]"),
    "mask_empty": ({"latent_image": {"samples": LATENT, "noise_mask": torch.ones(0, 64, 64)}},
                   r"noise_mask must be \[H, W\]"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_sigmas_latents_and_masks_are_refused_then_a_clean_run(graph, clean, case):
    inputs, says = CASES[case]
    if "latent_image" in inputs:
        inputs = {**inputs, "width": 0, "height": 0}
    with pytest.raises(ValueError, match=says):
        _sample(graph, keep_cache=True, **inputs)
    assert clean()
