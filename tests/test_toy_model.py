"""The toy that was trained here (demo/toy_model.py, demo/train_toy.py): its pictures show what its prompts ask.

Fast: inference only, on the committed files (256x256, 20 Base steps; a picture check reads the background, the
shape's colour and the side it sits on, demo/toy_eval.py `analyse`). The frozen text encoder is pinned too: the
DiT learnt its outputs, so a change there would silently unteach it.
"""

import tempfile
from pathlib import Path

import pytest
import torch

from qi21.demo import toy_model
from qi21.demo.tiny_checkpoints import write_tiny_checkpoints
from qi21.demo.toy_data import Item, Scene
from qi21.demo.toy_eval import ToyPipeline, analyse, psnr, ssim
from qi21.model.encoders.pipeline import encode_prompt
from qi21.model.loaders.text_encoder import load_text_encoder
from qi21.model.sampling.cache_store import PrefixCacheStore

pytestmark = pytest.mark.skipif(not toy_model.toy_available(), reason="the toy's files are not in demo/toy/")
STEPS = 20


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    toy_model.write_toy_checkpoints(root)
    return ToyPipeline(root)


def test_the_frozen_text_encoder_still_says_what_the_dit_learnt():
    with tempfile.TemporaryDirectory() as tmp:
        encoder = load_text_encoder(write_tiny_checkpoints(Path(tmp))["text_encoder"], weight_dtype="fp32")
    states = encode_prompt(encoder, "a large red circle on the left, white background").text
    assert states.shape == (38, 16)
    recorded_last = [-1.155412, 1.01803, 0.693863, -2.303623, 3.158412, 0.588729, 0.550578, -1.612407, 3.594434,
                     -0.34973, 1.737541, 1.328929, -0.563681, 0.040129, 0.068409, -0.322828]
    torch.testing.assert_close(states[-1], torch.tensor(recorded_last), atol=2e-5, rtol=0)
    assert abs(states.abs().sum().item() - 730.0006) < 2e-2


# (prompt, what the picture must read: background, colour, side), each with its own seed
T2I = [
    ("a large red circle on the left, white background", ("white", "red", "left"), 1),
    ("a large blue square on the right, black background", ("black", "blue", "right"), 2),
    ("a large yellow triangle at the top, transparent background", ("transparent", "yellow", "top"), 3),
    ("large green circle at the bottom on a white background", ("white", "green", "bottom"), 4),
]


@pytest.mark.parametrize("prompt, wanted, seed", T2I, ids=[w[1] + "-" + w[2] for _, w, _ in T2I])
def test_a_prompts_colour_and_position_come_out(pipe, prompt, wanted, seed):
    image, report = pipe.generate(prompt, seed, steps=STEPS)
    finding = analyse(image[0])
    assert finding.reading == wanted, (prompt, finding)
    assert report["cache"] == "miss" and report["steps"] == STEPS


def test_the_transparent_background_is_transparent_and_the_shape_opaque(pipe):
    image, _ = pipe.generate("a large red square in the center, transparent background", 5, steps=STEPS)
    alpha = image[0, ..., 3]
    corners = torch.cat([alpha[:24, :24].flatten(), alpha[-24:, -24:].flatten(), alpha[:24, -24:].flatten()])
    assert corners.mean() < 0.05 and alpha[108:148, 108:148].mean() > 0.95


EDITS = [
    (Scene((Item("circle", "red", "left", "large"),), "white"), "make the circle blue", ("white", "blue", "left")),
    (Scene((Item("square", "green", "right", "large"),), "black"), "move it to the left", ("black", "green", "left")),
    (Scene((Item("triangle", "yellow", "center", "large"),), "white"), "remove the background",
     ("transparent", "yellow", "center")),
]


@pytest.mark.parametrize("source, instruction, wanted", EDITS, ids=[e[1] for e in EDITS])
def test_an_edit_keeps_the_references_layout_and_changes_what_it_says(pipe, source, instruction, wanted):
    image, report = pipe.generate(instruction, 6, (pipe.reference(source.render()),), steps=STEPS)
    assert analyse(image[0]).reading == wanted
    assert report["prefix_tokens"] > 256  # the reference's 256 latent rows are in the prefix (and its cache)


def test_a_kept_cache_and_a_partial_reuse_draw_the_same_pictures(pipe):
    source = Scene((Item("circle", "blue", "right", "large"),), "white")
    reference = pipe.reference(source.render())
    store = PrefixCacheStore(budget_bytes=2**30)
    fresh, first = pipe.generate("make the circle red", 7, (reference,), steps=STEPS)
    kept, second = pipe.generate("make the circle red", 7, (reference,), steps=STEPS, keep_cache=True, store=store)
    again, third = pipe.generate("make the circle red", 7, (reference,), steps=STEPS, keep_cache=True, store=store)
    other, fourth = pipe.generate("move it to the left", 7, (reference,), steps=STEPS, keep_cache=True, store=store)
    alone, _ = pipe.generate("move it to the left", 7, (reference,), steps=STEPS)
    assert (first["cache"], second["cache"], third["cache"], fourth["cache"]) == ("miss", "miss", "hit", "partial")
    for a, b in ((kept, fresh), (again, fresh), (other, alone)):
        assert psnr(a, b) > 60 and ssim(a[0], b[0]) > 0.999
    assert analyse(again[0]).reading == ("white", "red", "right")
    assert analyse(other[0]).reading == ("white", "blue", "left")


def test_cfg_with_the_prefix_cache_draws_what_it_draws_without(pipe):
    prompt = "a large green triangle on the right, black background"
    cached, report = pipe.generate(prompt, 8, steps=STEPS, negative="", cfg=3.0)
    plain, off = pipe.generate(prompt, 8, steps=STEPS, negative="", cfg=3.0, prefix_cache=False)
    assert report["cache"] == "miss" and off["cache"] == "off"
    assert psnr(cached, plain) > 60
    assert analyse(cached[0]).reading == ("black", "green", "right")


def test_turbo_draws_in_its_eight_stored_steps(pipe):
    image, report = pipe.generate("a large red circle on the right, white background", 9, turbo=True)
    assert report["steps"] == 8
    assert analyse(image[0]).reading == ("white", "red", "right")


def test_the_training_script_is_deterministic(tmp_path):
    """Two quick runs (a few steps of every phase) write the same bytes: the full run rebuilds the committed files
    the same way on the same torch build and thread count."""
    from qi21.demo import train_toy

    for name in ("a", "b"):
        train_toy.train(tmp_path / name, train_toy.QUICK, log=lambda line: None)
    for name in (toy_model.BASE_FILE, toy_model.TURBO_FILE, toy_model.VAE_FILE):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
