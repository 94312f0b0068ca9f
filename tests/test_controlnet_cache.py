"""The Fun ControlNet's prefix cache beyond one run (tests/test_controlnet.py has the single-run claims): a kept
controlled prefix extended after a new instruction, the plain cache of the steps outside the window shared with the
model's own runs, a host-side cache, and a sampler of ComfyUI's kind calling the model at sigmas on both sides of the
window. Each compares with the same run with the cache off (fp32 tiny models, <= 1e-5)."""

import pytest
import torch

import controlnet_fixtures as cf
from qi21.demo import tiny_checkpoints as tiny
from qi21.model.encoders.conditioning import Conditioning
from qi21.model.encoders.control import control_latents
from qi21.model.features.control import apply_controlnet
from qi21.model.loaders.controlnet import load_controlnet
from qi21.model.prefix_cache.host_moves import HostPrefixKVCache
from qi21.model.prefix_cache.kept_entries import PrefixCacheStore
from qi21.model.sampling.loop import sample
from qi21.model.transformer.controlnet import ControlStream
from qi21.model.vae.autoencoder import QwenImage21VAE

GRID = (4, 6)
WIDTH, HEIGHT = GRID[1] * 16, GRID[0] * 16
SIGMAS = torch.linspace(1.0, 0.0, 9)
TOL = 1e-5
LEAD = 5 + 16  # the rows before the new words: 5 text rows and the 4x4 reference (4 slots of 2x2 latent cells)


@pytest.fixture(scope="module")
def pair():
    return cf.tiny_pair4()


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    return load_controlnet(cf.write(tmp_path_factory.mktemp("patches") / "fun.safetensors", cf.alibaba_state()))


@pytest.fixture(scope="module")
def vae():
    torch.manual_seed(11)
    return QwenImage21VAE(tiny.TINY_VAE).eval()


def conditioning(tail_seed=None):
    """5 text rows, one 4x4 reference, 3 text rows; `tail_seed` redraws the 3 rows after the reference (a new
    instruction after the same references)."""
    g = torch.Generator().manual_seed(3)
    slots = torch.tensor([False] * 5 + [True] * 4 + [False] * 3)
    text = torch.randn(12, 48, generator=g)
    references = torch.randn(16, 64, generator=g)
    if tail_seed is not None:
        text[9:] = torch.randn(3, 48, generator=torch.Generator().manual_seed(tail_seed))
    return Conditioning(text, slots, references, ((4, 4),))


def controlled(model, net, vae, window=(0.0, 1.0)):
    control = torch.rand(1, HEIGHT, WIDTH, 3, generator=torch.Generator().manual_seed(5))
    return apply_controlnet(model, net, lambda grid: control_latents(vae, grid, control_image=control), 1.0, *window)


def run(model, cond, **kwargs):
    with torch.no_grad():
        return sample(model, cond, sigmas=SIGMAS, width=WIDTH, height=HEIGHT, seed=1, **kwargs)


def test_a_new_instruction_after_a_kept_controlled_prefix_computes_only_the_new_rows(pair, net, vae):
    _, model = pair
    patched, store = controlled(model, net, vae), PrefixCacheStore(budget_bytes=None)
    first = run(patched, conditioning(), keep_cache=True, store=store)
    assert first.report["cache"] == "miss"
    edited = run(patched, conditioning(tail_seed=8), keep_cache=True, store=store)
    report = edited.report
    assert report["cache"] == "partial"
    assert (report["prefix_rows_reused"], report["prefix_rows_computed"]) == (LEAD, 3)
    off = run(patched, conditioning(tail_seed=8), prefix_cache=False)
    torch.testing.assert_close(edited.latents, off.latents, rtol=0, atol=TOL)
    assert (edited.latents - first.latents).abs().max() > 1e-3  # the new words changed the image


def test_steps_outside_the_window_read_the_plain_models_kept_prefix(pair, net, vae):
    _, model = pair
    store = PrefixCacheStore(budget_bytes=None)
    run(model, conditioning(), keep_cache=True, store=store)  # a plain run keeps its prefix
    patched = controlled(model, net, vae, window=(0.2, 0.8))
    result = run(patched, conditioning(), keep_cache=True, store=store)
    report = result.report
    prefix = report["prefix_tokens"]
    # the plain cache came whole from the store; the controlled one was computed
    assert report["cache"] == "partial" and report["prefix_rows_computed"] == prefix
    assert report["prefix_rows_reused"] == prefix
    assert set(report["control"]["cache_bytes"]) == {"base", "control", "base_uncontrolled"}
    off = run(patched, conditioning(), prefix_cache=False)
    torch.testing.assert_close(result.latents, off.latents, rtol=0, atol=TOL)
    again = run(patched, conditioning(), keep_cache=True, store=store)
    assert again.report["cache"] == "hit" and again.report["prefix_rows_computed"] == 0
    torch.testing.assert_close(again.latents, off.latents, rtol=0, atol=TOL)


def test_a_host_side_cache_holds_the_control_layers_too(pair, net, vae):
    _, model = pair
    patched = controlled(model, net, vae, window=(0.2, 0.8))
    made = []

    def host_cache():
        made.append(HostPrefixKVCache("cpu"))
        return made[-1]

    on = run(patched, conditioning(), new_cache=host_cache)
    off = run(patched, conditioning(), prefix_cache=False)
    torch.testing.assert_close(on.latents, off.latents, rtol=0, atol=TOL)
    controlled_cache = next(cache for cache in made if cache.read_order)
    layers = model.config.num_layers
    assert controlled_cache.read_order == (0, layers, 1, 2, layers + 1, 3)  # control block k after base block 2k


def heun(denoiser, sigmas, noise, latent, mask):
    """A second-order sampler with ComfyUI's KSAMPLER signature: two model calls a step, the second at the next
    sigma, so calls land on both sides of the control's window inside one step."""
    x = sigmas[0] * noise + (1.0 - sigmas[0]) * latent
    for i in range(sigmas.numel() - 1):
        sigma, following = sigmas[i], sigmas[i + 1]
        slope = (x - denoiser(x, sigma)) / sigma
        guess = x + (following - sigma) * slope
        if following > 0:
            x = x + (following - sigma) * (slope + (guess - denoiser(guess, following)) / following) / 2
        else:
            x = guess
    return x


@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_a_comfy_style_sampler_across_the_window_keeps_the_cache_exact(pair, net, vae, cfg):
    _, model = pair
    patched = controlled(model, net, vae, window=(0.2, 0.8))
    negative = conditioning(tail_seed=4) if cfg > 1 else None
    calls = []  # (mode, controlled) of every DiT call
    hook = patched.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((kwargs["mode"], any(isinstance(h, ControlStream)
                                                                        for h in kwargs["hooks"]))), with_kwargs=True)
    try:
        on = run(patched, conditioning(), sampler=heun, negative=negative, cfg=cfg)
        on_calls, calls[:] = list(calls), []
        off = run(patched, conditioning(), sampler=heun, negative=negative, cfg=cfg, prefix_cache=False)
    finally:
        hook.remove()
    # each phase's cache is filled by its first call and read by every later one; the cache off stays off
    for phase in (False, True):
        modes = [mode for mode, c in on_calls if c == phase]
        assert modes and modes == ["prefill"] + ["cached"] * (len(modes) - 1), (phase, modes)
    assert {mode for mode, _ in calls} == {"uncached"} and len(calls) == 15
    torch.testing.assert_close(on.latents, off.latents, rtol=0, atol=TOL)
    assert on.report["model_calls"] == 15 and on.report["cache"] == "miss"
    assert set(on.report["control"]["cache_bytes"]) == {"base", "control", "base_uncontrolled"}
    plain = run(model, conditioning(), sampler=heun, negative=negative, cfg=cfg)
    assert (plain.latents - on.latents).abs().max() > 1e-3


@pytest.mark.parametrize("cache", ["device", "host"])
def test_streamed_control_blocks_run_bit_identically_to_resident(pair, net, vae, cache):
    from qi21.model.memory.streaming import StreamedRun
    from qi21.model.memory.weights import run_layers

    _, model = pair
    patched = controlled(model, net, vae, window=(0.2, 0.8))
    layers = run_layers(patched)
    assert layers[1] is patched.control_net.blocks[0] and layers[4] is patched.control_net.blocks[1]
    resident = run(patched, conditioning())
    streamed = (1, 2, 4)  # both control blocks and a base block between them
    with StreamedRun(patched, streamed, cache) as streamed_run:
        result = run(patched, conditioning(), new_cache=streamed_run.new_cache)
    assert streamed_run.streamer.copies > 0
    torch.testing.assert_close(result.latents, resident.latents, rtol=0, atol=0)


def test_the_planner_counts_the_control_layers_of_the_cache(pair, net, vae):
    from qi21.model.memory.planner import RunShape, run_estimate

    _, model = pair
    config = model.config
    plain = RunShape((24,), GRID)
    whole = RunShape((24,), GRID, cache_layers=config.num_layers + 2, extra_row_buffers=3)
    window = RunShape((24,), GRID, cache_layers=2 * config.num_layers + 2, extra_row_buffers=3)
    bytes_of = {name: run_estimate(config, shape, 4).cache for name, shape in
                (("plain", plain), ("whole", whole), ("window", window))}
    measured = {}
    for name, window_of in (("whole", (0.0, 1.0)), ("window", (0.2, 0.8))):
        measured[name] = run(controlled(model, net, vae, window=window_of), conditioning()).report["cache_bytes"]
    measured["plain"] = run(model, conditioning()).report["cache_bytes"]
    assert bytes_of == measured  # 1.5x the plain cache, and 2.5x with a partial window (both held)
