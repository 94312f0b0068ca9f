"""A feature is one plug-in (model/features/): a feature declared in this test file alone (a record field with its
check, a block hook, a report entry, verdicts against every other feature) runs through the nodes a user wires,
and the pack's own table is built from its feature modules."""

import pytest
import torch

import graph_fixtures as gf
from qi21.model.features import record as records
from qi21.model.features.plugin import Feature, Refused, RunPart, Supported
from qi21.model.options import FEATURES, PAIRS, options_of, with_options
from qi21.model.transformer.hooks import INTERRUPT, BlockHook
from qi21.nodes.loaders import QI21ModelLoader
from qi21.nodes.samplers import QI21Sampler

WIDTH, HEIGHT, STEPS = 64, 64, 4


class Gain(BlockHook):
    """Scales the rows after the first block (the later blocks read them; the output norm would undo a scale after
    the last): a change of the picture that only this hook can make."""

    order = INTERRUPT + 5
    name = "the toy gain"

    def __init__(self, gain: float, seen: list):
        self.gain, self.seen = gain, seen

    def after_block(self, index, x):
        self.seen.append(index)
        return x * self.gain if index == 0 else x


class GainPart(RunPart):
    def __init__(self, gain, run):
        self.gain, self.run, self.seen, self.closed = gain, run, [], False

    def hooks(self, call):
        return (Gain(self.gain, self.seen),)

    def finish(self, report, notes, run):
        report["toy_gain"] = {"gain": self.gain, "blocks_seen": len(self.seen)}

    def close(self):
        self.closed = True


PARTS = []


def _start(model, record, run):
    PARTS.append(GainPart(record.toy_gain, run))
    return PARTS[-1]


def _check(record):
    if not isinstance(record.toy_gain, float) or not record.toy_gain > 0:
        raise ValueError(f"toy_gain must be a float > 0; got {record.toy_gain!r}.")


TOY = Feature(name="toy_gain", label="the toy gain node", fields={"toy_gain": 1.0},
              is_on=lambda record: record.toy_gain != 1.0, check=_check,
              verdicts={name: Refused("the toy refuses compile.") if name == "compile" else Supported("toy")
                        for name in FEATURES},
              start_run=_start)


@pytest.fixture
def toy_feature(models_root):
    records.register(TOY)
    try:
        yield
    finally:
        records.unregister("toy_gain")


def sample(model):
    out = QI21Sampler.execute(model, gf.synthetic_conditioning(text_runs=[5], seed=1), 3, STEPS, 1.0, WIDTH, HEIGHT, 1)
    return out[0]["samples"], out.ui["qi21_report"][0]


def test_the_pack_table_is_its_feature_modules_verdicts():
    assert set(FEATURES) == {f.name for f in records.features()} and len(PAIRS) == 28
    compile_, devices = (next(f for f in records.features() if f.name == n) for n in ("compile", "devices"))
    assert isinstance(devices.verdicts["compile"], Refused) and PAIRS[frozenset(("compile", "devices"))] is \
        devices.verdicts["compile"]
    assert set(compile_.verdicts) == {"cache", "step_cache", "control"}  # each pair declared once, by the later one


def test_a_feature_declared_in_a_test_file_runs_through_the_nodes(toy_feature):
    plain = QI21ModelLoader.execute(gf.SINGLE["model"], "default")[0]
    expected, plain_report = sample(plain)
    assert "toy_gain" not in plain_report
    gained = with_options(plain, toy_gain=1.5)
    assert options_of(gained).toy_gain == 1.5 and options_of(plain).toy_gain == 1.0  # the input never changes
    assert options_of(gained).active() == ("toy_gain",)
    got, report = sample(gained)
    layers = plain.config.num_layers
    assert report["toy_gain"] == {"gain": 1.5, "blocks_seen": layers * STEPS}  # every block of every call
    assert PARTS[-1].closed
    assert not torch.allclose(got, expected, atol=1e-3)
    off, _ = sample(with_options(gained, toy_gain=1.0))  # off again: exactly the plain picture
    assert torch.equal(off, expected)


def test_its_check_and_its_verdicts_hold_as_the_packs_own(toy_feature):
    plain = QI21ModelLoader.execute(gf.SINGLE["model"], "default")[0]
    with pytest.raises(ValueError, match="toy_gain must be a float > 0"):
        with_options(plain, toy_gain=-1.0)
    compiled = QI21ModelLoader.execute(gf.SINGLE["model"], "default", compile="blocks")[0]
    with pytest.raises(ValueError, match="the Model Loader's compile and the toy gain node do not work together"):
        with_options(compiled, toy_gain=2.0)


def test_a_feature_without_every_verdict_or_with_a_taken_field_is_refused():
    with pytest.raises(ValueError, match="verdicts missing against"):
        records.register(Feature(name="half", label="half", fields={"half": 0}, is_on=bool, verdicts={}))
    with pytest.raises(ValueError, match="another feature's"):
        records.register(Feature(name="dup", label="dup", fields={"loras": ()}, is_on=bool,
                                 verdicts={name: Supported("x") for name in FEATURES}))
    assert [f.name for f in records.features()] == list(FEATURES)


def test_the_route_key_keeps_the_inputs_each_feature_says_decide_a_kept_prefix():
    """nodes/route_key.py is standard library only (clients copy it), so it holds its own table: it must keep at
    least what each feature module declares."""
    from qi21.nodes import route_key

    declared = {node: inputs for feature in records.features() for node, inputs in feature.route_inputs.items()}
    assert declared, "no feature declares route-key inputs"
    for node, inputs in declared.items():
        assert set(inputs) <= set(route_key.KEPT_INPUTS[node]), node


def test_a_lora_applied_through_the_python_api_extends_the_copys_record(models_root, tiny_models):
    """`apply_lora` called directly (benchmarks, the workers) leaves no copy with the record of the model before."""
    from qi21.demo import tiny_checkpoints as tiny
    from qi21.model.features.lora import apply_lora, lora_set

    plain = QI21ModelLoader.execute(gf.SINGLE["model"], "default")[0]
    copy = apply_lora(plain, tiny_models["root"] / "loras" / tiny.SPEED_LORA_FILE, 0.5, name="speed")
    assert lora_set(copy) == (("speed", 0.5),) and options_of(plain).loras == ()
    assert options_of(copy).active() == ("lora",)
