"""The samplers' `sampler` input without ComfyUI: the flow denoiser (noise scaling, sigma -> timestep, CFG rows,
cache modes per call), the stand-in Euler SAMPLER through the nodes, refusals by name, and QI21Sigmas' ComfyUI
scheduler names against values worked out by hand. tests/test_comfy_samplers.py checks the same against a real
ComfyUI."""

import math

import pytest
import torch

import graph_fixtures as gf
from qi21.model.sampling.denoiser import FlowDenoiser, FlowModelSampling
from qi21.model.sampling.flow_schedulers import (
    COMFY_SCHEDULERS,
    beta_quantile,
    regularized_beta,
    scheduler_sigmas,
)
from qi21.model.sampling.schedule import base_sigmas, schedule_mu
from qi21.nodes import bridge
from qi21.nodes.comfy_sampling import check_sampler
from qi21.nodes.samplers import QI21Sampler, QI21TurboSampler
from qi21.nodes.schedule import QI21Sigmas

GRID = (2, 3)


# ---- the denoiser ------------------------------------------------------------------------------------------
class RecordingForward:
    """A stand-in DiT call: records (rows, t, mode, sigma); the velocity of row r is `r + 1` times the input."""

    def __init__(self):
        self.calls = []

    def __call__(self, packed, t, mode, sigma):
        self.calls.append((packed.clone(), t.clone(), mode, sigma))
        rows = packed.repeat(t.shape[0] // packed.shape[0], 1, 1)  # CFG: the DiT call doubles the rows
        return rows * torch.arange(1, rows.shape[0] + 1, dtype=packed.dtype).view(-1, 1, 1)


def test_model_sampling_is_the_const_flow_scaling():
    sampling = FlowModelSampling(0.8)
    noise, latent = torch.randn(2, 64, *GRID), torch.randn(2, 64, *GRID)
    sigma = torch.tensor([0.3, 0.7])
    scaled = sampling.noise_scaling(sigma, noise, latent)
    torch.testing.assert_close(scaled[1], 0.7 * noise[1] + 0.3 * latent[1])
    torch.testing.assert_close(sampling.inverse_noise_scaling(torch.tensor(0.25), latent), latent / 0.75)
    v = torch.randn_like(noise)
    torch.testing.assert_close(sampling.calculate_denoised(sigma, v, scaled), scaled - sigma.view(-1, 1, 1, 1) * v)
    assert sampling.timestep(0.4) == 0.4  # flux-style: timestep = sigma
    e = math.exp(0.8)
    assert sampling.percent_to_sigma(0.25) == pytest.approx(e / (e + 1 / 0.75 - 1), abs=1e-7)
    assert sampling.percent_to_sigma(0.0) == 1.0 and sampling.percent_to_sigma(1.0) == 0.0
    assert float(sampling.sigma_max) == 1.0 and float(sampling.sigma_min) == pytest.approx(e / (e + 9999), rel=1e-5)
    identity = FlowModelSampling(0.0)
    assert torch.allclose(identity.sigmas, torch.arange(1, 10001) / 10000, atol=1e-7)


def test_denoiser_gives_x_minus_sigma_v_with_the_reference_timestep():
    forward = RecordingForward()
    denoiser = FlowDenoiser(forward, dtype=torch.float32, device=torch.device("cpu"), use_cfg=False, cfg=1.0,
                            mode_of=lambda sigma: "prefill" if sigma > 0.5 else "cached", grid=GRID)
    x = torch.randn(2, 64, *GRID)
    got = denoiser(x, torch.tensor([0.6, 0.6]))
    packed, t, mode, _ = forward.calls[0]
    assert mode == "prefill" and packed.shape == (2, 6, 64)
    torch.testing.assert_close(packed[0, 4], x[0, :, 1, 1])  # row-major tokens: (1, 1) is token 1 * 3 + 1
    torch.testing.assert_close(t, torch.tensor([0.6, 0.6]))
    velocity = x * torch.tensor([1.0, 2.0]).view(-1, 1, 1, 1)
    torch.testing.assert_close(got, x - 0.6 * velocity)
    denoiser(x, 0.3)  # a float sigma, off any schedule
    # each call runs in the mode the loop's `mode_of` gives for its sigma, and the forward gets that sigma
    assert [(c[2], c[3]) for c in forward.calls] == [("prefill", pytest.approx(0.6)), ("cached", pytest.approx(0.3))]
    assert denoiser.modes == ["prefill", "cached"]


def test_bf16_timestep_is_rounded_as_the_reference_pipeline_does():
    forward = RecordingForward()
    denoiser = FlowDenoiser(forward, dtype=torch.bfloat16, device=torch.device("cpu"), use_cfg=False, cfg=1.0,
                            mode_of=lambda sigma: "uncached", grid=GRID)
    denoiser(torch.randn(1, 64, *GRID), torch.tensor(0.986964))
    denoiser(torch.randn(1, 64, *GRID), torch.tensor(0.5))
    t = forward.calls[0][1]
    assert t.dtype == torch.bfloat16 and t.item() == pytest.approx(0.988281, abs=1e-6)  # T 988 -> 988 / 1000
    assert [c[2] for c in forward.calls] == ["uncached", "uncached"]  # as mode_of says (the loop's: cache off)


def test_cfg_rows_run_in_one_forward_and_are_combined():
    forward = RecordingForward()
    denoiser = FlowDenoiser(forward, dtype=torch.float32, device=torch.device("cpu"), use_cfg=True, cfg=4.0,
                            mode_of=lambda sigma: "prefill", grid=GRID)
    x = torch.randn(1, 64, *GRID)
    guided, cond, uncond = denoiser.parts(x, torch.tensor([0.5]))
    assert len(forward.calls) == 1
    packed, t, _, _ = forward.calls[0]
    assert packed.shape[0] == 1 and t.shape == (2,)  # the DiT doubles the rows (loop.py); t per row
    v_pos, v_neg = x * 1.0, x * 2.0  # rows 1 and 2 of the recording forward
    torch.testing.assert_close(cond, x - 0.5 * v_pos)
    torch.testing.assert_close(uncond, x - 0.5 * v_neg)
    torch.testing.assert_close(guided, x - 0.5 * (v_neg + 4.0 * (v_pos - v_neg)))


def test_bad_sampler_calls_are_refused_clearly():
    denoiser = FlowDenoiser(RecordingForward(), dtype=torch.float32, device=torch.device("cpu"), use_cfg=False,
                            cfg=1.0, mode_of=lambda sigma: "prefill", grid=GRID)
    with pytest.raises(ValueError, match="shape"):
        denoiser(torch.randn(1, 64, 3, 3), 0.5)
    with pytest.raises(ValueError, match="3 sigmas for a batch of 2"):
        denoiser(torch.randn(2, 64, *GRID), torch.tensor([0.1, 0.2, 0.3]))


def test_samplers_that_cannot_run_a_flow_latent_are_refused_by_name():
    def sample_ddpm():
        pass

    class Ddpm:
        sampler_function = staticmethod(sample_ddpm)

        def sample(self, *args):
            raise AssertionError("never run")

    with pytest.raises(ValueError, match="sampler ddpm cannot run"):
        check_sampler(Ddpm())
    with pytest.raises(ValueError, match="not a SAMPLER"):
        check_sampler("euler")
    assert check_sampler(bridge.sampler_object("euler")) == "euler"


# ---- through the nodes (stand-in Euler SAMPLER) --------------------------------------------------------------
@pytest.fixture(scope="module")
def models(models_root):
    return gf.load("model", "turbo", dtype="fp32")


@pytest.mark.parametrize("node", ["base", "turbo"])
def test_standin_euler_sampler_equals_the_builtin_loop(models, node):
    cond = gf.synthetic_conditioning(seed=4)
    if node == "base":
        args = dict(model=models["model"], positive=cond, seed=3, steps=3, cfg=2.0, width=128, height=96,
                    batch_size=2, negative=gf.synthetic_conditioning(seed=5))
        run = QI21Sampler.execute
    else:
        args = dict(model=models["turbo"], positive=cond, seed=3, width=128, height=128, batch_size=1,
                    sigmas=torch.tensor([1.0, 0.9, 0.6, 0.0]))
        run = QI21TurboSampler.execute
    plain = run(**args)
    with_sampler = run(**args, sampler=bridge.sampler_object("euler"))
    torch.testing.assert_close(with_sampler[0]["samples"], plain[0]["samples"], rtol=0, atol=1e-5)
    report = with_sampler.ui["qi21_report"][0]
    assert report["sampler"] == "euler" and report["model_calls"] == report["steps"]
    assert report["cache"] == "miss" and "sampler" not in plain.ui["qi21_report"][0]


def test_standin_sampler_keeps_the_masked_region_as_the_builtin_loop(models):
    cond = gf.synthetic_conditioning(seed=4)
    latent = torch.randn(1, 64, 8, 8)
    mask = torch.zeros(1, 128, 128)
    mask[:, :, 64:] = 1.0
    args = dict(model=models["model"], positive=cond, seed=8, steps=3, cfg=1.0, width=0, height=0, batch_size=1,
                latent_image={"samples": latent, "noise_mask": mask}, denoise=0.6)
    plain = QI21Sampler.execute(**args)[0]["samples"]
    got = QI21Sampler.execute(**args, sampler=bridge.sampler_object("euler"))[0]["samples"]
    torch.testing.assert_close(got, plain, rtol=0, atol=1e-5)
    assert torch.equal(got[..., :4], plain[..., :4])  # the kept region: the input latent, as the built-in loop keeps it
    torch.testing.assert_close(got[..., :4], latent[..., :4], rtol=0, atol=2e-6)  # latent format round trip


# ---- ComfyUI's scheduler names ------------------------------------------------------------------------------
@pytest.mark.parametrize("name,expected", [
    ("simple", [1.0, 0.5, 0.0]),  # table rows 10000 and 5000 of t / 10000
    ("sgm_uniform", [1.0, 0.50005, 0.0]),  # linspace(1, 1e-4, 3) without its end
    ("normal", [1.0, 1e-4, 0.0]),
    ("karras", [1.0, ((1 + 1e-4 ** (1 / 7)) / 2) ** 7, 1e-4, 0.0]),
    ("exponential", [1.0, 1e-2, 1e-4, 0.0]),
    ("ddim_uniform", [0.5002, 0.0002, 0.0]),  # rows 5001 and 1 (every 5000th from row 1), reversed
    ("beta", [1.0, 0.5001, 0.0]),  # Beta(0.6, 0.6) quantiles 1 and 1/2 -> rows 9999 and 5000 (ties to even)
    ("linear_quadratic", [1.0, 0.975, 0.0]),  # 1 - [0, threshold 0.025, 1]
    ("kl_optimal", [1.0, 1e-4, 0.0]),
])
def test_scheduler_names_by_hand_without_shift(name, expected):
    steps = len(expected) - 1
    got = scheduler_sigmas(name, steps, mu=0.0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor(expected), rtol=0, atol=2e-6)


def test_schedulers_follow_the_shift():
    mu, e = 0.9, math.exp(0.9)
    shifted = scheduler_sigmas("simple", 2, mu)
    assert shifted[1].item() == pytest.approx(e / (e + 1 / 0.5 - 1), abs=1e-6)
    sgm = scheduler_sigmas("sgm_uniform", 2, mu)
    low = e / (e + 9999)
    mid = (1 + low) / 2  # sgm_uniform shifts a grid that already ends at a shifted sigma: shifted twice
    assert sgm[1].item() == pytest.approx(e / (e + 1 / mid - 1), abs=1e-6)
    assert scheduler_sigmas("exponential", 2, mu)[1].item() == pytest.approx(low, rel=1e-5)
    for name in COMFY_SCHEDULERS:
        sig = scheduler_sigmas(name, 9, mu)
        assert sig[-1] == 0 and bool((sig[1:] < sig[:-1]).all()), name
    with pytest.raises(ValueError, match="not one of ComfyUI's"):
        scheduler_sigmas("official", 4, mu)


def test_beta_quantile_inverts_the_incomplete_beta():
    assert beta_quantile(0.3, 1.0, 1.0) == pytest.approx(0.3, abs=1e-14)  # uniform
    assert beta_quantile(0.49, 2.0, 1.0) == pytest.approx(0.7, abs=1e-14)  # I_x(2, 1) = x^2
    for p in (0.01, 0.2, 0.5, 0.77, 0.99):
        assert regularized_beta(beta_quantile(p, 0.6, 0.6), 0.6, 0.6) == pytest.approx(p, abs=1e-13)


def test_the_sigmas_nodes_scheduler_input_gives_each_schedulers_sigmas():
    official = QI21Sigmas.execute("base", 20, 1024, 768)[0]
    assert torch.equal(official, base_sigmas(20, 1024, 768))
    assert torch.equal(QI21Sigmas.execute("base", 20, 1024, 768, scheduler="official")[0], official)
    karras = QI21Sigmas.execute("base", 20, 1024, 768, scheduler="karras")[0]
    assert torch.equal(karras, scheduler_sigmas("karras", 20, schedule_mu(64 * 48)))
    tail = QI21Sigmas.execute("base", 10, 1024, 768, denoise=0.5, scheduler="beta")[0]
    assert torch.equal(tail, scheduler_sigmas("beta", 20, schedule_mu(64 * 48))[-11:])
    turbo = QI21Sigmas.execute("turbo", 20, 0, 0, scheduler="karras")[0]
    assert turbo.numel() == 9 and turbo[0] == 1.0  # Turbo keeps its stored grid
    assert "scheduler" in QI21Sigmas.validate_inputs(schedule="base", steps=20, width=0, height=0,
                                                     scheduler="nope")
