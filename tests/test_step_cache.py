"""The step cache (model/sampling/step_cache.py, the Step Cache node): off is exact, a skipped call is what the rule
says it is, and the rule (window, skip cap, never the first call) holds on every path the prefix cache goes: t2i,
edits, CFG, batches, a kept cache, img2img, the Fun ControlNet, a ComfyUI-style sampler with two calls a step, weight
streaming, interrupts.

A random model has no denoising dynamics, so the indicator says nothing about quality here; the rule's structure is
tested with a threshold so large that every call the rule allows is skipped (`ALWAYS`), and the decisions of a
realistic threshold only for determinism. Quality is benchmarks/quality.py step-cache's job, on a trained model.
"""


import dataclasses

import pytest
import torch

from dit_fixtures import unit_scale_dit
from qi21.model.encoders.conditioning import Conditioning
from qi21.model.options import options_of, with_options
from qi21.model.prefix_cache.kept_entries import PrefixCacheStore
from qi21.model.sampling.loop import sample
from qi21.model.sampling.step_cache import StepCache, StepCacheOptions
from qi21.model.transformer.dit import DiTConfig, PrefixInputs
from qi21.model.transformer.hooks import Finish
from tolerances import same

GRID = (6, 8)
WIDTH, HEIGHT = GRID[1] * 16, GRID[0] * 16
CONFIG = DiTConfig(num_layers=4, num_heads=2, head_dim=32, context_in_dim=48, mlp_ratio=3, axes_dims_rope=(4, 14, 14))
ALWAYS = StepCacheOptions(threshold=1e9, edit_threshold=1e9)  # every call the rule allows is skipped
#: 20 Euler steps, window 10-85 % (steps 2..16), at most 2 skips in a row, step 0 (the prefill) never
PATTERN_20 = "FF" + "SSF" * 5 + "FFF"


@pytest.fixture(scope="module")
def model():
    return unit_scale_dit(CONFIG, seed=5)


def conditioning(references: bool = False, seed: int = 3) -> Conditioning:
    g = torch.Generator().manual_seed(seed)
    if not references:
        return Conditioning(torch.randn(7, 48, generator=g), torch.zeros(7, dtype=torch.bool))
    slots = torch.tensor([False] * 5 + [True] * 4 + [False] * 3)  # one 4x4 reference (4 slots of 2x2 cells)
    return Conditioning(torch.randn(12, 48, generator=g), slots, torch.randn(16, 64, generator=g), ((4, 4),))


def run(model, steps=20, **kwargs):
    with torch.no_grad():
        return sample(model, kwargs.pop("positive", None) or conditioning(), sigmas=torch.linspace(1.0, 0.0, steps + 1),
                      width=WIDTH, height=HEIGHT, seed=kwargs.pop("seed", 1), **kwargs)


def count_calls(module) -> list:
    calls = []
    module.register_forward_hook(lambda *args: calls.append(1))
    return calls


# -- off is exact ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [StepCacheOptions(threshold=0.0, edit_threshold=0.0), StepCacheOptions(mode="off"),
                                     StepCacheOptions(threshold=1e9, edit_threshold=1e9, max_skips=0)],
                         ids=["threshold 0", "mode off", "max_skips 0"])
@pytest.mark.parametrize("path", ["t2i", "edit, cfg, batch 2", "cache off"])
def test_off_is_bit_identical_to_no_step_cache(model, options, path):
    kwargs = {"t2i": {}, "edit, cfg, batch 2": dict(positive=conditioning(True), negative=conditioning(True, seed=4),
                                                     cfg=3.0, batch_size=2),
              "cache off": dict(prefix_cache=False)}[path]
    exact = run(model, steps=8, **kwargs)
    got = run(model, steps=8, step_cache=options, **kwargs)
    assert torch.equal(got.latents, exact.latents)
    assert "step_cache" not in exact.report
    if options.max_skips == 0:  # measured, never skipped
        assert got.report["step_cache"]["pattern"] == "F" * 8
    else:
        assert "step_cache" not in got.report  # no step cache at all: the DiT never sees one


def test_the_node_off_and_at_zero_returns_an_exact_model(model):
    from qi21.nodes.step_cache import QI21StepCache

    assert QI21StepCache.execute(model, "off")[0] is model
    zero = QI21StepCache.execute(model, "t8", 0.0, 0.0)[0]
    assert zero is not model and options_of(zero).step_cache.threshold == 0.0
    assert torch.equal(run(zero, steps=6, step_cache=options_of(zero).step_cache).latents, run(model, steps=6).latents)


# -- what a skipped call computes --------------------------------------------------------------------------------------
def test_a_skipped_call_is_block_0_plus_the_last_full_residual(model):
    cond = conditioning()
    prefixes = [PrefixInputs(layout=cond.layout(GRID), text=cond.text)]
    x_a, x_b = torch.randn(2, 1, GRID[0] * GRID[1], 64).unbind(0)
    outputs = {}  # what blocks 0 and 3 returned, target rows
    hooks = [model.blocks[i].register_forward_hook(
        lambda module, args, out, i=i: outputs.__setitem__(i, out[-x_a.shape[1]:].clone())) for i in (0, 3)]
    stepper = StepCache(ALWAYS, [1.0, 0.5, 0.0], edit=False, num_layers=4)
    try:
        with torch.no_grad():
            model(x_a, 1.0, prefixes, hooks=[stepper.call(1.0)])
            residual = outputs[3] - outputs[0]
            outputs.clear()
            skipped = model(x_b, 0.5, prefixes, hooks=[stepper.call(0.5)])
            assert list(outputs) == [0], "blocks 1..3 must not run on a skipped call"
            _, _, final_scale, rows = model.prepare(x_b, 0.5, prefixes)
            expected = model.final_layer(outputs[0] + residual, final_scale, rows)
    finally:
        for hook in hooks:
            hook.remove()
    assert stepper.records[1][2] and stepper.records[0][1] is None  # the first call had nothing to compare with
    same(skipped, expected)  # the same sums: block 0, the kept residual, the final layer


def test_a_probe_of_two_blocks_decides_after_block_1_and_replays_blocks_2_on(model):
    """The probe is "the first n blocks": with n = 2 a skipped call is block 1's output + the last full pass's residual
    of blocks 2..3, and the report counts the blocks after the probe as skipped."""
    cond = conditioning()
    prefixes = [PrefixInputs(layout=cond.layout(GRID), text=cond.text)]
    x_a, x_b = torch.randn(2, 1, GRID[0] * GRID[1], 64).unbind(0)
    outputs = {}
    hooks = [model.blocks[i].register_forward_hook(
        lambda module, args, out, i=i: outputs.__setitem__(i, out[-x_a.shape[1]:].clone())) for i in (1, 3)]
    stepper = StepCache(ALWAYS, [1.0, 0.5, 0.0], edit=False, num_layers=4, probe_blocks=2)
    try:
        with torch.no_grad():
            model(x_a, 1.0, prefixes, hooks=[stepper.call(1.0)])
            residual = outputs[3] - outputs[1]
            outputs.clear()
            skipped = model(x_b, 0.5, prefixes, hooks=[stepper.call(0.5)])
            assert list(outputs) == [1], "blocks 2..3 must not run on a skipped call"
            _, _, final_scale, rows = model.prepare(x_b, 0.5, prefixes)
            expected = model.final_layer(outputs[1] + residual, final_scale, rows)
    finally:
        for hook in hooks:
            hook.remove()
    torch.testing.assert_close(skipped, expected, rtol=0, atol=1e-6)
    assert stepper.report()["blocks_skipped_share"] == round(2 / 8, 4)  # 1 of 2 calls skipped 2 of 4 blocks
    assert StepCache.for_run(ALWAYS, [1.0, 0.0], edit=False, num_layers=2, probe_blocks=2) is None  # nothing after it
    with pytest.raises(ValueError, match="probe_blocks"):
        StepCache(ALWAYS, [1.0, 0.0], edit=False, num_layers=4, probe_blocks=0)


def test_extrapolate_follows_the_line_through_the_last_two_residuals():
    stepper = StepCache(StepCacheOptions(mode="extrapolate", threshold=1e9), [1.0, 0.0], edit=False, num_layers=2)
    stepper._previous, stepper._residual = (0.8, torch.zeros(3)), (0.6, torch.ones(3))
    stepper._sigma = 0.5
    torch.testing.assert_close(stepper._replayed(), torch.full((3,), 1.5))


# -- the rule on every path --------------------------------------------------------------------------------------------
def test_window_and_skip_cap_on_a_t2i_run_and_blocks_are_not_run(model):
    later = count_calls(model.blocks[2])
    result = run(model, step_cache=ALWAYS)
    report = result.report["step_cache"]
    assert report["pattern"] == PATTERN_20 and (report["run"], report["skipped"]) == (10, 10)
    assert len(later) == 10 and report["blocks_skipped_share"] == pytest.approx(10 * 3 / 80)
    assert report["indicator"][0] is None and all(v is not None for v in report["indicator"][1:])
    assert torch.isfinite(result.latents).all()


def test_edits_use_the_edit_threshold_and_cfg_and_batch_decide_together(model):
    options = StepCacheOptions(threshold=0.0, edit_threshold=1e9)  # t2i would never skip; an edit always may
    result = run(model, positive=conditioning(True), negative=conditioning(True, seed=4), cfg=3.0, batch_size=2,
                 step_cache=options)
    report = result.report["step_cache"]
    assert report["threshold"] == 1e9 and report["pattern"] == PATTERN_20  # one decision per batched call
    assert "step_cache" not in run(model, step_cache=options).report  # t2i at threshold 0: exact, no step cache


def test_a_kept_cache_hit_never_skips_its_first_step(model):
    store = PrefixCacheStore(budget_bytes=None)
    first = run(model, keep_cache=True, store=store, step_cache=ALWAYS)
    second = run(model, keep_cache=True, store=store, step_cache=ALWAYS, seed=2)
    assert first.report["cache"] == "miss" and second.report["cache"] == "hit"
    assert second.report["step_cache"]["pattern"] == PATTERN_20


def test_img2img_counts_the_window_in_the_steps_it_runs(model):
    start = torch.randn(1, 64, *GRID)
    with torch.no_grad():
        result = sample(model, conditioning(), sigmas=torch.linspace(0.6, 0.0, 11), width=WIDTH, height=HEIGHT,
                        seed=1, latent_image=start, noise_mask=torch.ones(1, 1, *GRID), step_cache=ALWAYS)
    assert result.report["step_cache"]["pattern"] == "FSSFSSFSSF"  # steps 1..8 of 10 in the window


def heun(denoiser, sigmas, noise, latent, mask):
    """ComfyUI's KSAMPLER signature, two model calls a step (the second at the next sigma), as k-diffusion's Heun."""
    x = sigmas[0] * noise + (1.0 - sigmas[0]) * latent
    for i in range(sigmas.numel() - 1):
        sigma, following = sigmas[i], sigmas[i + 1]
        slope = (x - denoiser(x, sigma)) / sigma
        guess = x + (following - sigma) * slope
        x = x + (following - sigma) * (slope + (guess - denoiser(guess, following)) / following) / 2 \
            if following > 0 else guess
    return x


def test_a_sampler_with_two_calls_a_step_decides_per_call_by_sigma(model):
    result = run(model, steps=8, sampler=heun, step_cache=ALWAYS)
    report = result.report["step_cache"]
    # calls at s0, s1, s1, s2, s2, ..., s7, s7: the window by each call's sigma (s1 = 12.5 % ... s6 = 75 %)
    assert result.report["model_calls"] == 15 and report["per"] == "model call"
    assert report["pattern"] == "FSSFSSFSSFSSFFF"


def test_a_rising_sigma_starts_over():
    stepper = StepCache(ALWAYS, [1.0, 0.5, 0.0], edit=False, num_layers=2)
    stepper._residual = (0.5, torch.zeros(1))
    assert stepper.call(0.5)._may_skip
    stepper._residual = (0.5, torch.zeros(1))
    assert not stepper.call(0.9)._may_skip and stepper._residual is None


@pytest.fixture(scope="module")
def controlled(model, tmp_path_factory):
    import controlnet_fixtures as cf
    from qi21.demo import tiny_checkpoints as tiny
    from qi21.model.encoders.control import control_latents
    from qi21.model.features.control import apply_controlnet
    from qi21.model.loaders.controlnet import load_controlnet
    from qi21.model.vae.autoencoder import QwenImage21VAE

    net = load_controlnet(cf.write(tmp_path_factory.mktemp("patches") / "fun.safetensors", cf.alibaba_state()))
    torch.manual_seed(11)
    vae = QwenImage21VAE(tiny.TINY_VAE).eval()
    image = torch.rand(1, HEIGHT, WIDTH, 3, generator=torch.Generator().manual_seed(5))
    return lambda window, base=model: apply_controlnet(
        base, net, lambda grid: control_latents(vae, grid, control_image=image), 1.0, *window)


def test_the_fun_controlnet_reuses_its_skips_and_restarts_where_its_window_changes(model, controlled):
    whole = controlled((0.0, 1.0), with_options(model, step_cache=ALWAYS))  # the option rides on the controlled copy
    assert options_of(whole).step_cache == ALWAYS
    second_control_block = count_calls(whole.control_net.blocks[1])  # runs after base block 2
    result = run(whole, step_cache=options_of(whole).step_cache)
    assert result.report["step_cache"]["pattern"] == PATTERN_20 and len(second_control_block) == 10
    # a window 0.2-0.8 (ComfyUI's shifted percents): a call whose control differs from the last full pass's is full
    windowed = run(controlled((0.2, 0.8)), step_cache=ALWAYS).report
    phases = [windowed["control"]["window"], windowed["step_cache"]["pattern"]]
    assert windowed["step_cache"]["pattern"] != PATTERN_20 and windowed["step_cache"]["skipped"] > 0, phases
    assert torch.isfinite(result.latents).all()


def test_a_skipped_controlled_call_replays_the_later_control_skips_inside_the_residual(model, controlled):
    whole = controlled((0.0, 1.0))
    net, cond = whole.control_net, conditioning()
    prefixes = [PrefixInputs(layout=cond.layout(GRID), text=cond.text)]
    x_a, x_b = torch.randn(2, 1, GRID[0] * GRID[1], 64, generator=torch.Generator().manual_seed(2)).unbind(0)
    rows = x_a.shape[1]
    out = {}  # target rows each block returned (base block 0 before control block 0's skip is added in place)
    hooks = [whole.blocks[i].register_forward_hook(
        lambda module, args, o, i=i: out.__setitem__(("base", i), o[-rows:].clone())) for i in range(4)]
    hooks += [net.blocks[k].register_forward_hook(  # control block k's skip, after_proj(c_{k+1}), strength 1
        lambda module, args, o, k=k: out.__setitem__(("skip", k), (module.after_proj(o) + module.after_proj_bias)[
            -rows:].clone())) for k in range(2)]

    def forward(stepper, x, sigma):
        stream = whole.options.control.stream(GRID, 4, "cpu", torch.float32, net=net)
        # listed step cache first: the forward runs the hooks in their stated order (control, then step cache)
        return whole(x, sigma, prefixes, hooks=[stepper.call(sigma, key=True), stream])

    try:
        with torch.no_grad():
            stepper = StepCache(ALWAYS, [1.0, 0.5, 0.0], edit=False, num_layers=4)
            forward(stepper, x_a, 1.0)
            full = dict(out)
            out.clear()
            skipped = forward(stepper, x_b, 0.5)
            assert stepper.records[1][2] and stepper.report()["control"] == "reuse"
            assert sorted(out) == [("base", 0), ("skip", 0)], "base blocks 1..3 and control block 1 never run"
            _, _, final_scale, rows_b = whole.prepare(x_b, 0.5, prefixes)
    finally:
        for hook in hooks:
            hook.remove()
    block_0 = out[("base", 0)] + out[("skip", 0)]  # what the step cache sees after block 0
    residual = full[("base", 3)] - full[("base", 0)] - full[("skip", 0)]  # blocks 1..3, control block 1's skip in it
    torch.testing.assert_close(skipped, whole.final_layer(block_0 + residual, final_scale, rows_b), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_quantized_prefix_cache_skips_alike(model, dtype):
    store = PrefixCacheStore(budget_bytes=None)
    first = run(model, cache_dtype=dtype, keep_cache=True, store=store, step_cache=ALWAYS)
    kept = run(model, cache_dtype=dtype, keep_cache=True, store=store, step_cache=ALWAYS, seed=2)
    assert (first.report["cache_dtype"], kept.report["cache"]) == (dtype, "hit")
    assert first.report["step_cache"]["pattern"] == kept.report["step_cache"]["pattern"] == PATTERN_20
    assert torch.isfinite(kept.latents).all()


def test_streamed_blocks_are_not_brought_in_on_skipped_steps(model):
    from qi21.model.memory.streaming import StreamedRun

    copies = {}
    for name, options in (("exact", None), ("skipping", ALWAYS)):
        with StreamedRun(model, (1, 2, 3), "device") as streamed:
            result = run(model, new_cache=streamed.new_cache, step_cache=options)
        copies[name] = streamed.streamer.copies
    assert result.report["step_cache"]["skipped"] == 10
    assert copies["exact"] - copies["skipping"] >= 10 * 2, copies  # each skipped step brings none of its 3 blocks


def test_decisions_are_deterministic_for_a_seed(model):
    options = StepCacheOptions(threshold=0.8)  # random weights change block 0 by ~0.5-1.5 a step: some skips
    first, second = (run(model, step_cache=options, seed=7) for _ in range(2))
    pattern = first.report["step_cache"]["pattern"]
    assert "S" in pattern and pattern != PATTERN_20, "the indicator, not only the rule, decided"
    assert first.report["step_cache"] == second.report["step_cache"]
    assert torch.equal(first.latents, second.latents)


class Stop(Exception):
    pass


def test_an_interrupt_frees_the_step_cache(model, monkeypatch):
    freed = []
    original = StepCache.free
    monkeypatch.setattr(StepCache, "free", lambda self: (freed.append(1), original(self)))

    def interrupt(info):
        if info.step == 4:
            raise Stop

    with pytest.raises(Stop):
        run(model, step_cache=ALWAYS, callback=interrupt)
    assert freed == [1]


# -- the node and the model copy ---------------------------------------------------------------------------------------
def test_the_node_checks_its_window_and_the_copy_keeps_the_models_prefix(model):
    from qi21.nodes.step_cache import QI21StepCache

    assert "start_percent" in QI21StepCache.validate_inputs(start_percent=0.9, end_percent=0.2)
    with pytest.raises(ValueError, match="start_percent"):
        QI21StepCache.execute(model, "t8", 0.08, 0.03, 0.5, 0.5, 2)
    copy = QI21StepCache.execute(model, "extrapolate", 0.1, 0.02, 0.2, 0.9, 3)[0]
    assert options_of(copy).step_cache == StepCacheOptions("extrapolate", 0.1, 0.02, 0.2, 0.9, 3)
    with pytest.raises(ValueError, match="control"):
        QI21StepCache.execute(model, "t8", 0.08, 0.03, 0.1, 0.85, 2, "again")
    assert options_of(model).step_cache is None and copy.blocks[0].qkv.weight is model.blocks[0].qkv.weight
    assert PrefixCacheStore.key(copy, dtype=torch.float32) == PrefixCacheStore.key(model, dtype=torch.float32)
    cleared = with_options(copy, step_cache=None)
    assert cleared is not copy and options_of(cleared).step_cache is None


def test_the_benchmark_measures_exact_as_exact_through_the_nodes(benchmark_script, tiny_models):
    bench = benchmark_script("quality")
    try:
        summary = bench.main(["step-cache", "--models", str(tiny_models["root"]), "--prompts", "1", "--edits", "1",
                              "--steps", "10", "--size", "128", "--settings", "t8:0", "t8:1", "fast",
                              "taylor:1:order=1:probe_blocks=0:full_first=2:full_every=3"])
    finally:
        from qi21.nodes import bridge

        bridge.set_models_root(None)
    for task in ("t2i", "edit"):  # threshold 0 through the nodes and the VAE: the same pixels
        exact = summary[("t8:0", task)]
        assert exact["psnr_min"] == float("inf") and exact["ssim_min"] == 1.0 and exact["skipped"] == 0
    skipping = summary[("t8:1", "t2i")]
    assert skipping["skipped"] > 0 and skipping["psnr_mean"] < float("inf") and skipping["patterns"][0][:2] == "FF"
    masked = summary[("taylor:1:order=1:probe_blocks=0:full_first=2:full_every=3", "t2i")]
    assert masked["patterns"][0] == "FFFSSFSSFS"  # steps 0, 1, then 2, 5, 8 (every 3rd); no probe: the rest skip
    assert masked["blocks_skipped"] == pytest.approx(0.5)  # 5 of 10 steps ran no block of the tiny DiT's 2
    assert summary[("fast", "edit")]["skipped"] > 0  # a preset by name


def test_the_benchmark_runs_with_the_fun_controlnet(benchmark_script, tiny_models):
    bench = benchmark_script("quality")
    try:  # 2 control blocks for the tiny DiT's 2: one after the last block
        summary = bench.main(["step-cache", "--models", str(tiny_models["root"]), "--prompts", "1", "--edits", "0",
                              "--steps", "8", "--size", "128", "--control", "--control-blocks", "2",
                              "--settings", "t8:0", "t8:1"])
    finally:
        from qi21.nodes import bridge

        bridge.set_models_root(None)
    exact, reuse = (summary[(name, "t2i")] for name in ("t8:0", "t8:1"))
    assert exact["psnr_min"] == float("inf") and exact["control"] is None  # threshold 0: no step cache at all
    assert reuse["control"] == "reuse" and reuse["skipped"] > 0
    # a skipped step runs base block 0 and control block 0 of 2 + 2: half the block work of each skipped step saved
    assert reuse["blocks_skipped"] == pytest.approx(reuse["skipped"] * 2 / 4)


def test_a_workflow_saved_with_the_retired_recompute_runs_as_reuse_and_says_so_once(model, caplog):
    from qi21.nodes import step_cache as node

    node._told.clear()
    with caplog.at_level("WARNING", logger="qi21"):
        recompute = node.QI21StepCache.execute(model, "t8", 0.08, 0.03, 0.1, 0.85, 2, "recompute")[0]
        again = node.QI21StepCache.execute(model, "t8", 0.08, 0.03, 0.1, 0.85, 2, "recompute")[0]
    reuse = node.QI21StepCache.execute(model, "t8", 0.08, 0.03, 0.1, 0.85, 2, "reuse")[0]
    assert options_of(recompute).step_cache == options_of(again).step_cache == options_of(reuse).step_cache
    assert node.QI21StepCache.validate_inputs(control="recompute") is True  # ComfyUI accepts the saved value
    told = [r.getMessage() for r in caplog.records if "recompute" in r.getMessage()]
    assert len(told) == 1 and "runs as reuse" in told[0] and "docs/step-cache.md" in told[0]


# -- the indicator, by hand ----------------------------------------------------------------------------------------
def test_the_indicator_is_the_largest_mean_relative_change_of_block_0s_sampled_residual():
    """Two samples of 9 target rows x 9 channels after 3 prefix rows: the indicator reads rows and channels 0 and 8
    (stride 8) of block 0's residual. Every other entry is noise of another scale on each call, so reading one more
    entry would change the value. By hand, with `then` the first call's sampled residual and `now` the second's:
      sample 0: then [[1, -1], [2, 0]], now [[1.5, -1], [2, 0.5]]: mean |now - then| 0.25 / mean |then| 1 = 0.25
      sample 1: then [[2, 2], [2, 2]],  now [[4, 2], [2, 0]]:     mean |now - then| 1 / mean |then| 2 = 0.5
    and the largest over the samples is 0.5."""
    rows = dataclasses.make_dataclass("Rows", ["samples", "target_len"])(2, 9)
    generator = torch.Generator().manual_seed(0)

    def buffer(sampled, noise_scale):  # (3 prefix + 2 x 9 target rows, 9 channels), `sampled` at [s, 0/8, 0/8]
        x = torch.randn(3 + 18, 9, generator=generator) * noise_scale
        for s, grid in enumerate(sampled):
            for i, r in enumerate((0, 8)):
                for j, c in enumerate((0, 8)):
                    x[3 + 9 * s + r, c] = grid[i][j]
        return x

    zero = [[[0, 0], [0, 0]]] * 2
    stepper = StepCache(ALWAYS, [1.0, 0.5, 0.0], edit=False, num_layers=4)
    stepper.call(1.0).start(buffer(zero, 0), None, rows, None)
    assert not isinstance(stepper.after_block(0, buffer([[[1, -1], [2, 0]], [[2, 2], [2, 2]]], 10.0)), Finish)
    stepper.end(buffer(zero, 3.0))
    stepper.call(0.5).start(buffer(zero, 0), None, rows, None)
    stepper.after_block(0, buffer([[[1.5, -1], [2, 0.5]], [[4, 2], [2, 0]]], 100.0))
    assert stepper.report()["indicator"] == [None, 0.5]
    assert stepper.records[1][1] == 0.5
