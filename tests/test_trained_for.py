"""A DiT file that declares what it was trained for (model/loaders/trained_for.py): the toy's files say 256x256 and
cfg 1, and a sampler run on the toy at another size or scale still runs and says, in one note (the report's
`notes` and the log), what to expect and what to change. Files that declare nothing (the released weights, the tiny
random set) get no note."""

import logging
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qi21.demo import toy_model
from qi21.demo.tiny_checkpoints import DIT_FILE, TEXT_ENCODER_FILE
from qi21.model.loaders.dit import load_dit
from qi21.model.loaders.safetensors_io import CheckpointError
from qi21.model.loaders.trained_for import TRAINED_FOR_KEY, TrainedFor, read_trained_for, trained_for_notes
from qi21.nodes import bridge
from qi21.nodes.conditioning import QI21TextEncode
from qi21.nodes.loaders import QI21ModelLoader, QI21TextEncoderLoader
from qi21.nodes.samplers import QI21Sampler, QI21TurboSampler

TOY = toy_model.TOY_TRAINED_FOR
AT_512 = ("this is the toy model trained at 256x256, cfg 1: at 512x512 expect specks, not the asked shapes; "
          "use 256x256")


def on(trained):
    """A stand-in model whose loader read `trained` from its file."""
    return SimpleNamespace(source=SimpleNamespace(trained_for=trained))


def test_the_marker_reads_back_what_was_written():
    assert read_trained_for({TRAINED_FOR_KEY: TOY.to_json(), "format": "pt"}, "x.safetensors") == TOY
    assert read_trained_for({"format": "pt"}, "x.safetensors") is None
    plain = read_trained_for({TRAINED_FOR_KEY: '{"model": "m", "sizes": [[512, 768]], "cfg": [1, 4.5]}'}, "x")
    assert plain == TrainedFor("m", ((512, 768),), (1.0, 4.5))  # `expect` is optional


@pytest.mark.parametrize("value, named", [
    ("not json", "is not a JSON object"),
    ('[1, 2]', "is not a JSON object"),
    ('{"model": "m", "sizes": [[256]], "cfg": [1]}', "has sizes = "),
    ('{"model": "m", "sizes": [[256, 0]], "cfg": [1]}', "has sizes = "),
    ('{"model": "m", "sizes": [[256.5, 256]], "cfg": [1]}', "has sizes = "),
    ('{"model": "m", "sizes": [], "cfg": [1]}', "has sizes = "),
    ('{"model": "m", "sizes": [[256, 256]], "cfg": [0.5]}', "has cfg = "),
    ('{"model": "m", "sizes": [[256, 256]], "cfg": [true]}', "has cfg = "),
    ('{"model": "m", "sizes": [[256, 256]], "cfg": "1"}', "has cfg = "),
    ('{"model": "", "sizes": [[256, 256]], "cfg": [1]}', "has model = "),
    ('{"sizes": [[256, 256]], "cfg": [1]}', "has model = "),
    ('{"model": "m", "sizes": [[256, 256]], "cfg": [1], "expect": "noise"}', "has expect = "),
    ('{"model": "m", "sizes": [[256, 256]], "cfg": [1], "expect": {"size": 3}}', "has expect.size = "),
])
def test_a_marker_that_is_not_one_is_refused_naming_the_file_and_the_field(value, named):
    with pytest.raises(CheckpointError, match=f"toy.safetensors: metadata {TRAINED_FOR_KEY} .*{named}"):
        read_trained_for({TRAINED_FOR_KEY: value}, "toy.safetensors")


def test_the_note_says_what_to_expect_and_what_to_change():
    assert trained_for_notes(on(TOY), 256, 256, 1.0) == []
    assert trained_for_notes(on(TOY), 512, 512, 1.0) == [AT_512]
    assert trained_for_notes(on(TOY), 1024, 1024, 1.0) == [AT_512.replace("at 512x512", "at 1024x1024")]
    assert trained_for_notes(on(TOY), 256, 256, 4.0) == [
        "this is the toy model trained at 256x256, cfg 1: at cfg 4 expect colours off the prompt; use cfg 1"]
    assert trained_for_notes(on(TOY), 256, 512, 2.5) == [
        "this is the toy model trained at 256x256, cfg 1: at 256x512, cfg 2.5 expect specks, not the asked shapes "
        "and colours off the prompt; use 256x256, cfg 1"]
    assert trained_for_notes(on(None), 1024, 1024, 4.0) == []  # declares nothing: the released weights
    assert trained_for_notes(object(), 1024, 1024, 4.0) == []  # no source at all (a stand-in)


def test_declaring_rewrites_the_header_only(tmp_path):
    """The committed files carry no marker (train_toy.py --check compares their bytes); the copies the toy's
    layouts are written from declare it, with every tensor bit for bit as committed."""
    committed = toy_model.TOY_DIR / toy_model.BASE_FILE
    with safe_open(str(committed), framework="pt") as handle:
        assert TRAINED_FOR_KEY not in (handle.metadata() or {})
    copy = tmp_path / "base.safetensors"
    save_file(load_file(committed), str(copy), metadata={"format": "pt"})
    toy_model.declare_trained_for(copy, TOY)
    with safe_open(str(copy), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt", TRAINED_FOR_KEY: TOY.to_json()}
    before, after = load_file(committed), load_file(copy)
    assert before.keys() == after.keys()
    assert all(after[k].dtype == before[k].dtype and torch.equal(after[k].view(torch.uint8),
                                                                 before[k].view(torch.uint8)) for k in before)


@pytest.fixture(scope="module")
def toy_root(toy_models):
    bridge.set_models_root(toy_models["root"])
    yield toy_models
    bridge.set_models_root(None)


def test_every_dit_layout_of_the_toy_declares_it_and_the_random_set_does_not(toy_root, tiny_models):
    for path in (toy_root["dit"], toy_root["turbo_dit"], toy_root["diffusers_base"], toy_root["diffusers_turbo"]):
        assert load_dit(path, weight_dtype="fp32").source.trained_for == TOY, path
    assert load_dit(tiny_models["dit"], weight_dtype="fp32").source.trained_for is None


def test_a_bad_marker_in_a_file_is_refused_when_loading(toy_root, tmp_path):
    bad = tmp_path / "bad.safetensors"
    save_file(load_file(toy_root["dit"]), str(bad), metadata={TRAINED_FOR_KEY: '{"model": "m", "sizes": 256}'})
    with pytest.raises(CheckpointError, match=r"bad.safetensors: metadata qi21.trained_for has sizes = '256'"):
        load_dit(bad, weight_dtype="fp32")


@pytest.fixture(scope="module")
def toy_graph(toy_root):
    model = QI21ModelLoader.execute(DIT_FILE, "default")[0]
    turbo = QI21ModelLoader.execute(toy_root["turbo_dit"].name, "default")[0]
    encoder = QI21TextEncoderLoader.execute(TEXT_ENCODER_FILE, "default")[0]
    positive = QI21TextEncode.execute(encoder, "a large red circle on the left, white background", None)[0]
    negative = QI21TextEncode.execute(encoder, "", None)[0]
    return model, turbo, positive, negative


def notes_of(output) -> list[str]:
    return output.ui["qi21_report"][0].get("notes", [])


def test_the_sampler_on_the_toy_at_512_says_so_and_at_256_cfg_1_says_nothing(toy_graph, caplog):
    model, turbo, positive, negative = toy_graph
    with caplog.at_level(logging.WARNING, logger="qi21"):
        at_512 = QI21Sampler.execute(model, positive, 0, 2, 1.0, 512, 512, 1)
    assert at_512[0]["samples"].shape == (1, 64, 32, 32)  # it still runs
    assert AT_512 in notes_of(at_512)
    assert any(AT_512 in record.getMessage() for record in caplog.records)  # and the log says it too
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qi21"):
        at_256 = QI21Sampler.execute(model, positive, 0, 2, 1.0, 256, 256, 1)
    assert not any("toy model" in note for note in notes_of(at_256))
    assert not any("toy model" in record.getMessage() for record in caplog.records)


def test_cfg_counts_only_with_a_negative_prompt_and_the_turbo_sampler_is_checked_too(toy_graph):
    model, turbo, positive, negative = toy_graph
    guided = QI21Sampler.execute(model, positive, 0, 2, 4.0, 256, 256, 1, negative=negative)
    assert "this is the toy model trained at 256x256, cfg 1: at cfg 4 expect colours off the prompt; use cfg 1" \
        in notes_of(guided)
    unguided = QI21Sampler.execute(model, positive, 0, 2, 4.0, 256, 256, 1)  # no negative: cfg is not applied
    assert not any("toy model" in note for note in notes_of(unguided))
    assert AT_512 in notes_of(QI21TurboSampler.execute(turbo, positive, 0, 512, 512, 1))
