"""Every pair of features in model/options.py's table, through the nodes a user wires: a supported pair gives what
each feature gives alone, a refused pair is refused when the record is set, naming both.

What "what each gives alone" means depends on the feature (tiny random checkpoints, CPU):
- compile, devices, plan and the Prefix Cache node's device change where and how the numbers are computed, not
  which: with any other feature on, turning one of them on gives the other feature's result (fp32: <= 1e-5; bf16
  weights: bf16's rounding). compile runs dynamo with the "eager" backend here: the same graphs, traced in a
  fraction of inductor's time (tests/test_compiled.py runs inductor).
- the step cache, LoRA, the Fun ControlNet and weight_dtype change the picture. Two of them together give one
  result whatever order the nodes are chained in (exactly), each still acts (the result differs from the other one
  alone), and the step cache skips the steps its rule skips alone (a threshold that skips every step the rule
  allows, so the pattern depends only on the rule).
"""

import functools
import itertools

import pytest
import torch

import graph_fixtures as gf
from qi21.demo import tiny_checkpoints as tiny
from qi21.model.options import FEATURES, FIELDS, PAIRS, ModelOptions, Refused, options_of, verdict, with_options
from qi21.model.parallel import pool as pools
from qi21.model.parallel.split import SplitModel
from qi21.model.sampling.step_cache import StepCacheOptions
from qi21.model.transformer import compiled
from qi21.nodes import loaders
from qi21.nodes.cache import QI21CacheOptions
from qi21.nodes.controlnet import QI21ControlNetApply, QI21ControlNetLoader
from qi21.nodes.loaders import QI21ModelLoader, QI21VAELoader
from qi21.nodes.lora import QI21LoraLoader
from qi21.nodes.samplers import QI21Sampler

WIDTH, HEIGHT, STEPS = 64, 96, 10
ALWAYS = StepCacheOptions(threshold=1e9, edit_threshold=1e9)  # skips every step the rule allows
#: each feature as the loader's inputs turn it on
LOADER = {"compile": dict(compile="blocks"), "devices": dict(devices="cpu,cpu", parallel="ulysses"),
          "weights": dict(weight_dtype="bf16"), "plan": dict(plan="stream")}
TRANSPARENT = ("compile", "devices", "plan", "cache")  # change how, not what, is computed
ACTIVE = ("step_cache", "lora", "control", "weights")  # change the picture
ALL_PAIRS = list(itertools.combinations(FEATURES, 2))
SUPPORTED = [pair for pair in ALL_PAIRS if not isinstance(verdict(*pair), Refused)]
REFUSED = [pair for pair in ALL_PAIRS if isinstance(verdict(*pair), Refused)]


def pair_id(pair) -> str:
    return " x ".join(pair)


@pytest.fixture(scope="module")
def eager_compile():
    """The loader's compile traced with dynamo's eager backend (module docstring)."""
    original = loaders.compile_blocks
    loaders.compile_blocks = functools.partial(compiled.compile_blocks, backend="eager")
    yield
    loaders.compile_blocks = original


@pytest.fixture(scope="module")
def parts(models_root, eager_compile):
    vae = QI21VAELoader.execute(gf.SINGLE["vae"], "default")[0]
    net = QI21ControlNetLoader.execute(tiny.CONTROLNET_FILE)[0]
    image = torch.rand(1, HEIGHT, WIDTH, 3, generator=torch.Generator().manual_seed(2))
    yield {"vae": vae, "net": net, "image": image, "positive": gf.synthetic_conditioning(text_runs=[9], seed=4)}
    pools.close_pools()


def add(feature: str, model, parts):
    """The node that turns `feature` on, applied to `model`."""
    if feature == "cache":
        return QI21CacheOptions.execute(model, "cpu", "default")[0]
    if feature == "step_cache":  # the node's widgets stop at 1; the record takes any threshold
        return with_options(model, step_cache=ALWAYS)
    if feature == "lora":
        return QI21LoraLoader.execute(model, tiny.SPEED_LORA_FILE, 0.8)[0]
    if feature == "control":
        return QI21ControlNetApply.execute(model, parts["net"], parts["vae"], 0.9, control_image=parts["image"])[0]
    raise AssertionError(feature)


def build(features, parts):
    """The model with `features` on: the loader's inputs, then the option nodes in the order given."""
    inputs = {}
    for feature in features:
        inputs.update(LOADER.get(feature, {}))
    weight_dtype = inputs.pop("weight_dtype", "default")
    model = QI21ModelLoader.execute(gf.SINGLE["model"], weight_dtype, **inputs)[0]
    for feature in features:
        if feature not in LOADER:
            model = add(feature, model, parts)
    return model


def sample(model, parts):
    """The Base sampler on `model`: (latents, report)."""
    out = QI21Sampler.execute(model, parts["positive"], 5, STEPS, 1.0, WIDTH, HEIGHT, 1)
    return out[0]["samples"], out.ui["qi21_report"][0]


_REFERENCES = {}


def reference(features, parts):
    """`sample(build(features))`, run once per module for each feature list (several pairs compare with it)."""
    key = tuple(features)
    if key not in _REFERENCES:
        _REFERENCES[key] = sample(build(features, parts), parts)
    return _REFERENCES[key]


def close(got, expected, features):
    """Equal up to where they are computed: fp32's sum order, or bf16's rounding with bf16 weights."""
    tolerance = 2e-2 * expected.abs().max().item() if "weights" in features else 1e-5
    torch.testing.assert_close(got, expected, rtol=0, atol=tolerance)


# -- the table -------------------------------------------------------------------------------------------------------
def test_the_table_has_a_verdict_for_every_pair_and_every_field_a_feature():
    assert len(PAIRS) == len(ALL_PAIRS) == 28 and set(FIELDS.values()) == set(FEATURES)
    assert {f for pair in REFUSED for f in pair} <= set(FEATURES) and all("devices" in pair for pair in REFUSED)
    assert ModelOptions().active() == ()


@pytest.mark.parametrize("pair", SUPPORTED, ids=pair_id)
def test_a_supported_pair_gives_what_each_gives_alone(pair, parts):
    a, b = pair
    model = build(pair, parts)
    record = options_of(model)
    assert set(record.active()) == set(pair)
    if "devices" in pair:
        assert isinstance(model, SplitModel)
    if "compile" in pair:
        assert all(block.compiled is not None for block in model.blocks)
    got, report = sample(model, parts)
    transparent = [f for f in pair if f in TRANSPARENT]
    if transparent:  # the other feature's result (or the plain model's), computed another way
        others = [f for f in pair if f not in transparent]
        expected, alone = reference(others, parts)
        close(got, expected, pair)
        if "step_cache" in pair:
            assert report["step_cache"]["pattern"] == alone["step_cache"]["pattern"]
            assert report["step_cache"]["skipped"] > 0
        if "plan" in pair:
            assert report["plan"]["weights"].startswith("streamed")
        if "cache" in pair and "devices" not in pair:
            assert report["cache_device"] == "cpu"
        return
    # two features that change the picture: one result in either order, and each still acts
    if "weights" not in pair:
        reversed_, _ = sample(build(pair[::-1], parts), parts)
        assert torch.equal(got, reversed_)
    for one in pair:
        alone, alone_report = reference([one], parts)
        assert not torch.allclose(got, alone, atol=1e-4), f"{set(pair) - {one}} did nothing next to {one}"
        if one == "step_cache":
            assert report["step_cache"]["pattern"] == alone_report["step_cache"]["pattern"]
    if "lora" in pair:
        assert [entry["name"] for entry in report["loras"]] == [tiny.SPEED_LORA_FILE]


@pytest.mark.parametrize("pair", REFUSED, ids=pair_id)
def test_a_refused_pair_is_refused_by_name_before_anything_runs(pair, parts):
    names = [FEATURES[f] for f in pair]
    loader_only = all(f in LOADER for f in pair)
    if loader_only:  # ComfyUI's validation refuses the prompt before any node runs
        inputs = {**LOADER[pair[0]], **LOADER[pair[1]]}
        problem = QI21ModelLoader.validate_inputs(model_name=gf.SINGLE["model"], weight_dtype="default", **inputs)
        assert isinstance(problem, str) and all(name in problem for name in names), problem
    with pytest.raises(ValueError) as refused:
        build(pair, parts)
    assert all(name in str(refused.value) for name in names), str(refused.value)
    assert "do not work together" in str(refused.value)


# -- the two that broke --------------------------------------------------------------------------------------------
def test_a_step_cache_on_a_cpu_cpu_model_decides_as_one_process_with_a_realistic_threshold(parts):
    """Ranks that each score their own rows would decide differently; reduced over the group, they decide as one
    process does, step by step (the indicator equal to one process's up to fp32 sum order)."""
    realistic = StepCacheOptions(threshold=0.9, edit_threshold=0.9, start_percent=0.0, end_percent=1.0)
    whole = QI21ModelLoader.execute(gf.SINGLE["model"], "default")[0]
    split = QI21ModelLoader.execute(gf.SINGLE["model"], "default", devices="cpu,cpu", parallel="ulysses")[0]
    expected, single = sample(with_options(whole, step_cache=realistic), parts)
    got, report = sample(with_options(split, step_cache=realistic), parts)
    assert "S" in single["step_cache"]["pattern"] and "F" in single["step_cache"]["pattern"][1:]
    assert report["step_cache"]["pattern"] == single["step_cache"]["pattern"]
    indicator = [x for x in report["step_cache"]["indicator"] if x is not None]
    torch.testing.assert_close(torch.tensor(indicator), torch.tensor(
        [x for x in single["step_cache"]["indicator"] if x is not None]), rtol=0, atol=1e-4)
    close(got, expected, ())


def test_compile_with_devices_is_refused_by_the_loaders_validation():
    problem = QI21ModelLoader.validate_inputs(model_name=None, weight_dtype="default", compile="blocks",
                                              devices="cpu,cpu", parallel="ulysses")
    assert "the Model Loader's compile" in problem and "the Model Loader's devices" in problem
    assert QI21ModelLoader.validate_inputs(model_name=None, weight_dtype="default", compile="blocks",
                                           devices="") is True


# -- the one function ----------------------------------------------------------------------------------------------
def test_with_options_copies_the_model_and_never_changes_its_input(parts):
    model = QI21ModelLoader.execute(gf.SINGLE["model"], "default")[0]
    options = StepCacheOptions()
    copy = with_options(model, step_cache=options)
    assert copy is not model and options_of(copy).step_cache == options and options_of(model).step_cache is None
    assert copy.blocks[0].qkv.weight is model.blocks[0].qkv.weight  # no weight copied
    assert with_options(copy, step_cache=options) is copy  # nothing changes: the same model
    assert options_of(with_options(copy, step_cache=StepCacheOptions(mode="off"))).step_cache is None
    with pytest.raises(ValueError, match="unknown model option"):
        with_options(model, stepcache=options)
    with pytest.raises(ValueError, match="compile must be one of"):
        with_options(model, compile="everything")


def test_a_split_model_made_through_the_api_carries_its_devices_and_takes_a_step_cache():
    """The split model is a recipe, not a module: setting an option copies the recipe (it used to fail with
    "'SplitModel' object has no attribute '_modules'"), and what it cannot take is refused by name."""
    split = SplitModel(devices=("cpu", "cpu"), build=None, args=())
    assert options_of(split).split and options_of(split).devices == ("cpu", "cpu")
    with_cache = with_options(split, step_cache=ALWAYS)
    assert isinstance(with_cache, SplitModel) and with_cache.key == split.key
    assert options_of(with_cache).step_cache == ALWAYS and split.options is None
    with pytest.raises(ValueError, match="the Model Loader.s compile and") as refused:
        with_options(with_cache, compile="blocks")
    assert "the Model Loader's devices / parallel" in str(refused.value)
