"""Partial prefix reuse: a run that starts from a leading run kept from an earlier prompt, or shared with another
prompt of the same run (CFG, a batch of distinct prompts), equals a fresh run and diffusers' pipeline (fp32, tiny
models), and holds the shared rows once."""

import numpy as np
import pytest
import torch

from dit_fixtures import reference_velocity
from oracle import BASE_SCHEDULER, diffusers_loop
from parallel_fixtures import prompt
from qi21.model.encoders.conditioning import Conditioning
from qi21.model.prefix_cache.kept_entries import PrefixCacheStore
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.prefix_cache.leading_runs import prefix_runs
from qi21.model.prefix_cache.lifecycle import share_leading_runs
from qi21.model.sampling.loop import initial_noise, sample
from qi21.model.sampling.schedule import base_sigmas
from qi21.model.transformer.dit import PrefixInputs

WIDTH = HEIGHT = 128  # an 8 x 8 latent target
GRID = (HEIGHT // 16, WIDTH // 16)
STEPS = 4
EXACT = 1e-5  # against our own fresh run and diffusers' (forward and whole loops)
REF_A, REF_B = ((8, 8), 11), ((4, 8), 12)  # (latent shape, seed): the two references of an edit


def edit(instruction=("t", 7, 3), refs=(REF_A, REF_B)):
    """`<|im_start|>user\\n` (3 rows), the references with the rows between them, then the instruction."""
    items = [("t", 3, 1)]
    for i, ref in enumerate(refs):
        items += [ref, ("t", 2, 20 + i)]
    return prompt(*items, instruction)


def rows_through(cond, last_ref):
    """Prefix rows up to and including reference `last_ref`'s block and the text between (edit() layout)."""
    return 3 + sum(h * w + 2 for (h, w), _ in ((REF_A, REF_B)[: last_ref + 1])) - 2


def run(model, cond, store=None, **kwargs):
    kwargs.setdefault("noise", initial_noise(5, 1, HEIGHT, WIDTH))
    with torch.no_grad():
        return sample(model, cond, sigmas=base_sigmas(STEPS, WIDTH, HEIGHT), width=WIDTH, height=HEIGHT,
                      keep_cache=store is not None, store=store, **kwargs)


def oracle(reference, cond, noise, **kwargs):
    with torch.no_grad():
        return diffusers_loop(reference, cond, noise, np.linspace(1.0, 1 / STEPS, STEPS), BASE_SCHEDULER, **kwargs)


def assert_reuse(dit_pair, first, second, reused, cache="partial"):
    """Run `first` kept, then `second`: it reuses `reused` rows and equals a fresh run and diffusers' loop."""
    reference, ours = dit_pair
    store = PrefixCacheStore(budget_bytes=2**30)
    run(ours, first, store)
    got = run(ours, second, store)
    fresh = run(ours, second)
    report, rows = got.report, second.layout(GRID).prefix_len
    assert report["cache"] == cache, report
    assert (report["prefix_rows_reused"], report["prefix_rows_computed"]) == (reused, rows - reused)
    assert fresh.report["cache"] == "miss" and fresh.report["prefix_rows_reused"] == 0
    torch.testing.assert_close(got.latents, fresh.latents, rtol=0, atol=EXACT)
    torch.testing.assert_close(got.latents, oracle(reference, second, initial_noise(5, 1, HEIGHT, WIDTH)), rtol=0,
                               atol=EXACT)
    store.clear()
    return got


def test_new_instruction_after_the_same_references_computes_only_the_instruction(dit_pair):
    got = assert_reuse(dit_pair, edit(("t", 7, 3)), edit(("t", 9, 4)), reused=rows_through(None, 1) + 2)
    assert got.report["prefix_key"] == run(dit_pair[1], edit(("t", 5, 6))).report["prefix_key"]


def test_one_reference_changed_stops_reuse_before_it(dit_pair):
    changed = edit(refs=(REF_A, ((4, 8), 99)))
    assert_reuse(dit_pair, edit(), changed, reused=rows_through(None, 0) + 2)
    assert run(dit_pair[1], changed).report["prefix_key"] != run(dit_pair[1], edit()).report["prefix_key"]


def test_reordered_references_reuse_nothing_past_the_first(dit_pair):
    assert_reuse(dit_pair, edit(), edit(refs=(REF_B, REF_A)), reused=3)  # only `<|im_start|>user\n`


def test_longer_and_shorter_instructions(dit_pair):
    base = edit(("t", 7, 3))
    longer = prompt(*edit_items(), ("t", 7, 3), ("t", 4, 8))  # the same instruction and more words
    assert_reuse(dit_pair, base, longer, reused=base.layout(GRID).prefix_len)
    shorter = prompt(*edit_items(), ("t", 7, 3))
    shorter = Conditioning(shorter.text[:-3], shorter.image_slots[:-3], shorter.references, shorter.ref_shapes)
    assert_reuse(dit_pair, base, shorter, reused=shorter.layout(GRID).prefix_len, cache="hit")


def edit_items():
    return [("t", 3, 1), REF_A, ("t", 2, 20), REF_B, ("t", 2, 21)]


def test_text_to_image_prompts_sharing_a_leading_phrase(dit_pair):
    assert_reuse(dit_pair, prompt(("t", 3, 1), ("t", 6, 2)), prompt(("t", 3, 1), ("t", 4, 5)), reused=3)


def test_cfg_prompts_hold_the_shared_references_once(dit_pair):
    reference, ours = dit_pair
    positive, negative = edit(("t", 7, 3)), edit(("t", 2, 9))
    noise = initial_noise(9, 1, HEIGHT, WIDTH)
    got = run(ours, positive, negative=negative, cfg=4.0, noise=noise)
    off = run(ours, positive, negative=negative, cfg=4.0, noise=noise, prefix_cache=False)
    shared = rows_through(None, 1) + 2
    p_rows, n_rows = positive.layout(GRID).prefix_len, negative.layout(GRID).prefix_len
    per_row = 2 * ours.config.num_layers * ours.config.num_heads * ours.config.head_dim * 4
    report = got.report
    assert report["cache"] == "miss" and report["prefix_rows_reused"] == shared
    assert report["cache_bytes"] == (p_rows + n_rows - shared) * per_row  # before: (p_rows + n_rows) * per_row
    torch.testing.assert_close(got.latents, off.latents, rtol=0, atol=EXACT)
    torch.testing.assert_close(got.latents, oracle(reference, positive, noise, negative=negative, cfg=4.0), rtol=0,
                               atol=EXACT)


def prefixes_of(conds):
    return [PrefixInputs(layout=c.layout(GRID), text=c.text, references=c.references) for c in conds]


def diffusers_velocity(reference, cond, x, t):
    tokens = GRID[0] * GRID[1]
    kwargs = dict(hidden_states=torch.cat([cond.references[None], x], 1), encoder_hidden_states=cond.text[None],
                  img_shapes=[[(1, h, w) for h, w in cond.ref_shapes] + [(1, *GRID)]],
                  img_mask=torch.cat([cond.image_slots, torch.ones(tokens // 4, dtype=torch.bool)])[None])
    return reference_velocity(reference, kwargs, torch.tensor([t]))


def test_batch_of_distinct_prompts_forms_a_tree_and_equals_diffusers(dit_pair):
    """Three prompts: B shares the references with A, C shares B's instruction start too. Velocities of the
    chunked prefill and of a cached step equal separate uncached forwards and diffusers' forward."""
    reference, ours = dit_pair
    conds = [edit(("t", 7, 3)), edit(("t", 5, 4)), prompt(*edit_items(), ("t", 5, 4), ("t", 3, 7))]
    prefixes = prefixes_of(conds)
    runs = [prefix_runs(p.layout, p.text, p.references) for p in prefixes]
    bases = share_leading_runs(runs, [None] * 3)
    assert bases[0] is None and bases[1][:2] == ("group", 0) and bases[2] == ("group", 1, prefixes[1].layout.prefix_len)
    cache = PrefixKVCache()
    cache.plan([p.layout.prefix_len for p in prefixes], bases)
    x = torch.randn(3, GRID[0] * GRID[1], 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for mode, t in (("prefill", 0.9), ("cached", 0.4)):
            got = ours(x, torch.full((3,), t), prefixes, [0, 1, 2], cache=cache, mode=mode)
            for b in range(3):
                alone = ours(x[b : b + 1], t, [prefixes[b]])
                torch.testing.assert_close(got[b : b + 1], alone, rtol=0, atol=EXACT)
                torch.testing.assert_close(got[b : b + 1], diffusers_velocity(reference, conds[b], x[b : b + 1], t),
                                           rtol=0, atol=EXACT)
    rows = [p.layout.prefix_len for p in prefixes]
    shared = rows_through(None, 1) + 2
    assert sum(t.shape[2] for t in cache.kv) == rows[0] + (rows[1] - shared) + (rows[2] - rows[1])
    assert cache.reused_rows == shared + rows[1]


def test_chunked_prefill_velocity_equals_diffusers_forward(dit_pair):
    reference, ours = dit_pair
    first, second = edit(("t", 7, 3)), edit(("t", 9, 4))
    kept = PrefixKVCache()
    x = torch.randn(1, GRID[0] * GRID[1], 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours(x, 0.7, prefixes_of([first]), cache=kept, mode="prefill")
        runs = [prefix_runs(p.layout, p.text, p.references) for p in prefixes_of([first, second])]
        cache = PrefixKVCache()
        cache.plan([second.layout(GRID).prefix_len], [("parts", kept.parts[0], runs[1].common_rows(runs[0]))])
        got = ours(x, 0.7, prefixes_of([second]), cache=cache, mode="prefill")
        assert cache.computed == ((0, rows_through(None, 1) + 2, second.layout(GRID).prefix_len),)
        torch.testing.assert_close(got, diffusers_velocity(reference, second, x, 0.7), rtol=0, atol=EXACT)
        torch.testing.assert_close(got, ours(x, 0.7, prefixes_of([second])), rtol=0, atol=EXACT)


def test_another_lora_or_strength_never_reuses(dit_pair):
    _, ours = dit_pair
    store = PrefixCacheStore(budget_bytes=2**30)
    run(ours, edit(), store)
    with_lora = ours_with_lora(ours, 0.5)
    for model in (with_lora, ours_with_lora(ours, 0.7)):
        got = run(model, edit(("t", 9, 4)), store)
        assert got.report["cache"] == "miss" and got.report["prefix_rows_reused"] == 0
        torch.testing.assert_close(got.latents, run(model, edit(("t", 9, 4))).latents, rtol=0, atol=EXACT)
    assert run(with_lora, edit(("t", 5, 5)), store).report["cache"] == "partial"  # its own entry
    assert run(ours, edit(("t", 5, 5)), store).report["cache"] == "partial"  # the plain model's entry
    store.clear()


def ours_with_lora(model, strength):
    """A LoRA copy (model/loaders/lora.py) over the model's qkv weights, from an in-memory file."""
    import tempfile

    from safetensors.torch import save_file

    from qi21.model.features.lora import apply_lora

    generator = torch.Generator().manual_seed(3)
    width = model.config.width
    tensors = {}
    for i in range(model.config.num_layers):
        for name in ("to_q", "to_k", "to_v"):
            key = f"transformer.transformer_blocks.{i}.attn.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(2, width, generator=generator) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(width, 2, generator=generator) * 0.1
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/lora.safetensors"
        save_file(tensors, path)
        return apply_lora(model, path, strength)


def test_a_shared_tensor_is_counted_once_and_freed_when_nothing_holds_it(dit_pair):
    _, ours = dit_pair
    store = PrefixCacheStore(budget_bytes=2**30)
    first = run(ours, edit(("t", 7, 3)), store)
    second = run(ours, edit(("t", 9, 4)), store)
    assert len(store) == 2  # the first entry offers its own instruction rows, so it stays beside the second
    distinct = {id(t): t.numel() * 4 for cache in store.caches() for t in cache.kv}
    assert store.nbytes == sum(distinct.values()) < first.report["cache_bytes"] + second.report["cache_bytes"]
    shared = store.caches()[0].kv[0]
    store.drop_where(lambda cache: cache is store.caches()[0])
    assert any(shared is t for cache in store.caches() for t in cache.kv)  # the second entry still reads it
    store.clear()
    assert len(store) == 0 and store.nbytes == 0


def test_an_interrupted_partial_run_drops_what_it_read_and_leaves_nothing_behind(dit_pair):
    import graph_fixtures as gf

    _, ours = dit_pair
    store = PrefixCacheStore(budget_bytes=2**30)
    run(ours, edit(("t", 7, 3)), store)

    class Stop(Exception):
        pass

    def interrupt(info):
        raise Stop

    with pytest.raises(Stop):
        run(ours, edit(("t", 9, 4)), store, callback=interrupt)
    assert len(store) == 0 and gf.filled_caches() == []  # the kept entry it read is dropped, not put back
    again = run(ours, edit(("t", 9, 4)), store)
    assert again.report["cache"] == "miss"
    torch.testing.assert_close(again.latents, run(ours, edit(("t", 9, 4))).latents, rtol=0, atol=EXACT)
    store.clear()
