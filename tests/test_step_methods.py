"""The step methods beyond T8's rule (model/sampling/step_methods.py): a front/back split (a probe of 0 blocks too),
a forecast of order 1-2, a steps mask and a calibrated schedule, and the presets the node offers.

As in test_step_cache.py the random model says nothing about quality (benchmarks/step_cache_peers.py measures that on
the trained toy); these check what a skipped call computes, that a method whose steps all run is exact, that the
methods keep the prefix cache (kept across runs too), CFG, batches, a ComfyUI-style sampler, the Fun ControlNet, and
that a split model's ranks decide alike.
"""

import json

import pytest
import torch

from dit_fixtures import unit_scale_dit
from qi21.model.prefix_cache.kept_entries import PrefixCacheStore
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.sampling.step_cache import StepCache, StepCacheOptions
from qi21.model.sampling.step_methods import StepMethods, full_steps, newton_forecast
from qi21.model.sampling.step_presets import PRESETS_FILE, load_presets
from qi21.model.transformer.dit import PrefixInputs
from qi21.model.transformer.hooks import Resume
from test_step_cache import CONFIG, GRID, conditioning, count_calls, heun, run

STATIC = 1e9
#: every step of 20 runs in full: the hook only reads
EVERY_STEP = dict(decide="mask", full_every=1, threshold=STATIC, edit_threshold=STATIC)
#: the first 3 steps, then every 4th step from step 3 on (3, 7, 11, 15, 19) and the last, on 20 steps
MASK = dict(decide="mask", full_first=3, full_every=4, full_last=1, threshold=STATIC, edit_threshold=STATIC)
MASK_PATTERN_20 = "FFFFSSSFSSSFSSSFSSSF"
TAYLOR1 = dict(mode="taylor", order=1)


@pytest.fixture(scope="module")
def model():
    return unit_scale_dit(CONFIG, seed=5)


# -- exact where nothing is skipped ----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", [dict(probe_blocks=0), dict(back_blocks=1), dict(probe_blocks=2, back_blocks=1),
                                    dict(mode="taylor", order=2)], ids=["P0", "F1B1", "F2B1", "taylor2"])
@pytest.mark.parametrize("path", ["t2i", "edit, cfg, batch 2", "cache off"])
def test_a_method_that_runs_every_step_is_bit_identical(model, method, path):
    kwargs = {"t2i": {}, "edit, cfg, batch 2": dict(positive=conditioning(True), negative=conditioning(True, seed=4),
                                                     cfg=3.0, batch_size=2),
              "cache off": dict(prefix_cache=False)}[path]
    exact = run(model, steps=8, **kwargs)
    got = run(model, steps=8, step_cache=StepCacheOptions(**EVERY_STEP, **method), **kwargs)
    assert torch.equal(got.latents, exact.latents)
    assert got.report["step_cache"]["pattern"] == "F" * 8
    off = run(model, steps=8, step_cache=StepCacheOptions(**{**MASK, **method, "mode": "off"}), **kwargs)
    assert torch.equal(off.latents, exact.latents) and "step_cache" not in off.report


def test_threshold_0_gives_no_step_cache_for_every_method():
    for method in (dict(back_blocks=1), dict(mode="taylor"), MASK):
        options = StepCacheOptions(**{**method, "threshold": 0.0, "edit_threshold": 0.0})
        assert StepCache.for_run(options, [1.0, 0.0], edit=False, num_layers=4) is None


# -- what a skipped call computes --------------------------------------------------------------------------------------
def _two_calls(model, options, first=1.0, second=0.5):
    """A prefill at `first`, then a cached call at `second` that `options` skip: each call's block outputs (target
    rows), the stepper, the skipped call's output, its embedded rows, modulation, final scale and `Rows`, the cache."""
    cond = conditioning()
    prefixes = [PrefixInputs(layout=cond.layout(GRID), text=cond.text)]
    x_a, x_b = torch.randn(2, 1, GRID[0] * GRID[1], 64, generator=torch.Generator().manual_seed(8)).unbind(0)
    tokens, calls, kv = x_a.shape[1], [], PrefixKVCache()
    hooks = [block.register_forward_hook(lambda module, args, out, i=i: calls[-1].__setitem__(i, out[-tokens:].clone()))
             for i, block in enumerate(model.blocks)]
    stepper = StepMethods(options, [1.0, 0.5, 0.0], edit=False, num_layers=4, probe_blocks=options.probe_blocks)
    try:
        with torch.no_grad():
            calls.append({})
            model(x_a, first, prefixes, cache=kv, mode="prefill", hooks=[stepper.call(first, mode="prefill")])
            calls.append({})
            out = model(x_b, second, prefixes, cache=kv, mode="cached", hooks=[stepper.call(second)])
            embedded, mods, final_scale, rows = model.prepare(x_b, second, prefixes, cache=kv, mode="cached")
    finally:
        for hook in hooks:
            hook.remove()
    return calls, stepper, out, (embedded, mods, final_scale, rows), kv


def test_a_split_skip_adds_the_middle_residual_and_runs_the_back_block(model):
    options = StepCacheOptions(back_blocks=1, threshold=STATIC, edit_threshold=STATIC, start_percent=0.0)
    (full, skipped), stepper, out, (_, mods, final_scale, rows), kv = _two_calls(model, options)
    assert sorted(skipped) == [0, 3], "block 0 (the probe) and block 3 (the back block) run; 1 and 2 never"
    assert stepper.records[1][2] and stepper.report()["back_blocks_ran"] == 1
    middle = full[2] - full[0]  # blocks 1..2 on the full call
    with torch.no_grad():  # block 3 on block 0's output + the middle residual, by hand
        by_hand = model.blocks[3]((skipped[0] + middle).clone(), mods, rows, kv.layer_kv(3), drop_prefix=True)
    torch.testing.assert_close(skipped[3], by_hand, rtol=0, atol=1e-5)
    torch.testing.assert_close(out, model.final_layer(skipped[3], final_scale, rows), rtol=0, atol=1e-5)
    assert stepper.report()["blocks_skipped_share"] == round(2 / 8, 4)  # 2 of 4 blocks on 1 of 2 calls


def test_a_skip_without_a_probe_runs_no_block(model):
    options = StepCacheOptions(probe_blocks=0, decide="mask", full_first=1, threshold=STATIC, edit_threshold=STATIC)
    (full, skipped), stepper, out, (embedded, _, final_scale, rows), _ = _two_calls(model, options)
    assert skipped == {} and len(full) == 4, "no block runs on the skipped call"
    sigma, residual = stepper._residual  # every block's residual on the full call (input of block 0 to the end)
    assert sigma == 1.0
    torch.testing.assert_close(out, model.final_layer(embedded + residual[0], final_scale, rows), rtol=0, atol=1e-5)
    report = stepper.report()
    assert report["indicator"] == [None, None] and report["blocks_skipped_share"] == 0.5


def test_only_a_cached_step_may_skip_blocks(model):
    cond = conditioning()
    prefixes = [PrefixInputs(layout=cond.layout(GRID), text=cond.text)]

    class Jump:
        order, cache_layers, runs_split, name = 30, 0, True, "a jump"

        def start(self, *args):
            return None

        def after_block(self, index, x):
            return Resume(3, x) if index == 0 else x

        def end(self, x):
            pass

    with torch.no_grad(), pytest.raises(ValueError, match="only a cached step may skip blocks"):
        model(torch.randn(1, GRID[0] * GRID[1], 64), 0.5, prefixes, hooks=[Jump()])
    # without the prefix cache a split run replays everything after the probe: no back block, no stale prefix
    report = run(model, prefix_cache=False, step_cache=StepCacheOptions(back_blocks=1, **MASK)).report["step_cache"]
    assert report["pattern"] == MASK_PATTERN_20 and report["back_blocks_ran"] == 0


def test_newton_forecast_is_exact_on_a_line_and_a_parabola():
    line = [(0.9, torch.tensor([1.0])), (0.7, torch.tensor([2.0]))]  # value = 5.5 - 5 sigma
    torch.testing.assert_close(newton_forecast(line, 0.5), torch.tensor([3.0]))
    parabola = [(s, torch.tensor([s * s - s])) for s in (0.9, 0.7, 0.6)]
    torch.testing.assert_close(newton_forecast(parabola, 0.4), torch.tensor([0.4 * 0.4 - 0.4]))
    torch.testing.assert_close(newton_forecast(parabola[-1:], 0.1), parabola[-1][1])  # order 0: replay


# -- the decisions -----------------------------------------------------------------------------------------------------
def test_masks_and_schedules_name_their_full_steps():
    assert full_steps(StepCacheOptions(**MASK), 20) == {i for i, c in enumerate(MASK_PATTERN_20) if c == "F"}
    schedule = StepCacheOptions(decide="schedule", schedule=(0.0, 0.25, 0.5))
    assert full_steps(schedule, 40) == {0, 10, 20} and full_steps(schedule, 8) == {0, 2, 4}
    assert full_steps(StepCacheOptions(), 20) is None


@pytest.mark.parametrize("method", [dict(), dict(probe_blocks=0), dict(back_blocks=1, **TAYLOR1),
                                    dict(probe_blocks=0, back_blocks=2, mode="taylor", order=2)],
                         ids=["P1", "P0", "F1B1 taylor1", "P0B2 taylor2"])
def test_a_mask_skips_its_steps_on_every_path(model, method):
    options = StepCacheOptions(**MASK, **method)
    later = count_calls(model.blocks[1])
    result = run(model, step_cache=options)
    report = result.report["step_cache"]
    assert report["pattern"] == MASK_PATTERN_20 and report["window"] is None
    assert len(later) == MASK_PATTERN_20.count("F"), "block 1 is a middle block of every method here"
    assert torch.isfinite(result.latents).all()
    store = PrefixCacheStore(budget_bytes=None)  # the prefix cache kept across runs: its first step is full
    first = run(model, keep_cache=True, store=store, step_cache=options)
    kept = run(model, keep_cache=True, store=store, step_cache=options, seed=2)
    assert kept.report["cache"] == "hit" and kept.report["step_cache"]["pattern"] == MASK_PATTERN_20
    assert first.report["step_cache"]["pattern"] == MASK_PATTERN_20
    batched = run(model, positive=conditioning(True), negative=conditioning(True, seed=4), cfg=3.0, batch_size=2,
                  step_cache=options)
    assert batched.report["step_cache"]["pattern"] == MASK_PATTERN_20 and torch.isfinite(batched.latents).all()
    if options.back_blocks:
        assert report["back_blocks_ran"] == MASK_PATTERN_20.count("S")


def test_a_sampler_with_two_calls_a_step_follows_the_mask_by_sigma(model):
    report = run(model, steps=8, sampler=heun, step_cache=StepCacheOptions(
        decide="mask", full_first=2, full_every=3, threshold=STATIC, probe_blocks=0, **TAYLOR1)).report["step_cache"]
    # calls at s0, s1, s1, s2, s2, ..., s7, s7 (steps 0..7): full steps 0, 1, 2, 5 -> both calls at their sigma
    assert report["per"] == "model call" and report["pattern"] == "FFFFFSSSSFFSSSS"


def test_the_indicator_still_decides_between_the_mask_steps(model):
    options = StepCacheOptions(decide="mask", full_first=2, full_every=5, threshold=0.8, edit_threshold=0.8)
    first, second = (run(model, step_cache=options, seed=7) for _ in range(2))
    pattern = first.report["step_cache"]["pattern"]
    assert "S" in pattern and pattern != "FF" + "FSSSS" * 3 + "F", "the indicator, not only the mask, decided"
    assert first.report["step_cache"] == second.report["step_cache"] and torch.equal(first.latents, second.latents)


@pytest.fixture(scope="module")
def controlled_model(model, tmp_path_factory):
    import controlnet_fixtures as cf
    from qi21.demo import tiny_checkpoints as tiny
    from qi21.model.encoders.control import control_latents
    from qi21.model.features.control import apply_controlnet
    from qi21.model.loaders.controlnet import load_controlnet
    from qi21.model.vae.autoencoder import QwenImage21VAE

    net = load_controlnet(cf.write(tmp_path_factory.mktemp("patches") / "fun.safetensors", cf.alibaba_state()))
    torch.manual_seed(11)
    vae = QwenImage21VAE(tiny.TINY_VAE).eval()
    image = torch.rand(1, GRID[0] * 16, GRID[1] * 16, 3, generator=torch.Generator().manual_seed(5))
    return apply_controlnet(model, net, lambda grid: control_latents(vae, grid, control_image=image), 1.0, 0.0, 1.0)


def test_a_controlled_run_replays_every_later_block_instead_of_running_back_blocks(controlled_model):
    report = run(controlled_model, step_cache=StepCacheOptions(back_blocks=1, **MASK)).report["step_cache"]
    assert report["pattern"] == MASK_PATTERN_20 and report["back_blocks_ran"] == 0 and report["control"] == "reuse"


# -- the options and the presets ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, field", [
    (dict(decide="sometimes"), "decide"), (dict(order=3), "order"), (dict(back_blocks=-1), "back_blocks"),
    (dict(probe_blocks=0), "probe_blocks 0"), (dict(decide="schedule"), "schedule"), (dict(decide="mask"), "mask"),
    (dict(decide="schedule", schedule=(0.0, 1.5)), "schedule"), (dict(full_every=1.5), "full_every")])
def test_bad_options_are_refused_by_name(bad, field):
    with pytest.raises(ValueError, match=field):
        StepCacheOptions(**bad)


def test_probe_and_back_blocks_must_leave_a_block_to_skip():
    options = StepCacheOptions(probe_blocks=2, back_blocks=2)
    assert StepCache.for_run(options, [1.0, 0.0], edit=False, num_layers=4) is None


def test_the_shipped_presets_are_complete_options():
    presets = load_presets()
    assert set(presets) >= {"near-exact", "balanced", "fast"}
    for name, options in presets.items():
        assert isinstance(options, StepCacheOptions) and options.mode != "off", name


@pytest.mark.parametrize("text, problem", [
    ('{"presets": {"x": {"mode": "taylor", "speed": 3}}}', "speed"),
    ('{"presets": {"x": {"mode": "taylor", "order": 5}}}', "order"),
    ('{"presets": []}', "presets"),
    ('{"presets": {"x": {"decide": "schedule", "schedule": [0, 0.5, 2]}}}', "schedule"),
    ("not json", "JSON")])
def test_a_bad_preset_file_is_refused_naming_the_preset_and_field(tmp_path, text, problem):
    path = tmp_path / "presets.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=problem):
        load_presets(path)


def test_the_preset_file_is_valid_json_with_descriptions():
    data = json.loads(PRESETS_FILE.read_text())
    assert all(isinstance(entry.get("description"), str) for entry in data["presets"].values())


# -- ranks of a split model --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", [dict(mode="taylor", order=1),
                                    dict(probe_blocks=0, back_blocks=1, decide="mask", full_first=2, full_every=3)],
                         ids=["indicator taylor1", "mask P0B1"])
def test_a_split_models_ranks_decide_as_one_process(models_root, method):
    """A cpu,cpu Ulysses model (the tiny set's 2 blocks): the indicator reduced over the ranks, or the mask alone,
    gives one process's pattern; the back block's all-to-alls are reached by both ranks; the latents are one
    process's."""
    import graph_fixtures as gf
    from qi21.model.options import with_options
    from qi21.model.parallel import pool as pools
    from qi21.nodes.loaders import QI21ModelLoader
    from qi21.nodes.samplers import QI21Sampler

    options = StepCacheOptions(threshold=0.9, edit_threshold=0.9, start_percent=0.0, end_percent=1.0, **method)
    positive = gf.synthetic_conditioning(text_runs=[9], seed=4)

    def sample(model):
        out = QI21Sampler.execute(with_options(model, step_cache=options), positive, 5, 10, 1.0, 64, 96, 1)
        return out[0]["samples"], out.ui["qi21_report"][0]["step_cache"]

    try:
        whole = QI21ModelLoader.execute(gf.SINGLE["model"], "default")[0]
        split = QI21ModelLoader.execute(gf.SINGLE["model"], "default", devices="cpu,cpu", parallel="ulysses")[0]
        expected, single = sample(whole)
        got, report = sample(split)
    finally:
        pools.close_pools()
    assert "S" in single["pattern"] and report["pattern"] == single["pattern"]
    assert report["back_blocks_ran"] == single["back_blocks_ran"] == (single["skipped"] if "back_blocks" in method
                                                                      else 0)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_the_nodes_preset_replaces_its_widgets_and_custom_keeps_saved_workflows(model):
    from qi21.model.options import options_of
    from qi21.model.sampling.step_presets import shipped_presets
    from qi21.nodes.step_cache import QI21StepCache

    saved = QI21StepCache.execute(model, "t8", 0.08, 0.03, 0.1, 0.85, 2, "reuse")[0]  # a workflow from before
    assert options_of(saved).step_cache == StepCacheOptions()
    for name, options in shipped_presets().items():
        assert options_of(QI21StepCache.execute(model, "off", preset=name)[0]).step_cache == options
    assert "preset" in QI21StepCache.validate_inputs(preset="fastest")
    inputs = [spec.id for spec in QI21StepCache.define_schema().inputs]
    assert inputs[7:9] == ["control", "preset"], "appended: saved workflows keep their widgets' order"


def test_every_step_method_is_reachable_from_the_nodes_inputs(model):
    from qi21.model.options import options_of
    from qi21.nodes.step_cache import NODE_MODES, QI21StepCache

    assert "taylor" in NODE_MODES
    widgets = ("t8", 0.08, 0.03, 0.1, 0.85, 2, "reuse", "custom")

    def options(*args, **kwargs):
        return options_of(QI21StepCache.execute(model, *args, **kwargs)[0]).step_cache

    assert options(*widgets) == StepCacheOptions()  # the new inputs' defaults are T8's rule
    assert options("taylor", 0.3, 0.3, 0.1, 0.85, 3, order=1, back_blocks=1) == StepCacheOptions(
        "taylor", 0.3, 0.3, 0.1, 0.85, 3, order=1, back_blocks=1)
    assert options("taylor", 1.0, 1.0, 0.1, 0.85, 2, order=1, probe_blocks=0, full_first=3, full_every=6,
                   full_last=1) == StepCacheOptions("taylor", 1.0, 1.0, 0.1, 0.85, 2, order=1, probe_blocks=0,
                                                    decide="mask", full_first=3, full_every=6, full_last=1)
    assert options("taylor", 1.0, 1.0, 0.1, 0.85, 2, order=1, probe_blocks=0, schedule="0, 0.075; 0.5") == \
        StepCacheOptions("taylor", 1.0, 1.0, 0.1, 0.85, 2, order=1, probe_blocks=0, decide="schedule",
                         schedule=(0.0, 0.075, 0.5))
    assert "not a number" in QI21StepCache.validate_inputs(schedule="0, half")
    assert "[0, 1)" in QI21StepCache.validate_inputs(schedule="0, 1.5")
    with pytest.raises(ValueError, match="two ways"):
        QI21StepCache.execute(model, "taylor", 1.0, 1.0, 0.1, 0.85, 2, probe_blocks=0, full_first=2, schedule="0.5")
    with pytest.raises(ValueError, match="probe_blocks 0"):  # no probe needs a mask or a schedule
        QI21StepCache.execute(model, "taylor", 0.1, 0.1, 0.1, 0.85, 2, probe_blocks=0)


def test_the_calibration_puts_a_full_step_where_the_residual_jumps(benchmark_script):
    """10 steps whose residual is 1 until step 5 and 3 from there: with 2 full steps the forecasts err least when the
    second is step 5 (any other misses the jump by 2 on a step); with 3, step 5 stays among them."""
    bench = benchmark_script("step_cache_peers")
    sigmas = [1.0 - i / 10 for i in range(11)]
    runs = [[torch.full((2, 3), 1.0 if k < 5 else 3.0) for k in range(10)]]
    chosen = bench.calibrate(runs, sigmas, budgets=(2, 3))
    assert chosen[2] == [0, 5] and chosen[3][:1] == [0] and 5 in chosen[3]
