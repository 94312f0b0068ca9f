"""A block runs itself: one `Block` called alone on its rows, with and without the prefix cache, computes what
the whole model computes for that layer (so per-block hooks, streaming and compilation see the real thing)."""

import pytest
import torch

from dit_fixtures import make_case, tiny_pair
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.transformer.hooks import CONTROL, INTERRUPT, STEP_CACHE, BlockHook, EveryBlock, Finish

TOL = 2e-5
CASES = {
    "one_reference": dict(refs=((4, 4),), target=(4, 6), runs=(5, 7), batch=1, pad=()),
    "two_prompts_padded": dict(refs=((4, 4),), target=(4, 6), runs=(5, 9), batch=2, pad=(0, 4)),
}


@pytest.fixture(scope="module")
def model():
    return tiny_pair()[1]


def capture_layers(model, *args, **kwargs):
    """Run the whole model once; return each block's (x in, kv, drop_prefix, x out) and the velocity."""
    seen, inputs = [], []
    # the block updates its buffer in place (gated residuals), so the input is copied before it runs
    def pre_hook(block, args, kwargs):
        inputs.append(args[0].clone())

    def hook(block, args, kwargs, out):
        seen.append((inputs.pop(), kwargs.get("kv"), kwargs.get("drop_prefix", False), out.clone()))

    handles = [block.register_forward_pre_hook(pre_hook, with_kwargs=True) for block in model.blocks]
    handles += [block.register_forward_hook(hook, with_kwargs=True) for block in model.blocks]
    try:
        with torch.no_grad():
            velocity = model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return seen, velocity


@pytest.mark.parametrize("name", list(CASES))
def test_block_alone_equals_model_layer_uncached(model, name):
    case = CASES[name]
    _, prefixes, x = make_case(case["refs"], case["target"], case["runs"], batch=case["batch"], pad=case["pad"])
    t = torch.full((case["batch"],), 0.7)
    seen, velocity = capture_layers(model, x, t, prefixes)
    with torch.no_grad():
        h, mods, final_scale, rows = model.prepare(x, t, prefixes)
        for index, block in enumerate(model.blocks):
            x_in, _, drop_prefix, x_out = seen[index]
            torch.testing.assert_close(h, x_in, rtol=0, atol=0)
            h = block(h, mods, rows, drop_prefix=index == len(model.blocks) - 1)
            assert drop_prefix == (index == len(model.blocks) - 1)
            torch.testing.assert_close(h, x_out, rtol=0, atol=0)
        torch.testing.assert_close(model.final_layer(h, final_scale, rows), velocity, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_block_alone_with_cache_equals_full_rows(model, name):
    """Each block in a cached step, fed the target rows and its layer of a filled cache, returns the target rows
    of the same block run over the full rows at the same timestep."""
    case = CASES[name]
    _, prefixes, x = make_case(case["refs"], case["target"], case["runs"], batch=case["batch"], pad=case["pad"])
    cache = PrefixKVCache()
    with torch.no_grad():
        model(x, torch.full((case["batch"],), 1.0), prefixes, cache=cache, mode="prefill")  # fills the cache
        t = torch.full((case["batch"],), 0.4)
        x_step = x.flip(1)  # another target than the prefill's
        full, mods, _, rows_full = model.prepare(x_step, t, prefixes)
        cached, mods_cached, _, rows_cached = model.prepare(x_step, t, prefixes, cache=cache, mode="cached")
        torch.testing.assert_close(mods_cached, mods, rtol=0, atol=0)
        t0 = rows_full.target_start
        assert rows_cached.target_start == 0 and cached.shape[0] == full.shape[0] - t0
        for index, block in enumerate(model.blocks):
            last = index == len(model.blocks) - 1
            full = block(full, mods, rows_full, drop_prefix=last)
            cached = block(cached, mods, rows_cached, kv=cache.layer_kv(index), drop_prefix=last)
            torch.testing.assert_close(cached, full if last else full[t0:], rtol=0, atol=TOL)


def test_cached_block_needs_its_layer(model):
    _, prefixes, x = make_case((), (4, 4), (6,))
    cache = PrefixKVCache()
    with torch.no_grad():
        model(x, 1.0, prefixes, cache=cache, mode="prefill")
        h, mods, _, rows = model.prepare(x, 0.5, prefixes, cache=cache, mode="cached")
        with pytest.raises(ValueError, match="needs this layer's prefix cache"):
            model.blocks[0](h, mods, rows)


def test_an_every_block_hook_is_called_between_blocks(model):
    """The hook the sampler uses for interrupt checks inside a step runs once per block, in order, and an
    exception it raises stops the forward there."""
    _, prefixes, x = make_case((), (4, 4), (6,))
    calls = []
    with torch.no_grad():
        model(x, 0.5, prefixes, hooks=[EveryBlock(calls.append)])
    assert calls == list(range(len(model.blocks)))

    class Stop(Exception):
        pass

    def stop_after_first(index):
        if index == 0:
            raise Stop

    ran = []
    handle = model.blocks[1].register_forward_pre_hook(lambda *a: ran.append(1))
    try:
        with pytest.raises(Stop), torch.no_grad():
            model(x, 0.5, prefixes, hooks=[EveryBlock(stop_after_first)])
    finally:
        handle.remove()
    assert ran == []


def test_block_hooks_run_in_their_stated_order_and_a_finish_ends_the_blocks(model):
    """Whatever order the caller lists them in, the forward runs the hooks by `order` (control, interrupt, step
    cache); `start` before block 0, `end` only when every block ran; a `Finish` goes straight to the output layer
    with its rows, asking no later hook."""
    _, prefixes, x = make_case((), (4, 4), (6,))
    seen = []

    class Recording(BlockHook):
        def __init__(self, order, finish_at=None):
            self.order, self.finish_at = order, finish_at

        def start(self, x, mods, rows, cache):
            seen.append(("start", self.order))

        def after_block(self, index, x):
            seen.append((index, self.order))
            return Finish(x[-16:]) if index == self.finish_at else x

        def end(self, x):
            seen.append(("end", self.order))

    with torch.no_grad():
        plain = model(x, 0.5, prefixes)
        same = model(x, 0.5, prefixes, hooks=[Recording(STEP_CACHE), None, Recording(CONTROL), Recording(INTERRUPT)])
    assert torch.equal(same, plain)  # hooks that return x unchanged change nothing
    orders = [CONTROL, INTERRUPT, STEP_CACHE]
    assert seen == [("start", o) for o in orders] + [(i, o) for i in range(3) for o in orders] + [("end", o)
                                                                                                   for o in orders]
    seen.clear()
    ran = []
    handle = model.blocks[1].register_forward_pre_hook(lambda *a: ran.append(1))
    try:
        with torch.no_grad():
            early = model(x, 0.5, prefixes, hooks=[Recording(STEP_CACHE), Recording(INTERRUPT, finish_at=0)])
    finally:
        handle.remove()
    assert ran == [] and seen == [("start", INTERRUPT), ("start", STEP_CACHE), (0, INTERRUPT)]
    with torch.no_grad():
        x0, mods, final_scale, rows = model.prepare(x, 0.5, prefixes)
        expected = model.final_layer(model.blocks[0](x0, mods, rows)[-16:], final_scale, rows)
    assert torch.equal(early, expected)
