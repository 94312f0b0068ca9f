"""The checkpoint plumbing the three loaders share (`loaders/checkpoint.py`): the same files are found the same way,
every JSON file of a checkpoint fails the same way (a CheckpointError naming it), shard indexes are checked
against their shards, and `weight_dtype` means the same thing everywhere.

The files are the shared tiny set (ComfyUI single files and diffusers folders), copied per test where a test
breaks one.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qi21.model.loaders import checkpoint
from qi21.model.loaders.checkpoint import CheckpointError, choose_dtype, count_indexed, find_weights, rename_keys
from qi21.model.loaders.dit import load_dit
from qi21.model.loaders.text_encoder import load_text_encoder
from qi21.model.loaders.vae import load_vae

# diffusers component folder -> its loader
LOADERS = {"transformer": load_dit, "vae": load_vae, "text_encoder": load_text_encoder}


@pytest.fixture(scope="module")
def models(tiny_models):
    """The shared tiny set (conftest.py); never written to here: tests that break a file break a copy."""
    return tiny_models


@pytest.fixture
def repo(models, tmp_path):
    """A private copy of the tiny diffusers Base folder, free to break."""
    return shutil.copytree(models["diffusers_base"], tmp_path / "Qwen-Image-2.1")


def _load(component, path, models, **kwargs):
    if component == "text_encoder":
        kwargs.setdefault("fallback_tokenizer_dir", models["tokenizer"])
    return LOADERS[component](path, **kwargs)


# -- every JSON file, one helper -------------------------------------------------------------------------------
BROKEN_JSON = {
    "not JSON": ("{\"_class_name\": ", "is not valid JSON"),
    "not an object": ("[1, 2, 3]", "expected an object"),
    "nested too deep": ("[" * 50_000 + "]" * 50_000, "nests deeper than"),
    "not UTF-8": (b"\x80\x81{}", "is not valid JSON"),
}


@pytest.mark.parametrize("component", LOADERS)
@pytest.mark.parametrize("broken", BROKEN_JSON)
def test_a_broken_config_json_is_named_by_every_loader(models, repo, component, broken):
    content, says = BROKEN_JSON[broken]
    config = repo / component / "config.json"
    config.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(CheckpointError, match=says) as error:
        _load(component, repo, models, weight_dtype="fp32")
    assert str(config) in str(error.value)


def test_a_broken_model_index_is_named(repo):
    (repo / "model_index.json").write_text("{'single': 'quotes'}")
    with pytest.raises(CheckpointError, match=r"model_index\.json.*is not valid JSON"):
        load_dit(repo)


@pytest.mark.parametrize("name", ["preprocessor_config.json", "processor_config.json"])
def test_a_broken_processor_file_is_named(models, repo, name):
    for old in ("preprocessor_config.json", "processor_config.json"):
        (repo / "processor" / old).unlink(missing_ok=True)
    (repo / "processor" / name).write_text("{\"size\": ")
    with pytest.raises(CheckpointError, match=rf"processor/{name}.*not valid JSON"):
        load_text_encoder(repo, weight_dtype="fp32")


def test_a_json_file_that_is_far_too_large_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "MAX_JSON_BYTES", 100)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"padding": "x" * 200}))
    with pytest.raises(CheckpointError, match=r"config\.json: 2\d\d bytes, far too large for a config"):
        checkpoint.read_json(path, "config")


# -- shard indexes ---------------------------------------------------------------------------------------------
def _index(repo, component):
    return next((repo / component).glob("*.safetensors.index.json"))


def _rewrite_index(index, change):
    data = json.loads(index.read_text())
    change(data["weight_map"])
    index.write_text(json.dumps(data))


def _swap_two_shards(weight_map):
    first = next(iter(weight_map))
    other = next(name for name, shard in weight_map.items() if shard != weight_map[first])
    weight_map[first], weight_map[other] = weight_map[other], weight_map[first]


INDEX_PROBLEMS = {
    "no weight_map": (lambda index: index.write_text(json.dumps({"metadata": {}})), "no weight_map"),
    "corrupt": (lambda index: index.write_text("{\"weight_map\": {"), "is not valid JSON"),
    "a path as shard name": (lambda index: _rewrite_index(index, lambda m: m.update(x="../../vae/config.json")),
                             "must be plain file names"),
    "a tensor the shards lack": (lambda index: _rewrite_index(index, lambda m: m.update(missing=min(m.values()))),
                                 r"not in the shard this index names, e\.g\. missing \(index: .*found: nowhere"),
    "tensors in the wrong shard": (lambda index: _rewrite_index(index, _swap_two_shards),
                                   "The index and the shards are from different downloads"),
}


@pytest.mark.parametrize("component", ["transformer", "text_encoder"])
@pytest.mark.parametrize("problem", INDEX_PROBLEMS)
def test_shard_index_problems_are_named(models, repo, component, problem):
    break_it, says = INDEX_PROBLEMS[problem]
    index = _index(repo, component)
    break_it(index)
    with pytest.raises(CheckpointError, match=says) as error:
        _load(component, repo, models, weight_dtype="fp32")
    assert index.name in str(error.value) or str(index.parent) in str(error.value)


@pytest.mark.parametrize("component", ["transformer", "text_encoder"])
def test_a_tensor_repeated_in_two_shards_is_refused(models, repo, component):
    index = _index(repo, component)
    first, second = sorted({index.parent / name for name in json.loads(index.read_text())["weight_map"].values()})
    tensors_1, tensors_2 = load_file(first), load_file(second)
    key = next(iter(tensors_1))
    save_file({**tensors_2, key: tensors_1[key]}, second)
    with pytest.raises(CheckpointError, match=rf"{key} is in both {first.name} and {second.name}"):
        _load(component, repo, models, weight_dtype="fp32")


def test_several_indexes_or_files_are_resolved_by_the_standard_name_or_refused(repo):
    folder = repo / "transformer"
    index = _index(repo, "transformer")
    variants = [folder / f"diffusion_pytorch_model.{v}.safetensors.index.json" for v in ("fp16", "int8")]
    for variant in variants:  # variants beside the model's own index
        shutil.copy(index, variant)
    assert find_weights(repo, "transformer", "x").index == index
    index.unlink()
    with pytest.raises(CheckpointError, match=r"2 shard indexes .*expected one"):
        find_weights(repo, "transformer", "x")
    for variant in variants:
        variant.unlink()
    with pytest.raises(CheckpointError, match=r"2 \.safetensors files .* and no shard index; expected a diffusers"):
        load_dit(repo)


def test_a_diffusers_root_without_the_component_folder_is_named(repo):
    shutil.rmtree(repo / "vae")
    with pytest.raises(CheckpointError, match=r"a diffusers folder without vae/; finish the download"):
        load_vae(repo)


# -- one weight_dtype --------------------------------------------------------------------------------------------
FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@pytest.mark.parametrize("weight_dtype, file_dtype, expected", [
    ("default", "BF16", torch.bfloat16), ("default", "F32", torch.float32), ("default", "F16", torch.float16),
    (None, "F32", torch.float32),
    ("default", "F8_E4M3", torch.bfloat16),  # a non-float file computes in bf16
    ("fp32", "BF16", torch.float32), ("bf16", "F32", torch.bfloat16), (torch.float16, "F32", torch.float16),
])
def test_choose_dtype_is_one_rule(weight_dtype, file_dtype, expected):
    assert choose_dtype(weight_dtype, file_dtype, FLOATS, "thing") == expected


def test_choose_dtype_refuses_with_the_choices():
    with pytest.raises(ValueError, match=r"weight_dtype must be one of \('default', 'bf16', 'fp16', 'fp32', "
                                         r"'fp8_e4m3fn', 'fp8_e4m3fn_fast'\) or a torch dtype; got 'int4'"):
        choose_dtype("int4", "F32", FLOATS, "thing")
    with pytest.raises(ValueError, match=r"weight_dtype fp8_e4m3fn is not supported for the VAE; use default, bf16, "
                                         r"fp16, fp32\."):
        choose_dtype("fp8_e4m3fn", "F32", FLOATS, "VAE")


@pytest.mark.parametrize("component", LOADERS)
def test_every_loader_takes_weight_dtype_and_refuses_unknown_ones_alike(models, component):
    single = {"transformer": models["dit"], "vae": models["vae"], "text_encoder": models["text_encoder"]}[component]
    with pytest.raises(ValueError, match="weight_dtype must be one of"):
        _load(component, single, models, weight_dtype="int4")
    loaded = _load(component, single, models, weight_dtype="fp32")
    model = getattr(loaded, "model", loaded)  # the text encoder wraps its transformers model
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_only_the_dit_stores_fp8():
    assert choose_dtype("fp8_e4m3fn", "BF16", FLOATS + (torch.float8_e4m3fn,), "DiT") == torch.float8_e4m3fn
    for component in ("VAE", "text encoder"):
        with pytest.raises(ValueError, match=f"not supported for the {component}"):
            choose_dtype("fp8_e4m3fn", "BF16", FLOATS, component)


def test_the_text_encoder_keeps_accepting_its_former_dtype_keyword(models):
    encoder = load_text_encoder(models["text_encoder"], dtype="fp32", fallback_tokenizer_dir=models["tokenizer"])
    assert {p.dtype for p in encoder.model.parameters()} == {torch.float32}
    with pytest.raises(TypeError, match="pass weight_dtype only"):
        load_text_encoder(models["text_encoder"], weight_dtype="bf16", dtype="fp32")


def test_the_node_offers_the_shared_dtype_names():
    from qi21.nodes.loaders import WEIGHT_DTYPES

    assert WEIGHT_DTYPES is checkpoint.WEIGHT_DTYPES


# -- names -----------------------------------------------------------------------------------------------------
def test_count_indexed_counts_from_the_largest_index():
    names = ["blocks.0.a", "blocks.11.b", "blocks.3.c", "other.5.d"]
    assert count_indexed(names, r"blocks\.(\d+)\.") == 12
    assert count_indexed(names, r"layers\.(\d+)\.") == 0


def test_two_keys_onto_one_name_are_refused():
    keys = ["model.diffusion_model.img_in.weight", "img_in.weight"]
    with pytest.raises(CheckpointError, match=r"f\.safetensors: both .* map to 'img_in\.weight'; mixed key layouts"):
        rename_keys(keys, lambda key: key.removeprefix("model.diffusion_model."), "f.safetensors")
    assert rename_keys(["a", "b.x"], lambda key: None if key == "a" else key[2:], "f") == {"x": "b.x"}


def test_the_vae_declares_its_source_field(models):
    from qi21.model.vae.autoencoder import QwenImage21VAE

    with torch.device("meta"):
        assert QwenImage21VAE().source is None  # built in memory: no file behind it
    loaded = load_vae(models["vae"], weight_dtype="fp32")
    assert (loaded.source.path, loaded.source.layout) == (models["vae"], "comfyui")
