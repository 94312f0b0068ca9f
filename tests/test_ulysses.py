"""Ulysses sequence parallelism over two CPU ranks (gloo): the split model equals one process, each rank holds half
of the prefix cache, sends what the formula says, and a dead worker gives a clear error and a clean next run.

One pool of two spawned workers serves the whole module (a spawn costs seconds); the test that kills a worker runs
last and starts the next pool itself. The single-process reference runs here, on the same weights.
"""

import os
import signal

import pytest
import torch

import graph_fixtures as gf
from parallel_fixtures import CONFIG, build_tiny, cached_step_traffic, prompt
from qi21.demo import tiny_checkpoints as tiny
from qi21.model.parallel import pool as pools
from qi21.model.parallel.split import SplitModel
from qi21.model.parallel.ulysses import cached_step_bytes, check_world
from qi21.model.parallel.worker import from_value, run_sample
from qi21.model.prefix_cache.kept_entries import PrefixCacheStore
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.sampling.loop import sample
from qi21.model.transformer.dit import PrefixInputs
from qi21.nodes.loaders import QI21ModelLoader
from qi21.nodes.lora import QI21LoraLoader
from qi21.nodes.samplers import QI21Sampler, QI21TurboSampler

EXACT = 1e-5  # fp32: the split model against one process
WORLD = 2
WIDTH, HEIGHT = 96, 64  # a 4 x 6 latent target (x32 images always have an even number of rows on each side)
ODD_GRID = (3, 5)  # 15 target rows, padded to 16 on two ranks: what 8 or more ranks meet at real sizes
SIGMAS = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
REFS = (((4, 4), 11), ((2, 4), 12), ((4, 2), 13))  # a three-reference edit


def edit(instruction=("t", 5, 3)):
    items = [("t", 3, 1)]
    for i, ref in enumerate(REFS):
        items += [ref, ("t", 2, 20 + i)]
    return prompt(*items, instruction)


@pytest.fixture(scope="module")
def pool():
    workers = pools.pool_for(("cpu",) * WORLD, threads=1, hang_seconds=120)
    workers.ensure_model(("tiny", 0), build_tiny, (0,))
    yield workers
    pools.close_pools()


@pytest.fixture(scope="module")
def model():
    return build_tiny("cpu", 0)


def split_run(pool, **options):
    """`sample` on the ranks: rank 0's latents and every rank's report."""
    answers = pool.call(run_sample, dict(sigmas=SIGMAS, width=WIDTH, height=HEIGHT, **options), what="sampling")
    return from_value(answers[0]["latents"]), [a["report"] for a in answers]


def one_process(model, store=None, **options):
    with torch.no_grad():
        return sample(model, sigmas=SIGMAS, width=WIDTH, height=HEIGHT, store=store, **options)


def assert_close(got, expected):
    torch.testing.assert_close(got, expected, rtol=0, atol=EXACT)


@pytest.mark.parametrize("case", ["t2i", "edit", "cfg"])
def test_two_ranks_sample_what_one_process_samples_with_half_the_cache_each(pool, model, case):
    options = dict(positive=prompt(("t", 9, 5)), seed=3, batch_size=2)
    if case == "edit":
        options.update(positive=edit(), batch_size=1)
    elif case == "cfg":
        options.update(positive=edit(), negative=edit(("t", 4, 8)), cfg=3.0, batch_size=1)
    latents, reports = split_run(pool, **options)
    expected = one_process(model, **options)
    assert_close(latents, expected.latents)
    assert [r["cache"] for r in reports] == ["miss", "miss"]
    assert [r["cache_bytes"] for r in reports] == [expected.report["cache_bytes"] // WORLD] * WORLD


def test_a_kept_cache_and_a_partial_reuse_equal_one_process(pool, model):
    store = PrefixCacheStore()
    runs = []
    for instruction in (("t", 5, 3), ("t", 5, 3), ("t", 6, 4)):  # miss, hit, the same references after a new text
        options = dict(positive=edit(instruction), seed=7, keep_cache=True)
        latents, reports = split_run(pool, **options)
        expected = one_process(model, store=store, **options)
        assert_close(latents, expected.latents)
        assert all(r["prefix_rows_reused"] == expected.report["prefix_rows_reused"] for r in reports)
        runs.append(reports[0]["cache"])
    assert runs == ["miss", "hit", "partial"]
    pool.call(pools.worker.clear_caches)


def test_a_cached_step_sends_four_all_to_alls_of_its_padded_rows_per_block(pool, model):
    cond = edit()
    layout = cond.layout(ODD_GRID)
    prefixes = [PrefixInputs(layout=layout, text=cond.text, references=cond.references)]
    target = torch.randn(2, ODD_GRID[0] * ODD_GRID[1], 64, generator=torch.Generator().manual_seed(5))
    answers = pool.call(cached_step_traffic, prefixes, target)
    cache = PrefixKVCache()
    with torch.no_grad():
        model(target, torch.tensor([0.9]), prefixes, cache=cache, mode="prefill")
        expected = model(target, torch.tensor([0.5]), prefixes, cache=cache, mode="cached")
    samples, rows = target.shape[:2]
    local_rows = -(-rows // WORLD)  # 15 rows padded to 16: 8 per rank
    # q, k, v and the output: (T/N) x width x 4 bytes x (N-1)/N each, per sample and block
    formula = CONFIG.num_layers * 4 * samples * local_rows * CONFIG.width * 4 * (WORLD - 1) // WORLD
    assert cached_step_bytes(rows, CONFIG.width, CONFIG.num_layers, WORLD, 4, samples) == formula
    for answer in answers:
        assert answer["sent"] == formula
        assert answer["calls"] == CONFIG.num_layers * 2  # q/k/v in one call, the output in another
        assert answer["cache_bytes"] * WORLD == cache.nbytes
        assert_close(from_value(answer["out"]), expected)


@pytest.mark.parametrize("world, gib", [(2, 1.0), (4, 0.75)])
def test_the_documented_traffic_at_1024_in_bf16(world, gib):
    # the formula the traffic test checks against counted bytes, at the released model's size (docs/multigpu.md)
    assert cached_step_bytes(64 * 64, 4096, 32, world, 2) == gib * 2**30


def test_three_ranks_are_refused_for_four_heads_and_32():
    with pytest.raises(ValueError, match=r"3 devices needs the number of devices to divide the model's 32 attention "
                                         r"heads.*1, 2, 4, 8, 16, 32 devices"):
        check_world(32, 3)
    check_world(32, 4)


def test_an_interrupt_stops_every_rank_at_the_same_step_and_the_pool_lives_on(pool, model):
    class Stop(Exception):
        pass

    def check_interrupt():  # the host's interrupt flag, set from the start: the ranks stop after a step they agree on
        raise Stop("cancelled")

    steps = []
    with pytest.raises(Stop):
        pool.call(run_sample, dict(positive=prompt(("t", 9, 5)), sigmas=torch.linspace(1, 0, 201), width=WIDTH,
                                   height=HEIGHT), what="sampling", check_interrupt=check_interrupt,
                  on_progress=lambda done, total: steps.append(done))
    assert pool.alive and len(steps) < 200
    latents, _ = split_run(pool, positive=prompt(("t", 9, 5)), seed=1)
    assert_close(latents, one_process(model, positive=prompt(("t", 9, 5)), seed=1).latents)


def test_the_loader_and_sampler_nodes_split_the_model_over_cpu_ranks(pool, models_root):
    """The node path: the loader's devices / parallel inputs give a model the samplers run on the workers (the same
    pool: these devices), equal to the model loaded in this process; the workers then hold the file's chain."""
    positive = gf.synthetic_conditioning(text_runs=[11])
    whole = QI21ModelLoader.execute(gf.SINGLE["turbo"], "default")[0]
    split = QI21ModelLoader.execute(gf.SINGLE["turbo"], "default", devices="cpu, cpu", parallel="ulysses")[0]
    assert isinstance(split, SplitModel) and split.devices == ("cpu", "cpu")
    expected = QI21TurboSampler.execute(whole, positive, 5, 64, 96, 1, keep_cache=False)
    got = QI21TurboSampler.execute(split, positive, 5, 64, 96, 1, keep_cache=False)
    assert_close(got[0]["samples"], expected[0]["samples"])
    expected_plain = expected[0]["samples"]
    report, single = got.ui["qi21_report"][0], expected.ui["qi21_report"][0]
    assert report["parallel"]["cache_bytes_per_device"] == [single["cache_bytes"] // WORLD] * WORLD
    assert pools.current_pool() is pool and pool.model_key == (split.key, "ulysses")

    # a LoRA on the split model joins its chain: the workers rebuild it with the LoRA, as the host applies it
    lora = tiny.SPEED_LORA_FILE
    with_lora = QI21LoraLoader.execute(split, lora, 0.8)[0]
    assert with_lora.key != split.key and split.loras == ()
    expected = QI21TurboSampler.execute(QI21LoraLoader.execute(whole, lora, 0.8)[0], positive, 5, 64, 96, 1)
    got = QI21TurboSampler.execute(with_lora, positive, 5, 64, 96, 1)
    assert_close(got[0]["samples"], expected[0]["samples"])
    assert pool.model_key == (with_lora.key, "ulysses") and not torch.equal(got[0]["samples"], expected_plain)


@pytest.mark.parametrize("devices, parallel, message", [
    ("cuda:0,cpu", "ulysses", "mixes CPU and GPU ranks"),
    ("cuda:0,cuda:0", "ulysses", "names a GPU twice"),
    ("gpu0,gpu1", "ulysses", "'gpu0' is not a device"),
    ("cpu", "ulysses", "needs at least two devices"),
    ("cpu,cpu", "off", "names 2 devices with parallel off; name one"),
    ("cpu,cpu,cpu", "cfg", "parallel = cfg runs CFG's two prompts on two devices; devices names 3"),
])
def test_the_loader_refuses_devices_it_cannot_split_over(models_root, devices, parallel, message):
    with pytest.raises(ValueError, match=message):
        QI21ModelLoader.execute(gf.SINGLE["turbo"], "default", devices=devices, parallel=parallel)


@pytest.mark.parametrize("guided", [True, False], ids=["cfg 3 with a negative", "cfg 1"])
def test_cfg_parallel_puts_each_prompt_on_its_rank_and_equals_one_process(pool, model, guided):
    pool.ensure_model(("tiny", 0), build_tiny, (0,), mode="cfg")
    positive, negative = edit(), edit(("t", 4, 8))
    options = dict(positive=positive, negative=negative, cfg=3.0 if guided else 1.0, seed=6, batch_size=2)
    latents, reports = split_run(pool, **options)
    assert_close(latents, one_process(model, **options).latents)
    # each rank holds its own prompt's whole cache (without guidance both ran the positive one)
    own = [one_process(model, positive=p, seed=6).report["cache_bytes"]
           for p in ((positive, negative) if guided else (positive, positive))]
    assert [r["cache_bytes"] for r in reports] == own


def test_the_base_sampler_node_runs_cfg_parallel(pool, models_root):
    positive = gf.synthetic_conditioning(text_runs=[11], seed=1)
    negative = gf.synthetic_conditioning(text_runs=[6], seed=2)
    whole = QI21ModelLoader.execute(gf.SINGLE["model"], "default")[0]
    split = QI21ModelLoader.execute(gf.SINGLE["model"], "default", devices="cpu,cpu", parallel="cfg")[0]
    expected = QI21Sampler.execute(whole, positive, 5, 3, 2.5, 64, 64, 1, negative=negative)
    got = QI21Sampler.execute(split, positive, 5, 3, 2.5, 64, 64, 1, negative=negative)
    assert_close(got[0]["samples"], expected[0]["samples"])
    assert got.ui["qi21_report"][0]["parallel"]["mode"] == "cfg"


def test_bad_input_fails_alike_on_every_rank_and_the_pool_lives_on(pool):
    pool.ensure_model(("tiny", 0), build_tiny, (0,))  # the node test left the file's chain in the workers
    with pytest.raises(RuntimeError, match="sampling failed on every device: ValueError: cfg must be >= 1"):
        split_run(pool, positive=prompt(("t", 9, 5)), cfg=0.5)
    assert pool.alive


def test_a_killed_worker_is_named_with_its_step_and_the_next_run_is_clean(pool, model):
    pool.ensure_model(("tiny", 0), build_tiny, (0,))
    def kill_rank_1(done, total):
        if done == 1:
            os.kill(pool.pids[1], signal.SIGKILL)

    with pytest.raises(pools.WorkerError, match=r"worker on cpu \(rank 1\) stopped \(exit code -9\) during sampling "
                                                r"at step \d of 8.*next run starts new ones"):
        pool.call(run_sample, dict(positive=prompt(("t", 9, 5)), sigmas=torch.linspace(1, 0, 9), width=WIDTH,
                                   height=HEIGHT), what="sampling", on_progress=kill_rank_1)
    assert not pool.alive
    fresh = pools.pool_for(("cpu",) * WORLD, threads=1, hang_seconds=120)
    assert fresh is not pool and fresh.alive
    fresh.ensure_model(("tiny", 0), build_tiny, (0,))
    latents, _ = split_run(fresh, positive=prompt(("t", 9, 5)), seed=2)
    assert_close(latents, one_process(model, positive=prompt(("t", 9, 5)), seed=2).latents)


@pytest.mark.slow
def test_four_ranks_sample_an_edit_with_cfg_as_one_process_with_a_quarter_of_the_cache_each(model):
    four = pools.pool_for(("cpu",) * 4, threads=1, hang_seconds=120)  # replaces the two-rank pool
    try:
        four.ensure_model(("tiny", 0), build_tiny, (0,))
        options = dict(positive=edit(), negative=edit(("t", 4, 8)), cfg=3.0, seed=4)
        latents, reports = split_run(four, **options)
        expected = one_process(model, **options)
        assert_close(latents, expected.latents)
        assert [r["cache_bytes"] for r in reports] == [expected.report["cache_bytes"] // 4] * 4
    finally:
        pools.close_pools()


def test_one_device_with_parallel_off_runs_the_whole_dit_in_a_worker(models_root):
    """Per-component devices: the DiT on a device of its own (one worker), the rest in the host; nothing is split."""
    positive = gf.synthetic_conditioning(text_runs=[11])
    whole = QI21ModelLoader.execute(gf.SINGLE["turbo"], "default")[0]
    apart = QI21ModelLoader.execute(gf.SINGLE["turbo"], "default", devices="cpu", parallel="off")[0]
    assert isinstance(apart, SplitModel) and apart.devices == ("cpu",)
    expected = QI21TurboSampler.execute(whole, positive, 5, 64, 96, 1)
    got = QI21TurboSampler.execute(apart, positive, 5, 64, 96, 1)
    torch.testing.assert_close(got[0]["samples"], expected[0]["samples"], rtol=0, atol=0)  # the same computation
    single_bytes = expected.ui["qi21_report"][0]["cache_bytes"]
    assert got.ui["qi21_report"][0]["parallel"]["cache_bytes_per_device"] == [single_bytes]
    assert len(pools.current_pool().pids) == 1
