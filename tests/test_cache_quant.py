"""The prefix cache stored in int8 / int4 (prefix_cache/storage_formats.py, comfy-kitchen): every way the cache
is reused (kept, partial, CFG's shared rows, a batch, the host-side cache, the Fun ControlNet's layers) gives the
same latents as the same run with a fresh quantized cache (the same bytes where the sums are the same, else float
rounding: tests/tolerances.py; fp32 tiny models); a quantized cache is reused
only by a run asking for the same storage; the bytes are what the planner predicts; without comfy-kitchen int8 and
int4 are refused naming the input."""

import sys

import pytest
import torch

from qi21.model.memory.estimate import GIB
from qi21.model.memory.planner import Budget, RunShape, plan_run, run_estimate
from qi21.model.memory.weights import synthetic_dit_weights
from qi21.model.options import options_of, with_cache_options
from qi21.model.prefix_cache.host_moves import HostPrefixKVCache
from qi21.model.prefix_cache.kept_entries import PrefixCacheStore, cache_owner
from qi21.model.prefix_cache.storage_formats import QuantizedRows, cache_row_bytes, cache_storage
from qi21.model.sampling.loop import initial_noise
from qi21.model.transformer.dit import DiTConfig
from test_controlnet_cache import conditioning as control_conditioning, controlled, net, pair, run as control_run, vae  # noqa: F401  (module fixtures)
from test_prefix_reuse import GRID, HEIGHT, WIDTH, edit, rows_through, run
from tolerances import rounding_close, same

QUANTIZED = ("int8", "int4")
FULL = DiTConfig()


@pytest.fixture(scope="module")
def model(dit_pair):
    return dit_pair[1]


# -- storage -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, payload", [("int8", 256), ("int4", 128)])
def test_rows_round_trip_through_the_layouts_with_their_scales(name, payload):
    storage = QuantizedRows(name)
    rows = torch.randn(10, 256, generator=torch.Generator().manual_seed(0))
    stored = torch.empty(10, storage.row_bytes(256), dtype=torch.uint8)
    storage.encode(rows, stored)
    assert stored.shape[1] == payload + 4  # the quantized bytes, then one fp32 scale per row
    back = storage.decode(stored, 256, torch.float32)
    error = ((back - rows).norm() / rows.norm()).item()
    assert error < (0.01 if name == "int8" else 0.15)
    again = torch.empty_like(stored)
    storage.encode(rows[3:5], again[:2])  # a row's bytes depend on that row only
    assert torch.equal(again[:2], stored[3:5])


def test_quantized_bytes_against_bf16_at_full_size():
    """Planner bytes, scales included, for t2i and a 3-reference edit at 1024x1024 (full-model shapes)."""
    for references in (0, 3):
        run_shape = RunShape.released(1024, references)
        bf16 = run_estimate(FULL, run_shape, 2).cache
        for name, bound in (("int8", 0.52), ("int4", 0.27)):
            quantized = run_estimate(FULL, RunShape(**{**vars(run_shape), "cache_dtype": name}), 2).cache
            assert quantized <= bound * bf16, (references, name, quantized / bf16)
    assert cache_row_bytes("int8", 4096, 2) == 4100 and cache_row_bytes("int4", 4096, 2) == 2052


def test_on_a_12_gib_card_an_int8_cache_leaves_less_to_copy_per_step():
    weights = synthetic_dit_weights(FULL, "bf16")
    shape = RunShape.released(1024, references=3)
    budget = Budget.gpu(12 * GIB)
    bf16 = plan_run(weights, FULL, shape, budget, 2)
    int8 = plan_run(weights, FULL, RunShape(**{**vars(shape), "cache_dtype": "int8"}), budget, 2)
    assert bf16.cache == "host" and int8.copied_per_step < bf16.copied_per_step  # less to stream in per step
    assert int8.report()["cache_dtype"] == "int8" and int8.cache_bytes <= 0.52 * bf16.cache_bytes
    forced = plan_run(weights, FULL, RunShape(**{**vars(shape), "cache_dtype": "int8"}), budget, 2,
                      cache_choice="cpu")
    assert forced.cache == "host"
    from qi21.model.memory.planner import PlanError

    with pytest.raises(PlanError, match=r"prefix cache on the device \(the cache options' device = gpu\)"):
        plan_run(weights, FULL, RunShape.released(1024, references=10), Budget.gpu(8 * GIB), 2, cache_choice="gpu")


# -- reuse equals a fresh quantized cache ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", QUANTIZED)
def test_kept_and_partial_reuse_equal_a_fresh_quantized_cache(model, dtype):
    store = PrefixCacheStore(budget_bytes=2**30)
    first = run(model, edit(), store, cache_dtype=dtype)
    hit = run(model, edit(), store, cache_dtype=dtype)
    assert (first.report["cache"], hit.report["cache"], hit.report["cache_dtype"]) == ("miss", "hit", dtype)
    same(hit.latents, first.latents)
    new_words = edit(("t", 9, 4))
    partial = run(model, new_words, store, cache_dtype=dtype)
    assert partial.report["cache"] == "partial"
    assert partial.report["prefix_rows_reused"] == rows_through(None, 1) + 2
    rounding_close(partial.latents, run(model, new_words, cache_dtype=dtype).latents)  # the prefix in two parts
    store.clear()


def test_a_quantized_cache_is_reused_only_by_the_same_storage(model):
    store = PrefixCacheStore(budget_bytes=2**30)
    run(model, edit(), store, cache_dtype="int8")
    assert run(model, edit(), store).report["cache"] == "miss"  # default: not the int8 rows
    assert run(model, edit(), store, cache_dtype="int4").report["cache"] == "miss"
    assert run(model, edit(), store, cache_dtype="int8").report["cache"] == "hit"
    assert {cache.storage_name for cache in store.caches()} == {"default", "int8", "int4"}
    store.clear()


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_cfg_shared_rows_and_a_batch_of_two(model, dtype):
    positive, negative = edit(("t", 7, 3)), edit(("t", 2, 9))
    store = PrefixCacheStore(budget_bytes=2**30)
    cfg = dict(negative=negative, cfg=4.0, cache_dtype=dtype)
    first = run(model, positive, store, **cfg)
    assert first.report["prefix_rows_reused"] == rows_through(None, 1) + 2  # the negative read the positive's rows
    again = run(model, positive, store, **cfg)
    assert again.report["cache"] == "hit"
    same(again.latents, first.latents)
    other = edit(("t", 4, 5))  # another negative after the same references: partial
    partial = run(model, positive, store, **{**cfg, "negative": other})
    assert partial.report["cache"] == "partial"
    same(partial.latents, run(model, positive, **{**cfg, "negative": other}).latents)
    two = run(model, positive, store, cache_dtype=dtype, noise=initial_noise(5, 2, HEIGHT, WIDTH))
    alone = run(model, positive, cache_dtype=dtype)  # the batch's first image is this seed's batch-1 image
    rounding_close(two.latents[:1], alone.latents)  # a batch's GEMMs may take other kernels
    assert two.report["cache_bytes"] == alone.report["cache_bytes"]  # a batch shares one quantized copy
    store.clear()


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_the_host_cache_moves_the_quantized_bytes(model, dtype):
    made = []

    def host():
        made.append(HostPrefixKVCache("cpu"))
        return made[-1]

    device = run(model, edit(), cache_dtype=dtype)
    store = PrefixCacheStore(budget_bytes=2**30)
    on_host = run(model, edit(), store, cache_dtype=dtype, new_cache=host)
    same(on_host.latents, device.latents)
    assert on_host.report["cache_bytes"] == device.report["cache_bytes"]
    slot = made[0]._slots[0][0]  # what a step copies in: one layer's quantized bytes
    assert made[0].kv[0].dtype == slot.dtype == torch.uint8 and slot.numel() == made[0].kv[0][0].numel()
    kept = run(model, edit(), store, cache_dtype=dtype, new_cache=host)
    assert kept.report["cache"] == "hit"
    same(kept.latents, device.latents)
    store.clear()


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_the_controlnets_layers_are_quantized_and_reused_too(pair, net, vae, dtype):  # noqa: F811
    patched, store = controlled(pair[1], net, vae, window=(0.2, 0.8)), PrefixCacheStore(budget_bytes=None)
    first = control_run(patched, control_conditioning(), keep_cache=True, store=store, cache_dtype=dtype)
    edited = control_run(patched, control_conditioning(tail_seed=8), keep_cache=True, store=store, cache_dtype=dtype)
    assert edited.report["cache"] == "partial" and edited.report["cache_dtype"] == dtype
    fresh = control_run(patched, control_conditioning(tail_seed=8), cache_dtype=dtype)
    rounding_close(edited.latents, fresh.latents)  # a partial prefix: computed in two parts
    plain = control_run(patched, control_conditioning(tail_seed=8))
    assert fresh.report["control"]["cache_bytes"]["control"] < plain.report["control"]["cache_bytes"]["control"]
    assert (first.latents - edited.latents).abs().max() > 1e-3
    store.clear()


def test_an_interrupted_quantized_run_leaves_nothing_half_used(model):
    store = PrefixCacheStore(budget_bytes=2**30)
    run(model, edit(), store, cache_dtype="int8")

    def interrupt(info):
        raise InterruptedError("cancel")

    with pytest.raises(InterruptedError):
        run(model, edit(("t", 9, 4)), store, cache_dtype="int8", callback=interrupt)
    assert len(store) == 0  # what the interrupted run read was dropped with it
    same(run(model, edit(("t", 9, 4)), store, cache_dtype="int8").latents,
          run(model, edit(("t", 9, 4)), cache_dtype="int8").latents)
    store.clear()


def test_quantized_caches_change_the_latents_by_their_rounding_only(model):
    exact = run(model, edit()).latents
    errors = {dtype: (run(model, edit(), cache_dtype=dtype).latents - exact).abs().max().item()
              for dtype in QUANTIZED}
    assert 0 < errors["int8"] < errors["int4"] < 0.1 * exact.abs().max().item(), errors


# -- options, errors ---------------------------------------------------------------------------------------------
def test_options_copy_shares_the_weights_and_keys_caches_by_the_model(model):
    assert with_cache_options(model) is model
    copy = with_cache_options(model, "cpu", "int8")
    assert copy is not model and options_of(copy).cache.dtype == "int8" and options_of(model).cache.dtype == "default"
    assert cache_owner(copy) is model
    assert all(a is b for a, b in zip(copy.parameters(), model.parameters()))
    with pytest.raises(ValueError, match="device must be one of auto, gpu, cpu, off; got 'vram'"):
        with_cache_options(model, "vram")
    with pytest.raises(ValueError, match="dtype must be one of default, int8, int4; got 'fp8'"):
        with_cache_options(model, "auto", "fp8")


def test_without_comfy_kitchen_int8_and_int4_name_the_input(model, monkeypatch):
    monkeypatch.setitem(sys.modules, "comfy_kitchen", None)  # `import comfy_kitchen` fails as if not installed
    with pytest.raises(ImportError, match=r"A prefix cache with dtype int8 .*pip install"):
        with_cache_options(model, "auto", "int8")
    with pytest.raises(ImportError, match=r"A prefix cache with cache_dtype int4"):
        run(model, edit(), cache_dtype="int4")
    assert cache_storage("default") is None  # the default needs nothing
    assert run(model, edit()).report["cache_dtype"] == "default"


def test_a_model_too_narrow_for_int4_is_refused_at_the_node():
    from qi21.model.transformer.dit import QwenImage21DiT

    narrow = QwenImage21DiT(DiTConfig(num_layers=1, num_heads=1, head_dim=32, context_in_dim=48,
                                      axes_dims_rope=(4, 14, 14)))
    with pytest.raises(ValueError, match="dtype int4: an int4 prefix cache needs heads x head_dim divisible by 64"):
        with_cache_options(narrow, "auto", "int4")
    assert options_of(with_cache_options(narrow, "auto", "int8")).cache.dtype == "int8"


def test_the_default_cache_reports_fp32_bytes_of_every_prefix_row(model):
    report = run(model, edit()).report
    assert report["cache_dtype"] == "default"
    assert report["cache_bytes"] == edit().layout(GRID).prefix_len * 2 * 3 * 64 * 4


# -- the node, through the samplers -------------------------------------------------------------------------------
def test_the_prefix_cache_node_reaches_both_samplers_and_the_report(model):
    from qi21.nodes.cache import QI21CacheOptions
    from qi21.nodes.samplers import QI21Sampler, QI21TurboSampler
    from test_streaming import conditioning

    plain = QI21TurboSampler.execute(model, conditioning(), 0, 128, 96, 1).ui["qi21_report"][0]
    assert (plain["cache_dtype"], plain["plan"]["cache_dtype"]) == ("default", "default")
    for dtype in QUANTIZED:
        copy = QI21CacheOptions.execute(model, "auto", dtype)[0]
        report = QI21TurboSampler.execute(copy, conditioning(), 0, 128, 96, 1).ui["qi21_report"][0]
        assert report["cache_dtype"] == report["plan"]["cache_dtype"] == dtype
        assert report["cache_bytes"] == report["plan"]["cache_bytes"] < plain["cache_bytes"]  # predicted = held
    on_host = QI21CacheOptions.execute(model, "cpu", "int8")[0]
    report = QI21Sampler.execute(on_host, conditioning(), 0, 2, 1.0, 128, 96, 1).ui["qi21_report"][0]
    assert (report["plan"]["cache"], report["cache_device"], report["cache_dtype"]) == ("host", "cpu", "int8")
    off = QI21CacheOptions.execute(model, "off", "default")[0]
    report = QI21TurboSampler.execute(off, conditioning(), 0, 128, 96, 1).ui["qi21_report"][0]
    assert report["cache"] == "off" and any("device is off" in note for note in report["notes"])
    assert QI21CacheOptions.validate_inputs(device="vram") is not True
    with pytest.raises(ValueError, match="device"):
        QI21CacheOptions.execute(model, "vram", "default")
