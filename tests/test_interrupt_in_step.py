"""A cancel lands inside a step, between two blocks, not only at the next step boundary: a 2048x2048 batch-8 step
took 14.6 s to stop on a CPU when the sampler checked only between steps."""

import gc
import weakref

import pytest
import torch

from dit_fixtures import tiny_pair
from qi21.model.encoders.conditioning import Conditioning
from qi21.model.prefix_cache.kept_entries import PrefixCacheStore
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.sampling.loop import initial_noise, sample
from qi21.model.sampling.schedule import turbo_sigmas
from qi21.nodes import bridge

SIZE = 256


class Cancelled(Exception):
    pass


@pytest.fixture(scope="module")
def model():
    return tiny_pair()[1]


def prompt():
    generator = torch.Generator().manual_seed(3)
    return Conditioning(text=torch.randn(9, 48, generator=generator), image_slots=torch.zeros(9, dtype=torch.bool))


@pytest.mark.parametrize("step", [0, 3], ids=["prefill", "cached_step"])
def test_cancel_stops_inside_the_step(model, step, monkeypatch):
    """Cancel pressed while block 0 of `step` runs: block 1 of that step never runs, no step callback fires after
    it, the cache is freed, and the next run equals a run that was never cancelled."""
    noise = initial_noise(5, 1, SIZE, SIZE)
    cond = prompt()
    with torch.no_grad():
        expected = sample(model, cond, sigmas=turbo_sigmas(), width=SIZE, height=SIZE, noise=noise).latents

    state = {"step": 0, "blocks_after_cancel": 0, "cancelled": False}
    steps_seen, caches = [], []
    allocate = PrefixKVCache.allocate

    def tracking_allocate(self, *args, **kwargs):
        caches.append(weakref.ref(self))
        return allocate(self, *args, **kwargs)

    monkeypatch.setattr(PrefixKVCache, "allocate", tracking_allocate)

    def check_interrupt():
        if state["cancelled"]:
            raise Cancelled

    def block_ran(block, args, out):
        if state["cancelled"]:
            state["blocks_after_cancel"] += 1
        elif state["step"] == step:
            state["cancelled"] = True  # the user presses Cancel while this block computes

    def on_step(info):
        state["step"] = info.step + 1
        steps_seen.append(info.step)

    handles = [block.register_forward_hook(block_ran) for block in model.blocks]
    store = PrefixCacheStore()
    try:
        with pytest.raises(Cancelled), torch.no_grad():
            sample(model, cond, sigmas=turbo_sigmas(), width=SIZE, height=SIZE, noise=noise, callback=on_step,
                   check_interrupt=check_interrupt, keep_cache=True, store=store)
    finally:
        for handle in handles:
            handle.remove()
    assert state["blocks_after_cancel"] == 0
    assert steps_seen == list(range(step))
    gc.collect()
    assert len(store) == 0 and all(ref() is None or not ref().filled for ref in caches)
    with torch.no_grad():
        again = sample(model, cond, sigmas=turbo_sigmas(), width=SIZE, height=SIZE, noise=noise).latents
    torch.testing.assert_close(again, expected, rtol=0, atol=0)


def test_sampler_node_cancel_lands_inside_the_prefill(models_root):
    """Through the Turbo sampler node: Cancel pressed during the prefill's first block stops the run before the
    second block, and the node raises the interrupt."""
    import graph_fixtures as gf
    from qi21.nodes.samplers import QI21TurboSampler

    model = gf.load("turbo")["turbo"]
    positive = gf.synthetic_conditioning()
    ran = []

    def block_ran(block, args, out):
        ran.append(block)
        if len(ran) == 1:
            bridge.request_interrupt()

    handles = [block.register_forward_hook(block_ran) for block in model.blocks]
    try:
        with pytest.raises(InterruptedError):
            QI21TurboSampler.execute(model, positive, 1, SIZE, SIZE, 1)
    finally:
        for handle in handles:
            handle.remove()
    assert ran == [model.blocks[0]]
