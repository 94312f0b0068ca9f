"""The prefix KV cache: prefill + cached steps equal the uncached forward, and the cache owns exactly its
payload, once per distinct prompt.
"""

import gc
import weakref

import pytest
import torch

from dit_fixtures import Case, make_case, tiny_pair
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.transformer.attention import FLEX_AVAILABLE
from qi21.model.transformer.dit import PrefixInputs

TOL = 2e-5
BACKENDS = ["sdpa"] + (["flex"] if FLEX_AVAILABLE else [])
CASES = [
    pytest.param(Case(refs=(), target=(4, 6), runs=(9,)), id="t2i"),
    pytest.param(Case(refs=((4, 4), (2, 6)), target=(6, 4), runs=(5, 0, 6)), id="two_references_adjacent"),
    pytest.param(Case(refs=((4, 4),), target=(4, 6), runs=(5, 9), batch=2, pad=(0, 4)), id="batch2_right_padded"),
]


@pytest.fixture(scope="module")
def model(dit_pair):
    return dit_pair[1]


def run_cached(model, prefixes, latents, steps, backend):
    """Prefill at the first timestep, then cached steps; returns each step's velocity."""
    cache, outputs = PrefixKVCache(), []
    with torch.no_grad():
        for i, (t, x) in enumerate(zip(steps, latents)):
            mode = "prefill" if i == 0 else "cached"
            outputs.append(model(x, t, prefixes, cache=cache, mode=mode, attention=backend))
    return outputs, cache


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_cached_steps_equal_uncached_forward(model, case, backend):
    _, prefixes, first = case.make()
    generator = torch.Generator().manual_seed(5)
    latents = [first] + [torch.randn(first.shape, generator=generator) for _ in range(3)]
    steps = [torch.full((case.batch,), t) for t in (1.0, 0.83, 0.41, 0.02)]  # prefill and steps at different t
    cached, _ = run_cached(model, prefixes, latents, steps, backend)
    with torch.no_grad():
        for x, t, got in zip(latents, steps, cached):
            torch.testing.assert_close(got, model(x, t, prefixes, attention="sdpa"), rtol=0, atol=TOL)


@pytest.mark.skipif(not FLEX_AVAILABLE, reason="torch without flex_attention")
def test_flex_prefill_equals_segmentwise_sdpa(model):
    _, prefixes, x = make_case(((4, 4), (2, 6), (6, 2)), (4, 4), (4, 0, 2, 5))
    with torch.no_grad():
        torch.testing.assert_close(model(x, 0.6, prefixes, attention="flex"), model(x, 0.6, prefixes, attention="sdpa"),
                                   rtol=0, atol=TOL)


def test_cache_bytes_follow_the_formula_and_storage_is_exactly_the_payload(model):
    _, prefixes, x = make_case(((4, 4),), (4, 6), (5, 7))
    _, cache = run_cached(model, prefixes, [x], [torch.tensor([1.0])], "sdpa")
    config, prefix_tokens = model.config, prefixes[0].layout.prefix_len
    assert prefix_tokens == 5 + 16 + 7
    expected = 2 * config.num_layers * config.num_heads * config.head_dim * prefix_tokens * 4
    assert cache.nbytes == expected
    assert sum(t.untyped_storage().nbytes() for t in cache.kv) == expected  # no view pinning a larger buffer


def test_batch_of_four_identical_prompts_holds_one_copy(model):
    _, prefixes, x = make_case(((4, 4),), (4, 6), (5, 7))
    single = run_cached(model, prefixes, [x], [torch.tensor([1.0])], "sdpa")[1].nbytes
    batch = x.expand(4, -1, -1).clone()
    _, cache = run_cached(model, prefixes, [batch], [torch.ones(4)], "sdpa")
    assert len(cache.kv) == 1 and cache.nbytes == single


def test_cfg_prompts_get_one_copy_each_and_equal_two_separate_passes(model):
    _, (positive,), x = make_case(((4, 4),), (4, 6), (5, 7), seed=1)
    _, (negative,), _ = make_case(((4, 4),), (4, 6), (5, 2), seed=2)
    negative = PrefixInputs(layout=negative.layout, text=negative.text, references=positive.references)
    both = torch.cat([x, x])
    with torch.no_grad():
        together = model(both, 0.5, [positive, negative], sample_prefix=[0, 1])
        apart = torch.cat([model(x, 0.5, [positive]), model(x, 0.5, [negative])])
    torch.testing.assert_close(together, apart, rtol=0, atol=TOL)
    _, cache = run_cached(model, [positive, negative], [both], [torch.ones(2)], "sdpa")
    assert cache.prefix_lens == (positive.layout.prefix_len, negative.layout.prefix_len)


def test_free_releases_the_payload(model):
    _, prefixes, x = make_case(((4, 4),), (4, 6), (5, 7))
    _, cache = run_cached(model, prefixes, [x], [torch.tensor([1.0])], "sdpa")
    alive = [weakref.ref(t) for t in cache.kv]
    cache.free()
    gc.collect()
    assert cache.nbytes == 0 and not cache.filled
    assert all(ref() is None for ref in alive)


def test_cached_step_runs_only_target_rows(model):
    """Counted, not timed: the first block's output projection sees P + T rows at prefill, T rows after; the
    last block's never sees prefix rows (they are needed there only as keys and values)."""
    _, prefixes, x = make_case(((4, 4),), (4, 6), (5, 7))
    rows = {"first_out": [], "last_out": []}
    hooks = [model.blocks[0].to_out.register_forward_hook(lambda m, i, o: rows["first_out"].append(i[0].shape[0])),
             model.blocks[-1].to_out.register_forward_hook(lambda m, i, o: rows["last_out"].append(i[0].shape[0]))]
    try:
        run_cached(model, prefixes, [x, x], [torch.tensor([1.0]), torch.tensor([0.5])], "sdpa")
    finally:
        for hook in hooks:
            hook.remove()
    prefix, target = prefixes[0].layout.prefix_len, prefixes[0].layout.target_len
    assert rows["first_out"] == [prefix + target, target]
    assert rows["last_out"] == [target, target]


def test_cache_refuses_models_without_causal_condition():
    model = tiny_pair(causal_condition=False)[1]
    _, prefixes, x = make_case((), (4, 6), (9,))
    with pytest.raises(ValueError, match="causal_condition=True"):
        model(x, 1.0, prefixes, cache=PrefixKVCache(), mode="prefill")


def test_cached_step_refuses_an_empty_or_foreign_cache(model):
    _, prefixes, x = make_case(((4, 4),), (4, 6), (5, 7))
    with pytest.raises(RuntimeError, match="prefill"):
        model(x, 0.5, prefixes, cache=PrefixKVCache(), mode="cached")
    _, cache = run_cached(model, prefixes, [x], [torch.tensor([1.0])], "sdpa")
    _, other, _ = make_case(((4, 4),), (4, 6), (5, 3))
    with pytest.raises(ValueError, match="another prompt"):
        model(x, 0.5, other, cache=cache, mode="cached")
