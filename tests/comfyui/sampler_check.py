"""Run by tests/test_comfy_samplers.py under ComfyUI's interpreter: ComfyUI's own samplers over our model (through
nodes/comfy_sampling.py, with ComfyUI importable, so the bridge mixes in ComfyUI's real CONST) against the same
sampler run over diffusers' transformer as the denoiser, on the same conditioning, noise and seed.

The oracle side is built here from ComfyUI's pieces only: its `ModelSamplingFlux` + `CONST` (the class core makes
for a flux-style model) shifted by the official mu, and a plain model_wrap whose denoiser is diffusers' transformer
(uncached: every call runs the whole sequence). Prints one JSON object: per case the max abs differences and what
our DiT was called with.

Usage: python sampler_check.py COMFYUI_DIR ORACLE_SITE_PACKAGES  (the second: where diffusers is installed)
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


def setup(comfyui: str, oracle_site: str):
    sys.path[:0] = [comfyui, str(TESTS / "comfyui" / "stubs")]
    from comfy.cli_args import args

    args.cpu = True  # before comfy.model_management is imported: no CUDA probing
    import comfy.samplers  # noqa: F401  (imports model_management, k_diffusion)

    sys.path.append(oracle_site)  # diffusers (the oracle), only what ComfyUI's interpreter lacks
    sys.path.insert(0, str(TESTS))
    import conftest  # noqa: F401  (the repository as package qi21)


def scheduler_differences(flow_sampling) -> dict:
    """Max abs difference of every ComfyUI scheduler against model/sampling/flow_schedulers.py, over shifts and
    step counts (`names`: ComfyUI's scheduler names, in its order)."""
    import comfy.samplers

    from qi21.model.sampling.flow_schedulers import scheduler_sigmas

    worst, shapes = 0.0, []
    for mu in (0.0, 0.5, 0.8, 1.3):
        sampling = flow_sampling(mu)
        for name in comfy.samplers.SCHEDULER_NAMES:
            for steps in (2, 3, 7, 8, 25, 40):
                expected = comfy.samplers.calculate_sigmas(sampling, name, steps).float()
                got = scheduler_sigmas(name, steps, mu)
                if expected.shape != got.shape:
                    shapes.append(f"{name} {steps} {mu}")
                    continue
                worst = max(worst, (expected - got).abs().max().item())
    return {"names": list(comfy.samplers.SCHEDULER_NAMES), "worst": worst, "shape_mismatches": shapes}


class Wrap:
    """The model_wrap a SAMPLER calls (CFGGuider's role) over a plain denoiser."""

    def __init__(self, inner, patcher, cfg, denoise):
        self.inner_model, self.model_patcher, self.cfg, self.denoise = inner, patcher, cfg, denoise
        self.model_options = {}

    def __call__(self, x, sigma, model_options=None, seed=None):
        guided, cond, uncond = self.denoise(x, sigma)
        model_options = model_options or {}
        for hook in model_options.get("sampler_post_cfg_function", []):  # the CFG++ samplers read uncond here
            guided = hook({"denoised": guided, "cond_denoised": cond, "uncond_denoised": uncond, "input": x,
                           "sigma": sigma, "cond_scale": self.cfg, "model_options": model_options})
        return guided


def main(comfyui: str, oracle_site: str) -> None:
    setup(comfyui, oracle_site)
    import comfy.model_sampling
    import comfy.samplers
    import torch

    from dit_fixtures import tiny_pair
    from qi21.model.sampling.loop import initial_noise, sample
    from qi21.model.sampling.schedule import base_sigmas, schedule_mu, turbo_sigmas
    from qi21.model.vae.latents import latent_tokens
    from qi21.nodes import bridge
    from qi21.nodes.comfy_sampling import sampler_runner
    from test_sampling import TWO_REFS, conditioning

    assert bridge.HAVE_COMFY, "the pack did not find ComfyUI"
    torch.manual_seed(0)
    reference, ours = tiny_pair()
    width = height = 256
    grid = (height // 16, width // 16)
    tokens = grid[0] * grid[1]
    mu = schedule_mu(latent_tokens(width, height))
    positive = conditioning(**TWO_REFS)
    negative = conditioning(**TWO_REFS, seed=9)
    seed, batch = 21, 2
    noise = initial_noise(seed, batch, height, width)

    calls = []  # the mode of every call of our DiT
    plain_forward = ours.forward

    def spy(*args, **kwargs):
        calls.append(kwargs.get("mode", "uncached"))
        return plain_forward(*args, **kwargs)

    ours.forward = spy

    def flow_sampling(shift):  # the class core builds for a flux-style CONST model
        class ModelSampling(comfy.model_sampling.ModelSamplingFlux, comfy.model_sampling.CONST):
            pass

        sampling = ModelSampling()
        sampling.set_parameters(shift=shift)
        return sampling

    def diffusers_denoiser(cfg, use_negative):
        img_shapes = [[(1, h, w) for h, w in positive.ref_shapes] + [(1, *grid)]] * batch

        def velocity(cond, x, t):
            mask = torch.cat([cond.image_slots, torch.ones(tokens // 4, dtype=torch.bool)])[None].expand(batch, -1)
            packed = x.flatten(2).transpose(1, 2)
            if cond.references is not None:
                packed = torch.cat([cond.references[None].expand(batch, -1, -1), packed], 1)
            states = cond.text[None].expand(batch, -1, -1)
            out = reference(hidden_states=packed, timestep=t, encoder_hidden_states=states, img_mask=mask,
                            img_shapes=img_shapes, return_dict=False)[0]
            return out[:, -tokens:].transpose(1, 2).reshape(x.shape)

        def denoise(x, sigma):
            t = sigma.float().reshape(-1).expand(batch)
            v_pos = v_neg = velocity(positive, x, t)
            if use_negative:
                v_neg = velocity(negative, x, t)
            sig = t.view(-1, 1, 1, 1)
            return x - sig * (v_neg + cfg * (v_pos - v_neg)), x - sig * v_pos, x - sig * v_neg

        return denoise

    def oracle(name, sigmas, shift, cfg, use_negative):
        sampling = flow_sampling(shift)
        inner = SimpleNamespace(model_sampling=sampling)
        patcher = SimpleNamespace(model=inner, get_model_object=lambda key: getattr(inner, key))
        wrap = Wrap(inner, patcher, cfg, diffusers_denoiser(cfg, use_negative))
        extra = {"model_options": {"transformer_options": {}}, "seed": seed}
        latent = torch.zeros_like(noise)
        return comfy.samplers.sampler_object(name).sample(wrap, sigmas, extra, None, noise, latent, None, True)

    def ours_with(name, sigmas, shift, cfg, use_negative, prefix_cache=True):
        calls.clear()
        _, run = sampler_runner(comfy.samplers.sampler_object(name), seed=seed, mu=shift)
        result = sample(ours, positive, sigmas=sigmas, width=width, height=height, noise=noise,
                        negative=negative if use_negative else None, cfg=cfg, prefix_cache=prefix_cache, sampler=run)
        return result.latents.float(), result.report, list(calls)

    results = {}
    with torch.no_grad():
        base = base_sigmas(8, width, height)
        builtin = sample(ours, positive, sigmas=base, width=width, height=height, noise=noise).latents
        got, report, modes = ours_with("euler", base, mu, 1.0, False)
        results["euler_vs_builtin"] = {"diff": (got - builtin).abs().max().item(), "report": report, "modes": modes}
        cases = [("dpmpp_2m", 1.0, False), ("res_multistep", 1.0, False), ("heun", 1.0, False),
                 ("euler_ancestral", 1.0, False), ("er_sde", 1.0, False), ("uni_pc", 1.0, False),
                 ("euler_cfg_pp", 1.0, False), ("dpmpp_2m", 3.0, True)]
        for name, cfg, use_negative in cases:
            expected = oracle(name, base, mu, cfg, use_negative)
            got, report, modes = ours_with(name, base, mu, cfg, use_negative)
            uncached, _, uncached_modes = ours_with(name, base, mu, cfg, use_negative, prefix_cache=False)
            results[f"{name}_cfg{cfg:g}"] = {"diff": (got - expected).abs().max().item(),
                                             "cache_off_diff": (uncached - got).abs().max().item(),
                                             "report": report, "modes": modes, "cache_off_modes": uncached_modes}
        turbo = turbo_sigmas()
        expected = oracle("heun", turbo, 0.0, 1.0, False)
        got, report, modes = ours_with("heun", turbo, 0.0, 1.0, False)
        results["turbo_heun"] = {"diff": (got - expected).abs().max().item(), "report": report, "modes": modes}
        results["schedulers"] = scheduler_differences(flow_sampling)
    print("QI21_RESULT " + json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:3])
