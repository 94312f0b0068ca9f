"""The memory planner (model/memory/) and its use by the nodes (nodes/placement.py): predictions per phase, the
plan chosen for a budget, refusals before any weight moves, and simulated budgets driving real (tiny) runs on the
CPU: streamed blocks, a host-side cache, a tiled or one-pass decode."""

from dataclasses import replace

import pytest
import torch

import graph_fixtures as gf
from qi21.model.memory.estimate import GIB, VAEShape, decode_transient, estimate_run, synthetic_encoder_weights
from qi21.model.memory.planner import (
    CPU_STEP_FACTOR,
    DEVICE_OVERHEAD,
    Budget,
    PlanError,
    RunShape,
    least_memory,
    plan_decode,
    plan_layers,
    plan_run,
    sampling_phases,
    spread,
    step_cache_bytes,
)
from qi21.model.memory.weights import dit_weights, synthetic_dit_weights
from qi21.model.options import options_of
from qi21.model.transformer.dit import DiTConfig
from qi21.nodes import bridge, placement
from qi21.nodes.decode import QI21VAEDecode
from qi21.nodes.loaders import QI21ModelLoader
from qi21.nodes.placement import KEPT_CACHES
from qi21.nodes.samplers import QI21TurboSampler

FULL = DiTConfig()
BF16 = synthetic_dit_weights(FULL, "bf16")
INT8 = synthetic_dit_weights(FULL, "int8")


# -- sizes -----------------------------------------------------------------------------------------------------------
def test_weight_bytes_of_the_released_formats():
    block_linear = 4096 * 12288 + 4096 * 4096 + 4096 * 24576 + 12288 * 4096
    assert BF16.layers[0] == 2 * block_linear + 2 * 2 * 128  # + the two q/k norm scales
    assert abs(BF16.total / 1e9 - 14.23) < 0.01  # the 13.3 GiB the loader tooltip calls 14.2 GB
    # int8: one byte per linear weight plus one fp32 scale per output row: half of bf16 for the linear weights
    assert INT8.layers[0] == block_linear + 4 * (12288 + 4096 + 24576 + 4096) + 2 * 2 * 128
    assert INT8.other == BF16.other
    assert abs(synthetic_encoder_weights().total / 1e9 - 16.3) < 0.05  # Qwen3-VL 8B in bf16


def test_real_models_count_their_stored_bytes(models_root):
    fp32 = gf.load("model")["model"]
    fp8 = QI21ModelLoader.execute(gf.SINGLE["model"], "fp8_e4m3fn")[0]
    w32, w8 = dit_weights(fp32), dit_weights(fp8)
    params = sum(p.numel() * p.element_size() for p in fp32.parameters())
    assert w32.other + sum(b for b in w32.layers) >= params  # slots are the bytes, each tensor 512-aligned
    assert w32.other == params - sum(p.numel() * 4 for b in fp32.blocks for p in b.parameters())
    assert w32.label == "fp32" and w8.label == "fp8"
    linear = sum(p.numel() for n, p in fp8.blocks[0].named_parameters() if p.ndim == 2)
    assert w8.layers[0] < w32.layers[0] - 2 * linear  # fp8 stores the block linears in 1 byte (vs 4)


# -- phases and plans ------------------------------------------------------------------------------------------------
def test_the_prefill_prediction_builds_on_the_run_estimate():
    run = RunShape.released(1024, references=1)
    est = estimate_run(FULL, list(run.prefix_tokens), run.target_tokens, 1, False, 2)
    phases = sampling_phases(BF16, FULL, run, 2)
    concat = 2 * (run.prefix_tokens[0] + run.target_tokens) * FULL.width * 2
    assert phases["prefill"] == BF16.total + est.total + concat + DEVICE_OVERHEAD
    unified = sampling_phases(BF16, FULL, run, 2, unified=True)
    # on a CPU: the old estimate plus the weights, its forward's transient as measured there (CPU_STEP_FACTOR)
    assert unified["prefill"] == BF16.total + est.total + (CPU_STEP_FACTOR - 1) * est.step


@pytest.mark.parametrize("card, refs, weights, cache", [
    (80, 3, "resident", "device"), (48, 3, "resident", "device"), (24, 1, "resident", "device"),
    (16, 0, "resident", "device"), (16, 1, "resident", "host"), (12, 0, "streamed", "device"),
    (8, 3, "streamed", "host"),
])
def test_the_fastest_plan_that_fits(card, refs, weights, cache):
    plan = plan_run(BF16, FULL, RunShape.released(1024, refs), Budget.gpu(card * GIB), 2)
    assert (plan.weights, plan.cache, plan.decode) == (weights, cache, "one-pass")
    assert plan.sampling_peak <= Budget.gpu(card * GIB).device
    if weights == "streamed":  # as many blocks as fit: one more would not
        more = spread(len(plan.streamed) - 1, 32)
        assert max(sampling_phases(BF16, FULL, RunShape.released(1024, refs), 2, more, cache).values()) > \
            Budget.gpu(card * GIB).device


def test_int8_weights_need_fewer_streamed_blocks():
    run = RunShape.released(1024, references=1)
    bf16 = plan_run(BF16, FULL, run, Budget.gpu(12 * GIB), 2)
    int8 = plan_run(INT8, FULL, run, Budget.gpu(12 * GIB), 2)
    assert int8.resident_blocks == 32 or int8.resident_blocks > bf16.resident_blocks


def test_streamed_blocks_are_spread_and_the_host_holds_them():
    plan = plan_run(BF16, FULL, RunShape.released(1024), Budget.gpu(8 * GIB), 2)
    gaps = {b - a for a, b in zip(plan.streamed, plan.streamed[1:])}
    assert max(gaps) - min(gaps) <= 1  # evenly between the resident ones
    assert plan.host_bytes == BF16.streamed_bytes(plan.streamed)
    assert plan.copied_per_step == BF16.streamed_bytes(plan.streamed)
    assert plan.report()["weights"] == f"streamed {plan.resident_blocks}/32"


def test_comfyui_vram_modes_and_the_loader_option():
    run = RunShape.released(1024, references=1)
    roomy = Budget.gpu(80 * GIB)
    assert plan_run(BF16, FULL, run, roomy, 2).weights_label == "resident"
    assert plan_run(BF16, FULL, run, roomy, 2, "stream").weights_label == "streamed 0/32"
    low = plan_run(BF16, FULL, run, Budget(roomy.device, roomy.host, mode="low"), 2)
    assert low.weights == "streamed" and low.resident_blocks == 29  # three streamed: the fewest that save memory
    novram = plan_run(BF16, FULL, run, Budget(roomy.device, roomy.host, mode="no"), 2)
    assert (novram.weights_label, novram.cache) == ("streamed 0/32", "host")
    with pytest.raises(PlanError, match=r"plan = resident"):
        plan_run(BF16, FULL, run, Budget.gpu(12 * GIB), 2, "resident")


def test_the_store_budget_comes_from_what_is_free():
    run = RunShape.released(1024, references=1)
    small, big = (plan_run(BF16, FULL, run, Budget.gpu(c * GIB), 2) for c in (24, 80))
    assert big.store_budget - small.store_budget == 56 * GIB
    assert small.store_budget == Budget.gpu(24 * GIB).device - small.sampling_peak


def test_a_host_cache_on_a_cpu_leaves_the_kept_store_what_is_free():
    """On unified memory (a CPU, where the host figure is None) a host cache (the Prefix Cache node's device cpu) sits
    in the same memory as the run: the kept store gets what the run leaves free, not just this run's own cache bytes
    (which evicted every other kept cache: found through /prompt in tests/test_comfyui_server.py)."""
    run = RunShape.released(1024, references=1)
    budget = Budget(64 * GIB, where="cpu", unified=True)
    host = plan_run(BF16, FULL, run, budget, 2, cache_choice="cpu")
    device = plan_run(BF16, FULL, run, budget, 2)
    assert host.cache == "host" and device.cache == "device"
    assert host.store_budget == budget.device - host.sampling_peak - host.cache_bytes
    assert host.store_budget == pytest.approx(device.store_budget, rel=0.01) and host.store_budget > 30 * GIB


# -- refusals --------------------------------------------------------------------------------------------------------
def test_a_budget_nothing_fits_names_the_least_memory_and_what_to_change():
    run = RunShape.released(2048, references=3, batch=4)
    need = least_memory(BF16, FULL, run, 2)
    with pytest.raises(PlanError) as error:
        plan_run(BF16, FULL, run, Budget.gpu(8 * GIB), 2)
    message = str(error.value)
    assert f"needs at least {need / GIB:.1f} GiB" in message
    assert "weights streamed 0/32, prefix cache in host memory" in message
    assert "Lower batch_size, width/height or the number of references, or load an int8 / GGUF file" in message
    assert "batch_size 2:" in message and "1456x1456:" in message and "2 references:" in message
    smaller = least_memory(BF16, FULL, RunShape.released(1024, references=1), 2)
    assert plan_run(BF16, FULL, RunShape.released(1024, references=1), Budget(smaller, 64 * GIB), 2).weights == \
        "streamed"  # the figure the message names is enough


def test_the_host_must_hold_what_is_streamed():
    with pytest.raises(PlanError, match=r"streaming needs .* of host memory and 4\.0 GiB is available"):
        plan_run(BF16, FULL, RunShape.released(1024), Budget.gpu(8 * GIB, host_bytes=4 * GIB), 2)


# -- decode and encode -----------------------------------------------------------------------------------------------
def test_decode_is_one_pass_when_it_fits_and_tiled_when_not():
    vae = VAEShape.released(2)
    grid = (128, 128)  # 2048 x 2048: above VAETiling.auto_above, which tiled it whatever the memory
    assert not plan_decode(vae, 1, grid, Budget.gpu(24 * GIB)).tiled
    tiled = plan_decode(vae, 1, grid, Budget.gpu(6 * GIB))
    assert tiled.tiled and tiled.peak <= Budget.gpu(6 * GIB).device
    with pytest.raises(PlanError, match="Decoding 1 image"):
        plan_decode(vae, 1, grid, Budget(GIB // 2))


def test_the_text_encoder_streams_its_layers_on_small_cards():
    te = synthetic_encoder_weights()
    assert plan_layers(te, GIB, Budget.gpu(24 * GIB)).label == "resident"
    small = plan_layers(te, GIB, Budget.gpu(8 * GIB))
    assert small.streamed and small.peak <= Budget.gpu(8 * GIB).device


# -- the nodes under simulated budgets (tiny models, CPU) ------------------------------------------------------------
@pytest.fixture(scope="module")
def models(models_root):
    return gf.load("turbo", "vae")


def _leanest_budget(model, conditioning, width, height):
    """A GPU-like budget (not unified) that only the leanest plan of a `width` x `height` run fits."""
    run = placement.run_shape(model, conditioning, None, width, height, 1, True)
    return Budget(least_memory(dit_weights(model), model.config, run, 4), 1 << 40, where="cpu (simulated GPU)")


def test_a_tight_budget_streams_and_the_latents_are_bit_identical(monkeypatch):
    from dit_fixtures import tiny_pair
    from test_streaming import conditioning

    model = tiny_pair(seed=5)[1]  # 3 blocks: streaming all of them saves one block of device memory
    expected = QI21TurboSampler.execute(model, conditioning(), 0, 128, 96, 1)
    assert expected.ui["qi21_report"][0]["plan"]["weights"] == "resident"
    monkeypatch.setattr(placement, "memory_budget",
                        lambda device, **kw: _leanest_budget(model, conditioning(), 128, 96))
    got = QI21TurboSampler.execute(model, conditioning(), 0, 128, 96, 1)
    report = got.ui["qi21_report"][0]
    assert (report["plan"]["weights"], report["plan"]["cache"], report["cache_device"]) == ("streamed 0/3", "host",
                                                                                          "cpu")
    assert torch.equal(got[0]["samples"], expected[0]["samples"])


def test_the_loader_plan_option_reaches_the_sampler(models_root):
    streamed = QI21ModelLoader.execute(gf.SINGLE["turbo"], "fp32", "auto", "stream")[0]
    assert options_of(streamed).plan == "stream"
    out = QI21TurboSampler.execute(streamed, gf.synthetic_conditioning(), 0, 64, 64, 1)
    assert out.ui["qi21_report"][0]["plan"]["weights"] == "streamed 0/2"
    resident = QI21ModelLoader.execute(gf.SINGLE["turbo"], "fp32")[0]
    again = QI21TurboSampler.execute(resident, gf.synthetic_conditioning(), 0, 64, 64, 1)
    assert again.ui["qi21_report"][0]["plan"]["weights"] == "resident"
    assert torch.equal(out[0]["samples"], again[0]["samples"])
    with pytest.raises(ValueError, match=r"plan = 'fast': expected one of auto, resident, stream"):
        QI21ModelLoader.execute(gf.SINGLE["turbo"], "fp32", "auto", "fast")


def test_a_run_nothing_fits_is_refused_before_any_weight_moves(models, monkeypatch):
    turbo = models["turbo"]

    def refuse(*args, **kwargs):
        raise AssertionError("a weight moved: the run was not refused first")

    monkeypatch.setattr(placement, "memory_budget",
                        lambda device, **kw: Budget(DEVICE_OVERHEAD, 1 << 40, where="cuda:0"))
    monkeypatch.setattr(bridge, "load_managed", refuse)
    with pytest.raises(PlanError, match=r"needs at least .* but only 0\.2 GiB is free on cuda:0\. Lower batch_size"):
        QI21TurboSampler.execute(turbo, gf.synthetic_conditioning(), 0, 64, 64, 1)


def test_the_sampler_sizes_the_kept_cache_store(models):
    with gf.default_store_budget(None):
        QI21TurboSampler.execute(models["turbo"], gf.synthetic_conditioning(), 0, 64, 64, 1, keep_cache=True)
        assert KEPT_CACHES.free_bytes is not None and KEPT_CACHES.limit_bytes == KEPT_CACHES.free_bytes
        assert len(KEPT_CACHES) == 1


def test_decode_auto_is_one_pass_when_it_fits_and_tiled_under_a_tiny_budget(models, monkeypatch):
    vae = models["vae"]
    latents = torch.randn(1, 64, 4, 160)  # 2560 px wide: three 64-cell tiles
    seen = []
    real = placement.decode_tiled
    monkeypatch.setattr(placement, "decode_tiled", lambda *a: seen.append(real(*a)) or seen[-1])

    def decoded(tiled):
        with torch.no_grad():
            return ((vae.decode(latents, tiled=tiled).float() + 1) / 2).clamp(0, 1).movedim(1, -1)[..., :3]

    rgb = QI21VAEDecode.execute(vae, {"samples": latents})[0]
    assert seen[-1][0] is False
    assert torch.equal(rgb, decoded(False))  # one pass: the reference's result exactly

    shape = VAEShape.of(vae)
    tight = shape.weight_bytes + decode_transient(shape, 1, (4, 160), True)
    assert tight < shape.weight_bytes + decode_transient(shape, 1, (4, 160), False)
    monkeypatch.setattr(placement, "memory_budget",
                        lambda device, **kw: Budget(tight, where="cpu", unified=True))
    tiles = QI21VAEDecode.execute(vae, {"samples": latents})[0]
    assert seen[-1][0] is True
    assert torch.equal(tiles, decoded(True))


def test_big_decodes_that_fit_run_in_one_pass(models, monkeypatch):
    """100x100 latent cells (1600 px) were tiled by the old fixed threshold (96x96); the planner decodes them in
    one pass when memory allows (the decode itself is replaced: only the choice is checked)."""
    calls = []
    monkeypatch.setattr("qi21.nodes.decode.decode_images", lambda vae, latents, tiled: calls.append(tiled) or (
        torch.zeros(1, 1, 1, 3), torch.zeros(1, 1, 1), torch.zeros(1, 1, 1, 4)))
    QI21VAEDecode.execute(models["vae"], {"samples": torch.zeros(1, 64, 100, 100)})
    shape = VAEShape.of(models["vae"])
    between = shape.weight_bytes + decode_transient(shape, 1, (100, 100), True) + 2**20
    assert between < shape.weight_bytes + decode_transient(shape, 1, (100, 100), False)
    monkeypatch.setattr(placement, "memory_budget",
                        lambda device, **kw: Budget(between, where="cpu", unified=True))
    QI21VAEDecode.execute(models["vae"], {"samples": torch.zeros(1, 64, 100, 100)})
    QI21VAEDecode.execute(models["vae"], {"samples": torch.zeros(1, 64, 100, 100)}, "off")
    assert calls == [False, True, False]


def test_the_text_encoder_node_streams_under_a_tight_budget_and_encodes_the_same(models_root, monkeypatch):
    from qi21.model.memory.estimate import EncoderDims, encode_transient
    from qi21.model.memory.weights import layered_weights
    from qi21.nodes.conditioning import QI21TextEncode

    encoder = gf.load("text_encoder")["text_encoder"]
    expected = QI21TextEncode.execute(encoder, "a red fox in the snow")[0]
    layers = encoder.model.language_model.layers
    weights = layered_weights(encoder.model, layers)
    tokens, patches = placement.encoder_shape(encoder, "a red fox in the snow", ())
    transient = encode_transient(EncoderDims.of(encoder.model), tokens, patches, 4)
    tight = weights.device_bytes(range(len(layers))) + transient + DEVICE_OVERHEAD
    assert tight < weights.total + transient + DEVICE_OVERHEAD
    monkeypatch.setattr(placement, "memory_budget",
                        lambda device, **kw: Budget(tight, 1 << 40, where="cpu (simulated)"))
    copies = []
    real = placement.LayerStreamer.__exit__

    def counted(self, *exc):
        copies.append(self.copies)
        return real(self, *exc)

    monkeypatch.setattr(placement.LayerStreamer, "__exit__", counted)
    got = QI21TextEncode.execute(encoder, "a red fox in the snow")[0]
    assert copies == [len(layers) + 1]  # every decoder layer streamed in once (and layer 0 fetched ahead again)
    assert torch.equal(got.text, expected.text)
    assert all(not layer._forward_pre_hooks for layer in layers)
    assert encoder.device.type == "cpu"


def _script(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"qi21_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_streaming_benchmark_dry_runs_on_the_cpu(tmp_path, capsys):
    rows = _script("memory").main(["streaming", "--dry-run", "--steps", "2", "--references", "1",
                                   "--json", str(tmp_path / "rows.json")])
    assert [r["budget"] for r in rows] == ["resident (no cap)", "simulated: all fits", "simulated: halfway",
                                           "simulated: leanest"]
    assert rows[-1]["plan"]["weights"] == "streamed 0/4" and rows[-1]["plan"]["cache"] == "host"
    assert all(r["bit_identical"] for r in rows)
    assert "| refs | budget | weights |" in capsys.readouterr().out and (tmp_path / "rows.json").is_file()


def test_the_planners_table_for_common_cards_prints_every_card():
    table = _script("memory").plan_markdown([8, 80], 64, ["bf16"])
    assert "| 8 GB | t2i |" in table and "| 80 GB | edit, 3 refs | resident | resident | device | one-pass |" in table


def test_the_bridge_budget_on_a_cpu_counts_what_the_model_already_holds(models, monkeypatch):
    monkeypatch.setattr(bridge, "memory_limit", lambda device: 3 * GIB)
    turbo = models["turbo"]
    held = sum(p.numel() * p.element_size() for p in turbo.parameters())
    budget = placement.memory_budget(torch.device("cpu"), modules=[turbo], tensors=[torch.zeros(256)])
    assert budget.unified and budget.held == held + 1024 and budget.device == 3 * GIB + held + 1024


def test_the_kept_cache_store_follows_the_planners_figure():
    from qi21.model.prefix_cache.kept_entries import PrefixCacheStore
    from qi21.model.prefix_cache.layout import PrefixKVCache

    store = PrefixCacheStore(budget_bytes=None)
    owner = torch.nn.Linear(1, 1)
    for i in range(3):
        cache = PrefixKVCache()
        cache.allocate([10], 2, 2, 8, torch.float32, "cpu")  # 2560 bytes each
        assert store.put(("k", i), cache, owner)
    assert store.nbytes == 3 * 2560
    store.set_free(2 * 2560)  # the next run leaves room for two: the least recently used goes now
    assert len(store) == 2 and ("k", 0) not in {key for key, _ in store._entries.values()}
    store.budget_bytes = 2560  # a fixed ceiling still binds when it is the smaller
    assert store.limit_bytes == 2560
    store.clear()


# -- the step cache's tensors ----------------------------------------------------------------------------------------
def _held(skipper) -> int:
    """Bytes of the tensors a StepCache holds now (each storage once)."""
    tensors = [skipper._before, skipper._anchor, skipper._indicator, skipper._reference,
               *(entry[1] for entry in (skipper._residual, skipper._previous) if entry is not None)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if t is not None}.values())


@pytest.mark.parametrize("mode", ["t8", "extrapolate"])
def test_the_planner_counts_what_the_step_cache_holds(monkeypatch, mode):
    """A real run (CFG, batch 2) measured at every block: the most the step cache holds while blocks 1..N-1 run is
    the planner's figure for it, within the planner's margin (predicted >= measured, at most 10% above); and every
    sampling phase of the plan grows by it."""
    from dit_fixtures import unit_scale_dit
    from qi21.model.options import with_options
    from qi21.model.sampling import step_cache as step_cache_module
    from qi21.model.sampling.step_cache import StepCacheOptions
    from test_step_cache import CONFIG, GRID, conditioning, run

    model = unit_scale_dit(CONFIG, seed=0)  # the step-cache tests' weights: finite, unit-scale
    seen, made = [], []
    real_for_run = step_cache_module.StepCache.for_run

    def for_run(*args, **kwargs):
        made.append(real_for_run(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(step_cache_module.StepCache, "for_run", staticmethod(for_run))
    for block in list(model.blocks)[1:]:
        block.register_forward_pre_hook(lambda module, args: seen.append(_held(made[-1])))
    options = StepCacheOptions(mode=mode, threshold=1e9, edit_threshold=1e9)
    result = run(model, steps=20, step_cache=options, batch_size=2, negative=conditioning(seed=4), cfg=2.0)
    assert "S" in result.report["step_cache"]["pattern"] and made  # skipped calls and full passes both ran
    shape = RunShape((7, 7), GRID, batch=2, cfg=True, step_cache=mode)
    across, _ = step_cache_bytes(CONFIG, shape, 4)
    measured = max(seen)
    print(f"step cache {mode}: measured {measured:,} B, predicted {across:,} B")
    assert measured <= across <= 1.10 * measured
    weights = dit_weights(model)
    plain = sampling_phases(weights, CONFIG, replace(shape, step_cache="off"), 4, unified=True)
    cached = sampling_phases(weights, CONFIG, shape, 4, unified=True)
    prefill_across, _ = step_cache_bytes(CONFIG, shape, 4, prefill=True)
    assert cached["cached"] - plain["cached"] == across
    assert cached["prefill"] - plain["prefill"] == prefill_across
    # the sampler nodes plan with the model copy's options (nodes/placement.py)
    copy = with_options(model, step_cache=options)
    assert placement.run_shape(copy, conditioning(), conditioning(seed=4), 128, 96, 2, True) == shape


def test_the_step_cache_at_2048_px_batch_4_is_gigabytes_the_plan_counts():
    run = RunShape.released(2048, references=1, batch=4, cfg=True)
    with_cache = replace(run, step_cache="extrapolate")
    across, between = step_cache_bytes(FULL, with_cache, 2)
    assert across == 3 * 8 * 128 * 128 * 4096 * 4 + 2 * 8 * 2048 * 512 * 4  # anchor + 2 residuals, 8 samples
    assert across > 6 * GIB and between < sampling_phases(BF16, FULL, run, 2)["cached"]
    plain, more = plan_run(BF16, FULL, run, Budget.gpu(80 * GIB), 2), plan_run(BF16, FULL, with_cache,
                                                                                Budget.gpu(80 * GIB), 2)
    assert more.phases["cached"] == plain.phases["cached"] + across
    assert RunShape.released(1024).step_cache == "off" and step_cache_bytes(FULL, run, 2) == (0, 0)
