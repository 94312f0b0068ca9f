"""The core nodes the headless runner stands in for (demo/core_standins.py): Canny, ImageBatch, KSamplerSelect, the
lazy switch and PreviewAny, and the prompt enhancer that never runs here; and the toy's verdict on a prompt
(demo/toy_workflows.py `asked`). Fast: no model runs."""

import json

import numpy as np
import pytest
import torch

from qi21.demo import core_standins, toy_workflows
from qi21.demo.workflow_runner import Runner
from qi21.nodes import bridge
from qi21.nodes.comfy_sampling import check_sampler


def square_picture(size=64, level=0.0) -> torch.Tensor:
    """White with a square of grey `level` whose outline (rows and columns 19 and 44) is half-way: its edges are
    centred on those pixels, as an antialiased picture's are (a step between two pixels gives both the same
    gradient, and Canny's strict maximum keeps neither)."""
    picture = torch.ones(1, size, size, 3)
    picture[:, 19:45, 19:45] = (1 + level) / 2
    picture[:, 20:44, 20:44] = level
    return picture


def test_canny_outlines_a_square_and_nothing_else():
    (edges,) = core_standins.canny(square_picture(), 0.4, 0.8)
    assert edges.shape == (1, 64, 64, 3) and set(edges.unique().tolist()) == {0.0, 1.0}
    found = edges[0, :, :, 0].numpy() > 0
    ys, xs = np.nonzero(found)
    def near(coords):
        return np.minimum(np.abs(coords - 20), np.abs(coords - 43)) <= 2

    near_border = near(ys) | near(xs)
    assert near_border.all() and ((ys >= 18) & (ys <= 45) & (xs >= 18) & (xs <= 45)).all()
    for side in (found[30, 14:25], found[30, 39:50], found[14:25, 30], found[39:50, 30]):
        assert side.sum() == 1  # each side crossed once: thinned to a line one pixel wide
    assert not found[25:39, 25:39].any()  # the flat inside has none


def test_canny_thresholds_decide_which_steps_are_edges():
    faint = square_picture(level=0.9)  # a step of 0.1
    assert core_standins.canny(faint, 0.4, 0.8)[0].sum() == 0
    assert core_standins.canny(faint, 0.05, 0.1)[0].sum() > 0
    assert core_standins.canny(torch.full((1, 32, 32, 3), 0.5), 0.01, 0.02)[0].sum() == 0  # flat: nothing
    with pytest.raises(ValueError, match="low_threshold 0.9 is above high_threshold 0.2"):
        core_standins.canny(faint, 0.9, 0.2)


def test_image_batch_pads_alpha_and_fits_the_second_image_to_the_first():
    rgb, rgba = torch.rand(1, 32, 48, 3), torch.rand(1, 64, 64, 4)
    (batch,) = core_standins.image_batch(rgb, rgba)
    assert batch.shape == (2, 32, 48, 4)
    assert torch.equal(batch[0, ..., :3], rgb[0]) and (batch[0, ..., 3] == 1).all()


def test_ksampler_select_offers_what_runs_here():
    schema = core_standins.schemas()["KSamplerSelect"]
    options = schema.inputs[0].options["options"]
    assert "euler" in options
    (sampler,) = core_standins.ksampler_select("euler")
    assert check_sampler(sampler) == "euler"
    if not bridge.HAVE_COMFY:
        assert options == ["euler"]


def run_graph(tmp_path, graph: dict):
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(graph))
    return Runner(tmp_path / "out", tmp_path / "input", quick=False).run(path)


def enhancer_graph(switch_on: bool) -> dict:
    """The official templates' prompt path: the user's text, or (switch on) the enhancer's rewrite of it."""
    return {
        "1": {"class_type": "PrimitiveStringMultiline", "inputs": {"value": "a red circle"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": "pe.safetensors", "type": "qwen_image"}},
        "3": {"class_type": "TextGenerate", "inputs": {"clip": ["2", 0], "prompt": ["1", 0], "max_length": 64,
                                                       "sampling_mode": "on"}},
        "4": {"class_type": "ComfySwitchNode", "inputs": {"switch": switch_on, "on_false": ["1", 0],
                                                          "on_true": ["3", 0]}},
        "5": {"class_type": "PreviewAny", "inputs": {"source": ["4", 0]}},
    }


def test_a_switch_that_is_off_never_runs_the_prompt_enhancer(tmp_path):
    result = run_graph(tmp_path, enhancer_graph(switch_on=False))
    assert result.ok, result.error
    notes = " ".join(result.notes)
    assert "node 5 (PreviewAny) shows 'a red circle'" in notes
    for node in ("node 2 (CLIPLoader)", "node 3 (TextGenerate)"):
        assert f"{node} feeds only a switch's branch that is off" in notes


def test_a_switch_that_is_on_is_skipped_naming_the_enhancer(tmp_path):
    result = run_graph(tmp_path, enhancer_graph(switch_on=True))
    assert not result.ok and result.skipped.startswith("its prompt enhancer is switched on: CLIPLoader, TextGenerate")


def test_preview_any_shows_values_as_comfyui_does():
    assert core_standins.preview_any("text") == ("text",)
    assert core_standins.preview_any(3) == ("3",) and core_standins.preview_any(None) == ("None",)
    assert core_standins.preview_any({"a": 1}) == ('{\n    "a": 1\n}',)


@pytest.mark.parametrize("prompt, source, want", [
    ("a large red circle on the left, white background", None, ("white", "red", "left")),
    ("small blue square at the top on a black background", None, ("black", "blue", "top")),
    ("a yellow triangle, large, in the center, transparent background", None, ("transparent", "yellow", "center")),
    ("make the circle blue", ("white", "red", "center"), ("white", "blue", "center")),
    ("move it to the left", ("black", "green", "right"), ("black", "green", "left")),
    ("remove the background", ("white", "red", "center"), ("transparent", "red", "center")),
])
def test_what_a_prompt_asks_of_the_toy(prompt, source, want):
    assert toy_workflows.asked(prompt, source) == (want, "")


@pytest.mark.parametrize("prompt, source", [
    ("A red fox in a snowy forest", None),  # no side, no background
    ("a red circle on the left and a blue square on the right, white background", None),  # two shapes
    ("make the circle purple", ("white", "red", "center")),
    ("Turn the sky into a sunset", ("white", "red", "center")),
])
def test_prompts_outside_the_toys_vocabulary_are_not_judged(prompt, source):
    want, why = toy_workflows.asked(prompt, source)
    assert want is None and "toy" in why
