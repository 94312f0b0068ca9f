"""Schedules, timesteps and the Euler step against diffusers' FlowMatchEulerDiscreteScheduler (the oracle)."""

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from qi21.model.sampling.schedule import (
    BASE_CONFIG,
    TURBO_SIGMAS,
    BaseScheduleConfig,
    base_sigmas,
    custom_sigmas,
    euler_step,
    schedule_mu,
    transformer_timestep,
    turbo_sigmas,
)
from qi21.model.vae.latents import latent_tokens, sampling_size

# The released scheduler/scheduler_config.json (docs/schedule.md); the flags left out are false by default.
OFFICIAL_BASE = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}
OFFICIAL_TURBO = {**OFFICIAL_BASE, "use_dynamic_shifting": False, "shift_terminal": None}

SIZES = [(512, 512), (1024, 1024), (2048, 2048), (768, 1344), (1664, 928), (1344, 768)]
STEPS = [8, 20, 40, 50]


def reference_scheduler(steps, width, height, config=OFFICIAL_BASE, grid=None):
    """Set up diffusers' scheduler the way QwenImage21Pipeline does (floor to 32 px, calculate_shift, sigmas=)."""
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    w, h = width // 32 * 32, height // 32 * 32
    tokens = (h // 16) * (w // 16)  # latents.shape[1]: the DiT takes 64-channel latents unpatchified
    slope = (config["max_shift"] - config["base_shift"]) / (config["max_image_seq_len"] - config["base_image_seq_len"])
    mu = config["base_shift"] + slope * (tokens - config["base_image_seq_len"])
    grid = np.linspace(1.0, 1 / steps, steps) if grid is None else grid
    scheduler.set_timesteps(sigmas=grid, mu=mu)
    return scheduler


# ---- Base schedule -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("width,height", SIZES)
@pytest.mark.parametrize("steps", STEPS)
def test_base_sigmas_equal_diffusers_bit_for_bit(steps, width, height):
    ours = base_sigmas(steps, width, height)
    ref = reference_scheduler(steps, width, height).sigmas
    assert ours.dtype == torch.float32 and ours.shape == (steps + 1,)
    assert torch.equal(ours, ref)  # stronger than a 1e-6 tolerance


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(BaseScheduleConfig(shift_terminal=None), id="no terminal shift"),
        pytest.param(BaseScheduleConfig(shift_terminal=0.05), id="terminal 0.05"),
        pytest.param(BaseScheduleConfig(base_shift=0.3, max_shift=1.15, max_image_seq_len=4096), id="other shifts"),
    ],
)
def test_other_configs_equal_diffusers_with_the_same_fields(config):
    fields = {k: getattr(config, k) for k in ("base_shift", "max_shift", "max_image_seq_len", "shift_terminal")}
    ref = reference_scheduler(20, 1024, 768, config={**OFFICIAL_BASE, **fields}).sigmas
    assert torch.equal(base_sigmas(20, 1024, 768, config), ref)


@pytest.mark.parametrize("steps", [2, 8, 40, 50])
def test_terminal_lands_on_the_configured_value(steps):
    sig = base_sigmas(steps, 1664, 928)
    assert sig[0].item() == 1.0 and sig[-1].item() == 0.0
    assert sig[-2].item() == pytest.approx(BASE_CONFIG.shift_terminal, abs=1e-7)
    assert torch.all(sig[1:] < sig[:-1])


def test_single_step_is_one_full_step_where_diffusers_gives_nan():
    # linspace(1, 1, 1) = [1]: the stretch divides 0 by 0. diffusers returns NaN (numpy only warns); we skip it.
    with pytest.warns(RuntimeWarning, match="invalid value"):
        ref = reference_scheduler(1, 1024, 1024).sigmas
    assert math.isnan(ref[0].item()) and ref[1].item() == 0.0
    assert base_sigmas(1, 1024, 1024).tolist() == [1.0, 0.0]


def test_worked_numbers_at_1024_and_2048():
    """The worked example of docs/schedule.md (1024x1024, 40 steps) and the same at 2048x2048."""
    sig = base_sigmas(40, 1024, 1024)
    picked = sig[[0, 1, 2, 3, 4, 35, 36, 37, 38, 39, 40]].tolist()
    doc = [1.0, 0.986964, 0.973593, 0.959875, 0.945796, 0.198745, 0.157108, 0.113533, 0.067881, 0.02, 0.0]
    assert picked == pytest.approx(doc, abs=6e-7)
    big = base_sigmas(40, 2048, 2048)
    picked = big[[0, 1, 2, 3, 4, 35, 36, 37, 38, 39, 40]].tolist()
    doc = [1.0, 0.992646, 0.985013, 0.977085, 0.968844, 0.298886, 0.240336, 0.175179, 0.10223, 0.02, 0.0]
    assert picked == pytest.approx(doc, abs=6e-7)


@pytest.mark.parametrize(
    "tokens,mu", [(256, 0.5), (8192, 0.9), (4096, 0.693548387), (16384, 1.312903), (64, 0.490323)]
)
def test_mu_is_linear_in_target_tokens_and_extrapolates(tokens, mu):
    assert schedule_mu(tokens) == pytest.approx(mu, abs=1e-6)


@pytest.mark.parametrize("width,height,floored", [
    pytest.param(1024, 1024, (1024, 1024), id="on the grid"),
    pytest.param(1000, 1030, (992, 1024), id="1000x1030"),
    pytest.param(63, 95, (32, 64), id="63x95"),
])
def test_sizes_are_floored_to_multiples_of_32_before_counting_tokens(width, height, floored):
    assert sampling_size(width, height) == floored
    assert latent_tokens(width, height) == (floored[0] // 16) * (floored[1] // 16)
    assert torch.equal(base_sigmas(8, width, height), base_sigmas(8, *floored))


@pytest.mark.parametrize("steps", [0, -3, 2.5, True, "8"])
def test_base_refuses_a_step_count_that_is_not_a_positive_integer(steps):
    with pytest.raises(ValueError, match="steps must be a whole number >= 1"):
        base_sigmas(steps, 1024, 1024)


@pytest.mark.parametrize("width,height", [(31, 1024), (1024, 0)])
def test_base_refuses_sizes_below_32_px(width, height):
    with pytest.raises(ValueError, match="at least 32 px"):
        base_sigmas(8, width, height)


# ---- Turbo and custom sigmas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("width,height", [(1024, 1024), (768, 1344), (2048, 2048)])
def test_turbo_is_the_stored_grid_at_any_resolution(width, height):
    ref = reference_scheduler(8, width, height, config=OFFICIAL_TURBO, grid=list(TURBO_SIGMAS)).sigmas
    assert torch.equal(turbo_sigmas(), ref)
    assert turbo_sigmas().tolist() == pytest.approx(
        [1.0, 0.978453, 0.954180, 0.926626, 0.895080, 0.845148, 0.704534, 0.414568, 0.0], abs=1e-7
    )


@pytest.mark.parametrize("steps", [1, 4, 12, 40])
def test_turbo_refuses_other_step_counts(steps):
    with pytest.raises(ValueError, match=f"stored 8-sigma grid; steps={steps} was asked for"):
        turbo_sigmas(steps)


@pytest.mark.parametrize(
    "values,expected",
    [
        ([1.0, 0.5, 0.1], [1.0, 0.5, 0.1, 0.0]),
        ([1.0, 0.5, 0.0], [1.0, 0.5, 0.0]),
        ([0.7], [0.7, 0.0]),
        (torch.tensor([0.9, 0.3], dtype=torch.float64), [0.9, 0.3, 0.0]),
    ],
)
def test_custom_sigmas_are_used_as_given_with_a_terminal_zero(values, expected):
    sig = custom_sigmas(values)
    assert sig.dtype == torch.float32
    assert torch.equal(sig, torch.tensor(expected, dtype=torch.float32))


@pytest.mark.parametrize(
    "values,message",
    [
        ([], "empty"),
        ([0.0], "sigma 0 is 0.0; sigmas must lie in \\(0, 1\\]"),
        ([1.0, float("nan")], "sigma 1 is nan; every sigma must be finite"),
        ([float("inf"), 0.5], "sigma 0 is inf; every sigma must be finite"),
        ([1.2, 0.5], "sigma 0 is 1.2; sigmas must lie in \\(0, 1\\]"),
        ([1.0, -0.1], "sigma 1 is -0.1; sigmas must lie"),
        ([1.0, 0.0, 0.5], "sigma 1 is 0.0; sigmas must lie"),
        ([1.0, 0.5, 0.5], "strictly decreasing; sigma 2 = 0.5 follows sigma 1 = 0.5"),
        ([0.5, 0.7], "strictly decreasing; sigma 1 = 0.7 follows sigma 0 = 0.5"),
        ([1.0, 1.0 - 1e-9], "equal in fp32"),
        (["a", 0.5], "must be numbers"),
    ],
)
def test_custom_sigmas_refuse_invalid_values_naming_them(values, message):
    with pytest.raises(ValueError, match=message):
        custom_sigmas(values)


# ---- Transformer timestep and Euler step ---------------------------------------------------------------------


def reference_transformer_timestep(t, dtype, batch=2):
    """The pipeline's `timestep = t.expand(B).to(latents.dtype)`, `timestep / 1000`, then the DiT's `.to(dtype)`."""
    timestep = t.expand(batch).to(dtype)
    return (timestep / 1000).to(dtype)


def scheduler_setup(name, steps, width, height, config, grid=None):
    """A named `reference_scheduler` set-up (keyword arguments) for parametrized tests."""
    return pytest.param(dict(steps=steps, width=width, height=height, config=config, grid=grid), id=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("setup", [
    scheduler_setup("base 40 steps 1024x1024", 40, 1024, 1024, OFFICIAL_BASE),
    scheduler_setup("turbo 768x1344", 8, 768, 1344, OFFICIAL_TURBO, list(TURBO_SIGMAS)),
])
def test_transformer_timestep_equals_the_pipeline_expression(dtype, setup):
    scheduler = reference_scheduler(**setup)
    sig = scheduler.sigmas[:-1]
    for i, t in enumerate(scheduler.timesteps):
        expected = reference_transformer_timestep(t, dtype)
        assert torch.equal(transformer_timestep(sig[i], dtype).expand(2), expected)
        assert torch.equal(transformer_timestep(sig[i].item(), dtype).expand(2), expected)  # float input too
    # A whole vector of sigmas at once (elementwise, so the same values).
    assert torch.equal(transformer_timestep(sig, dtype), (scheduler.timesteps.to(dtype) / 1000).to(dtype))


def test_bf16_timesteps_round_twice():
    """The DiT's bf16 timesteps as docs/schedule.md tabulates them: T rounded to bf16, then T / 1000 again."""
    base = transformer_timestep(base_sigmas(40, 1024, 1024)[:-1], torch.bfloat16).float()
    picked = base[[0, 1, 2, 3, 4, 35, 36, 37, 38, 39]].tolist()
    doc = [1.0, 0.988281, 0.972656, 0.960938, 0.945312, 0.199219, 0.157227, 0.113281, 0.067871, 0.020020]
    assert picked == pytest.approx(doc, abs=1e-6)
    turbo = transformer_timestep(turbo_sigmas()[:-1], torch.bfloat16).float().tolist()
    doc = [1.0, 0.980469, 0.957031, 0.929688, 0.894531, 0.843750, 0.703125, 0.414062]
    assert turbo == pytest.approx(doc, abs=1e-6)
    second = transformer_timestep(base_sigmas(40, 1024, 1024)[1], torch.float32).item()
    assert second == pytest.approx(0.986964, abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("setup", [
    scheduler_setup("base 8 steps 1024x1024", 8, 1024, 1024, OFFICIAL_BASE),
    scheduler_setup("turbo 1024x1024", 8, 1024, 1024, OFFICIAL_TURBO, list(TURBO_SIGMAS)),
])
def test_euler_step_equals_diffusers_step_bit_for_bit(dtype, setup):
    scheduler = reference_scheduler(**setup)
    scheduler.set_begin_index(0)  # as the pipeline does
    sig = scheduler.sigmas
    x_ref = x_ours = torch.randn(2, 256, 64).to(dtype)
    for i, t in enumerate(scheduler.timesteps):
        v = torch.randn(2, 256, 64).to(dtype)
        x_ref = scheduler.step(v, t, x_ref, return_dict=False)[0]
        x_ours = euler_step(x_ours, v, sig[i], sig[i + 1])
        assert x_ours.dtype == dtype
        assert torch.equal(x_ours, x_ref), f"step {i}"
    # Plain floats taken from the fp32 schedule give the same result.
    x, v = torch.randn(3, 64).to(dtype), torch.randn(3, 64).to(dtype)
    assert torch.equal(euler_step(x, v, sig[2].item(), sig[3].item()), euler_step(x, v, sig[2], sig[3]))
