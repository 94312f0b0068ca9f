"""An interrupt or an exception at any point of a run (the prefill, a cached step, the last step, the decode)
frees the prefix cache and every temporary tensor, and the next run gives the latents and images of a run that
was never interrupted, bit for bit.

Three ways a run ends early: an exception inside the DiT (what an out-of-memory error looks like), a
KeyboardInterrupt inside the DiT (Ctrl+C in a script), and ComfyUI's Cancel, which the bridge turns into an
exception at the next step boundary. The tiny set is loaded in fp32 through the nodes; the conditioning is real
(one reference through the VAE and the vision tower).
"""

import weakref
from types import SimpleNamespace

import pytest
import torch

import graph_fixtures as gf
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.nodes import bridge
from qi21.nodes.conditioning import QI21Reference, QI21TextEncode
from qi21.nodes.decode import QI21VAEDecode
from qi21.nodes.placement import KEPT_CACHES
from qi21.nodes.samplers import QI21TurboSampler

SEED, SIZE, STEPS = 7, 256, 8


class SimulatedOutOfMemory(RuntimeError):
    pass


@pytest.fixture(scope="module")
def graph(models_root):
    models = gf.load("turbo", "text_encoder", "vae")
    image = torch.rand(1, 256, 288, 3, generator=torch.Generator().manual_seed(0))
    references = QI21Reference.execute(models["vae"], image, 0)[0]
    models["positive"] = QI21TextEncode.execute(models["text_encoder"], "<image1> as a watercolour", references)[0]
    KEPT_CACHES.clear()
    yield models
    KEPT_CACHES.clear()


def sample(graph, keep=False):
    out = QI21TurboSampler.execute(graph["turbo"], graph["positive"], SEED, SIZE, SIZE, 1, keep_cache=keep)
    return out[0], out.ui["qi21_report"][0]


@pytest.fixture(scope="module")
def expected(graph):
    """The uninterrupted run (also warms every per-conditioning memo, so later byte counts compare like for like)."""
    latent, report = sample(graph)
    assert report["cache"] == "miss" and len(KEPT_CACHES) == 0
    return latent["samples"], QI21VAEDecode.execute(graph["vae"], latent).args


def fail_in_forward(monkeypatch, model, at_call: int, error: type[BaseException]):
    """Make the DiT's `at_call`-th forward of the next run raise a new `error` (call 1 is the prefill)."""
    calls = {"n": 0}
    forward = model.forward

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at_call:
            raise error("raised by the test")
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", failing)
    return calls


def cancel_after_step(monkeypatch, step: int):
    """ComfyUI's Cancel pressed while step `step` runs: the sampler stops at the next step boundary."""
    update = bridge.Progress.update

    def cancelling(self, done, preview=None):
        update(self, done, preview)
        if done == step:
            bridge.request_interrupt()

    monkeypatch.setattr(bridge.Progress, "update", cancelling)


def early_end(at: int, how):
    """A run ending at DiT forward call `at` (1 is the prefill, 2..8 the cached steps), by `how`: an exception
    class (not an instance: an instance raised twice keeps its first traceback, and with it every tensor of that
    run) or "cancel"."""
    return pytest.param(at, how, id=f"step {at}-{getattr(how, '__name__', how)}")


CASES = [early_end(1, SimulatedOutOfMemory), early_end(1, KeyboardInterrupt), early_end(2, SimulatedOutOfMemory),
         early_end(5, "cancel"), early_end(8, KeyboardInterrupt)]


@pytest.fixture
def prefills(monkeypatch):
    """The prefix caches the next run fills, held weakly (a gc scan per check would cost more than the run)."""
    watch = SimpleNamespace(caches=weakref.WeakSet(), count=0)
    allocate = PrefixKVCache.allocate

    def recording(self, *args, **kwargs):
        watch.caches.add(self)
        watch.count += 1
        return allocate(self, *args, **kwargs)

    monkeypatch.setattr(PrefixKVCache, "allocate", recording)
    return watch


@pytest.mark.parametrize("keep", [False, True], ids=["keep_cache off", "keep_cache on"])
@pytest.mark.parametrize("at, how", CASES)
def test_a_run_that_ends_early_leaves_nothing_behind_and_the_next_run_is_unchanged(graph, expected, prefills,
                                                                                    monkeypatch, at, how, keep):
    _, before = gf.leftovers()
    if how == "cancel":
        cancel_after_step(monkeypatch, at)
        error_type = InterruptedError
    else:
        calls = fail_in_forward(monkeypatch, graph["turbo"], at, how)
        error_type = how
    with pytest.raises(error_type) as error:
        sample(graph, keep=keep)
    # While ComfyUI still holds the exception (it reports it), the cache's payload is already gone.
    assert prefills.count == (0 if how != "cancel" and at == 1 else 1)  # failed in the prefill, or after it
    assert not any(cache.filled for cache in prefills.caches) and len(KEPT_CACHES) == 0
    if how != "cancel":
        assert calls["n"] == at
    del error
    filled, after = gf.leftovers()
    assert filled == [] and after <= before, f"{after - before} bytes of tensors outlived the run"

    monkeypatch.undo()
    latent, report = sample(graph, keep=keep)
    assert report["cache"] == "miss" and torch.equal(latent["samples"], expected[0])
    KEPT_CACHES.clear()


def test_a_failing_run_that_reused_a_kept_cache_drops_it_and_the_next_run_is_unchanged(graph, expected, monkeypatch):
    first, report = sample(graph, keep=True)
    assert report["cache"] == "miss" and len(KEPT_CACHES) == 1 and torch.equal(first["samples"], expected[0])
    _, before = gf.leftovers()
    fail_in_forward(monkeypatch, graph["turbo"], 3, SimulatedOutOfMemory)
    with pytest.raises(SimulatedOutOfMemory):
        sample(graph, keep=True)  # a hit: it took the entry out of the store
    filled, after = gf.leftovers()
    assert filled == [] and len(KEPT_CACHES) == 0  # an entry a failed run held is freed, not put back
    kept_bytes = report["cache_bytes"]
    assert after <= before - kept_bytes

    monkeypatch.undo()
    again, report = sample(graph, keep=True)
    assert report["cache"] == "miss" and torch.equal(again["samples"], expected[0])
    hit, report = sample(graph, keep=True)
    assert report["cache"] == "hit" and torch.equal(hit["samples"], expected[0])
    KEPT_CACHES.clear()


@pytest.mark.parametrize("how", [SimulatedOutOfMemory, KeyboardInterrupt], ids=lambda h: h.__name__)
def test_a_decode_that_fails_halfway_leaves_nothing_behind_and_the_next_decode_is_unchanged(graph, expected,
                                                                                           monkeypatch, how):
    latent = {"samples": expected[0]}
    _, before = gf.leftovers()
    stage = graph["vae"].decoder.up_blocks[2]  # after the middle and two upsampling stages have run

    def failing(*args, **kwargs):
        raise how("raised by the test")

    monkeypatch.setattr(stage, "forward", failing)
    with pytest.raises(how):
        QI21VAEDecode.execute(graph["vae"], latent)
    _, after = gf.leftovers()
    assert after <= before, f"{after - before} bytes of tensors outlived the decode"
    monkeypatch.undo()
    for got, want in zip(QI21VAEDecode.execute(graph["vae"], latent).args, expected[1]):
        assert torch.equal(got, want)
