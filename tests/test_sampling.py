"""Whole sampling loops against a loop built from diffusers' transformer and scheduler (same weights, noise
and embeddings), and the prefix cache's lifetime across steps and runs."""


import numpy as np
import pytest
import torch

import graph_fixtures as gf
from oracle import BASE_SCHEDULER, TURBO_SCHEDULER, diffusers_loop
from qi21.model.encoders.conditioning import Conditioning
from qi21.model.prefix_cache.kept_entries import PrefixCacheStore
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.prefix_cache.leading_runs import prefix_runs
from qi21.model.sampling.loop import initial_noise, sample
from qi21.model.sampling.schedule import TURBO_SIGMAS, base_sigmas, turbo_sigmas

WIDTH, HEIGHT = 512, 768  # latent 48 x 32 (w x h)
LATENT = (HEIGHT // 16, WIDTH // 16)
TOL = 1e-4


def conditioning(ref_shapes=(), text_before=(6,), seed=3):
    """A prompt with `text_before[i]` text tokens before reference i and the last entry after them all."""
    generator = torch.Generator().manual_seed(seed)
    slots = []
    for run, shape in zip(text_before, list(ref_shapes) + [None]):
        slots += [False] * run
        if shape:
            slots += [True] * (shape[0] * shape[1] // 4)
    refs = sum(h * w for h, w in ref_shapes)
    return Conditioning(
        text=torch.randn(len(slots), 48, generator=generator),
        image_slots=torch.tensor(slots),
        references=torch.randn(refs, 64, generator=generator) if refs else None,
        ref_shapes=tuple(ref_shapes),
    )


TWO_REFS = dict(ref_shapes=((8, 8), (6, 10)), text_before=(5, 2, 7))


#: The 40-step loops run on a quarter of the canvas (latent 16 x 24): what they add to the 8-step ones is the drift over
#: many steps, which does not need the size (and the dynamic shift is then checked at a second size too).
@pytest.mark.parametrize(("steps", "width", "height"), [(8, WIDTH, HEIGHT), (40, WIDTH // 2, HEIGHT // 2)])
@pytest.mark.parametrize("refs", ["t2i", "two_references"])
def test_base_loop_matches_diffusers(dit_pair, steps, width, height, refs):
    reference, ours = dit_pair
    cond = conditioning(**(TWO_REFS if refs == "two_references" else {}))
    noise = initial_noise(7, 1, height, width)
    grid = np.linspace(1.0, 1 / steps, steps)
    with torch.no_grad():
        expected = diffusers_loop(reference, cond, noise, grid, BASE_SCHEDULER)
        got = sample(ours, cond, sigmas=base_sigmas(steps, width, height), width=width, height=height, noise=noise)
    torch.testing.assert_close(got.latents, expected, rtol=0, atol=TOL)
    assert got.report["cache"] == "miss" and got.report["steps"] == steps


def test_turbo_loop_matches_diffusers(dit_pair):
    reference, ours = dit_pair
    cond = conditioning(**TWO_REFS)
    noise = initial_noise(11, 1, HEIGHT, WIDTH)
    with torch.no_grad():
        expected = diffusers_loop(reference, cond, noise, list(TURBO_SIGMAS), TURBO_SCHEDULER)
        got = sample(ours, cond, sigmas=turbo_sigmas(), width=WIDTH, height=HEIGHT, noise=noise)
    torch.testing.assert_close(got.latents, expected, rtol=0, atol=TOL)


def test_cached_and_uncached_loops_agree(dit_pair):
    _, ours = dit_pair
    cond = conditioning(**TWO_REFS)
    kwargs = dict(sigmas=base_sigmas(12, WIDTH, HEIGHT), width=WIDTH, height=HEIGHT, seed=5)
    with torch.no_grad():
        on, off = sample(ours, cond, **kwargs), sample(ours, cond, prefix_cache=False, **kwargs)
    torch.testing.assert_close(on.latents, off.latents, rtol=0, atol=TOL)
    assert off.report["cache"] == "off" and off.report["cache_bytes"] == 0


def test_teacher_forced_replay_cached_velocity_equals_uncached(dit_pair):
    """Along the reference trajectory, every cached step's velocity equals the uncached one (<= 2e-5)."""
    reference, ours = dit_pair
    cond = conditioning(**TWO_REFS)
    noise = initial_noise(2, 1, HEIGHT, WIDTH)
    trajectory = []
    with torch.no_grad():
        diffusers_loop(reference, cond, noise, np.linspace(1.0, 1 / 10, 10), BASE_SCHEDULER, use_cache=False,
                       record=trajectory)
        sigmas = base_sigmas(10, WIDTH, HEIGHT)
        prefix = [type_prefix(cond)]
        cache = PrefixKVCache()
        for i, x in enumerate(trajectory):
            t = sigmas[i].reshape(1)
            with_cache = ours(x, t, prefix, cache=cache, mode="prefill" if i == 0 else "cached")
            torch.testing.assert_close(with_cache, ours(x, t, prefix), rtol=0, atol=2e-5)


def type_prefix(cond):
    from qi21.model.transformer.dit import PrefixInputs

    return PrefixInputs(layout=cond.layout(LATENT), text=cond.text, references=cond.references)


def test_cfg_batched_equals_diffusers_two_passes(dit_pair):
    reference, ours = dit_pair
    positive = conditioning(**TWO_REFS, seed=3)
    negative = conditioning(ref_shapes=TWO_REFS["ref_shapes"], text_before=(5, 2, 2), seed=4)
    negative = Conditioning(negative.text, negative.image_slots, positive.references, positive.ref_shapes)
    noise = initial_noise(9, 2, HEIGHT, WIDTH)
    with torch.no_grad():
        expected = diffusers_loop(reference, positive, noise, np.linspace(1.0, 1 / 6, 6), BASE_SCHEDULER,
                                  negative=negative, cfg=4.0)
        got = sample(ours, positive, negative=negative, cfg=4.0, sigmas=base_sigmas(6, WIDTH, HEIGHT),
                     width=WIDTH, height=HEIGHT, noise=noise)
    torch.testing.assert_close(got.latents, expected, rtol=0, atol=TOL)
    assert got.report["prefix_tokens"] == positive.layout(LATENT).prefix_len + negative.layout(LATENT).prefix_len


def test_batch_of_three_seeds_equals_three_single_runs(dit_pair):
    _, ours = dit_pair
    cond = conditioning(**TWO_REFS)
    noise = initial_noise(4, 3, HEIGHT, WIDTH)
    kwargs = dict(sigmas=base_sigmas(5, WIDTH, HEIGHT), width=WIDTH, height=HEIGHT)
    with torch.no_grad():
        batch = sample(ours, cond, noise=noise, **kwargs)
        singles = torch.cat([sample(ours, cond, noise=noise[i : i + 1], **kwargs).latents for i in range(3)])
    torch.testing.assert_close(batch.latents, singles, rtol=0, atol=TOL)
    assert batch.report["cache_bytes"] == sample(ours, cond, noise=noise[:1], **kwargs).report["cache_bytes"]


def test_noise_follows_the_cpu_generator_convention():
    noise = initial_noise(123, 2, 100, 70)  # floored to 96 x 64 px
    assert noise.shape == (2, 64, 6, 4) and noise.dtype == torch.float32
    torch.testing.assert_close(noise, torch.randn(2, 64, 6, 4, generator=torch.Generator().manual_seed(123)))


def _count_prefills(model):
    calls = []
    original = PrefixKVCache.allocate

    def counting(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if self.computed:  # a prefill computes rows; a cache made of kept rows only computes none
            calls.append(1)
        return result

    return calls, counting


def test_kept_cache_skips_the_prefill_and_gives_the_same_result(dit_pair, monkeypatch):
    _, ours = dit_pair
    store = PrefixCacheStore(budget_bytes=2**30)
    cond = conditioning(**TWO_REFS)
    calls, counting = _count_prefills(ours)
    monkeypatch.setattr(PrefixKVCache, "allocate", counting)
    kwargs = dict(sigmas=base_sigmas(6, WIDTH, HEIGHT), width=WIDTH, height=HEIGHT, store=store)
    with torch.no_grad():
        first = sample(ours, cond, seed=1, keep_cache=True, **kwargs)
        assert len(calls) == 1 and len(store) == 1 and first.report["cache"] == "miss"
        second = sample(ours, cond, seed=2, keep_cache=True, **kwargs)
        assert len(calls) == 1, "the second run must not prefill"
        assert second.report["cache"] == "hit" and second.report["prefill_seconds"] is None
        fresh = sample(ours, cond, seed=2, **kwargs)
        # another size reuses the prefix too: it never reads the target
        other = sample(ours, cond, seed=2, keep_cache=True, **dict(kwargs, width=256, height=256,
                                                                    sigmas=base_sigmas(6, 256, 256)))
    torch.testing.assert_close(second.latents, fresh.latents, rtol=0, atol=TOL)
    assert other.report["cache"] == "hit" and len(calls) == 2  # `fresh` prefilled (not kept), `other` did not


def test_store_stays_inside_its_budget_and_evicts_least_recently_used(dit_pair):
    _, ours = dit_pair
    one = sample(ours, conditioning(seed=1), sigmas=base_sigmas(2, 256, 256), width=256, height=256).report
    store = PrefixCacheStore(budget_bytes=int(2.5 * one["cache_bytes"]))
    prompts = [conditioning(seed=s) for s in range(1, 5)]
    with torch.no_grad():
        for cond in prompts:
            sample(ours, cond, sigmas=base_sigmas(2, 256, 256), width=256, height=256, keep_cache=True, store=store)
            assert store.nbytes <= store.budget_bytes
    assert len(store) == 2
    kept = {cache.runs[0].digests[-1] for cache in store.caches()}
    assert kept == {runs_of(prompts[2], (16, 16)).digests[-1], runs_of(prompts[3], (16, 16)).digests[-1]}
    store.clear()
    assert len(store) == 0 and store.nbytes == 0


def runs_of(cond, grid=LATENT):
    return prefix_runs(cond.layout(grid), cond.text, cond.references)


class Stop(Exception):
    pass


@pytest.mark.parametrize("keep", [False, True])
def test_interrupt_mid_loop_leaves_no_cache_behind(dit_pair, keep):
    _, ours = dit_pair
    store = PrefixCacheStore()
    seen = []

    def interrupt(info):
        seen.append(info.step)
        assert info.latents.shape == (1, 64, *LATENT) and info.denoised.shape == (1, 64, *LATENT)
        if info.step == 2:
            raise Stop

    with torch.no_grad(), pytest.raises(Stop):
        sample(ours, conditioning(**TWO_REFS), sigmas=base_sigmas(6, WIDTH, HEIGHT), width=WIDTH, height=HEIGHT,
               keep_cache=keep, store=store, callback=interrupt)
    assert seen == [0, 1, 2]
    assert gf.filled_caches() == [] and len(store) == 0


def test_report_has_the_contract_keys(dit_pair):
    _, ours = dit_pair
    with torch.no_grad():
        report = sample(ours, conditioning(**TWO_REFS), sigmas=base_sigmas(3, WIDTH, HEIGHT), width=WIDTH,
                        height=HEIGHT, batch_size=2).report
    assert {"prefix_tokens", "target_tokens", "batch", "steps", "cache", "cache_bytes", "cache_device",
            "prefill_seconds", "step_seconds"} <= report.keys()
    assert report["target_tokens"] == LATENT[0] * LATENT[1] and report["batch"] == 2
    assert report["cache_device"] == "cpu" and report["prefill_seconds"] > 0 and report["step_seconds"] > 0
    assert report["cache_bytes"] == 2 * 3 * 2 * 32 * report["prefix_tokens"] * 4


def test_nan_latents_stop_with_the_step_named(dit_pair, monkeypatch):
    _, ours = dit_pair
    from qi21.model.sampling import euler, loop as sampling

    real_step, calls = euler.euler_step, []

    def poisoned(x, v, sigma, sigma_next):
        calls.append(sigma)
        return real_step(x, v, sigma, sigma_next) * (float("nan") if len(calls) == 3 else 1.0)

    monkeypatch.setattr(euler, "euler_step", poisoned)
    with torch.no_grad(), pytest.raises(sampling.NonFiniteLatentsError, match="step 3 of 6"):
        sample(ours, conditioning(), sigmas=base_sigmas(6, 256, 256), width=256, height=256)
    assert gf.filled_caches() == []


def test_the_builtin_euler_is_a_plain_euler_loop_over_the_dit_bit_for_bit(dit_pair):
    """The built-in sampler (euler.py) through the one model call of loop.py equals a plain Euler loop written out
    here over the DiT's own forward, byte for byte, in bf16 and with an inpainting mask: the loop's plumbing (the
    denoiser, the hooks, the cache's lifetime) adds no arithmetic. Both run in this process, so any CPU's kernels
    give the same bytes to both."""
    from einops import rearrange

    from qi21.model.sampling.img2img import start_latents
    from qi21.model.sampling.schedule import euler_step, transformer_timestep
    from qi21.model.transformer.dit import PrefixInputs, QwenImage21DiT

    _, fp32 = dit_pair
    model = QwenImage21DiT(fp32.config, dtype=torch.bfloat16)
    model.load_state_dict(fp32.state_dict())
    model.eval()
    cond, grid, sigmas = conditioning(), (6, 8), torch.linspace(1.0, 0.0, 7)
    g = torch.Generator().manual_seed(8)
    noise, init = torch.randn(2, 2, 64, *grid, generator=g).unbind(0)
    mask = (torch.rand(2, 1, *grid, generator=g) > 0.5).float()
    with torch.no_grad():
        got = sample(model, cond, sigmas=sigmas, width=grid[1] * 16, height=grid[0] * 16, noise=noise,
                     latent_image=init, noise_mask=mask).latents
        prefixes = [PrefixInputs(layout=cond.layout(grid), text=cond.text)]
        cache = PrefixKVCache()

        def pack(t):
            return rearrange(t, "b c h w -> b (h w) c")

        x = pack(start_latents(noise, init, 1.0, True)).to(torch.bfloat16)
        kept_noise, init_p, mask_p = pack(noise), pack(init), pack(mask)
        for i in range(6):
            v = model(x, transformer_timestep(sigmas[i], torch.bfloat16), prefixes, cache=cache,
                      mode="prefill" if i == 0 else "cached")
            x = euler_step(x, v, sigmas[i], sigmas[i + 1])
            s = sigmas[i + 1].item()
            x = x.float() * mask_p + (s * kept_noise + (1.0 - s) * init_p) * (1.0 - mask_p)
            x = x if i == 5 else x.to(torch.bfloat16)
    assert torch.equal(got, rearrange(x, "b (h w) c -> b c h w", h=grid[0]))
