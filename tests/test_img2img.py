"""The sampling vocabulary of ComfyUI: SIGMAS in and out, img2img with denoise, inpainting with a noise mask, split
schedules, VAE encode. Oracles: diffusers' transformer and scheduler (loops written out below, the semantics of
ComfyUI's samplers) and diffusers' VAE."""

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

import graph_fixtures as gf
from dit_fixtures import tiny_pair
from oracle import TURBO_SCHEDULER, diffusers_loop
from qi21.model.encoders.conditioning import Conditioning
from qi21.model.sampling.img2img import latent_mask
from qi21.model.sampling.loop import initial_noise, sample
from qi21.model.sampling.schedule import base_sigmas, literal_sigmas, turbo_sigmas
from qi21.nodes.encode import QI21VAEEncode
from qi21.nodes.samplers import QI21Sampler, QI21TurboSampler
from qi21.nodes.schedule import QI21Sigmas

WIDTH, HEIGHT = 256, 192
GRID = (HEIGHT // 16, WIDTH // 16)
TOL = 1e-5


@pytest.fixture(scope="module")
def models():
    return tiny_pair()


def prompt(seed=3):
    generator = torch.Generator().manual_seed(seed)
    return Conditioning(text=torch.randn(9, 48, generator=generator), image_slots=torch.zeros(9, dtype=torch.bool))


def diffusers_img2img(transformer, cond, noise, latent, sigmas, mask=None, add_noise=True):
    """ComfyUI's img2img / inpainting semantics on diffusers' transformer and scheduler: start at the latent noised
    to sigmas[0] (`scale_noise`), after each step reset the kept region (mask 0) to the latent noised to the next
    sigma, return `x / (1 - sigma_end)` when the schedule stops above 0."""
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(TURBO_SCHEDULER)  # no shift: sigmas used as given
    grid = sigmas[:-1].double().numpy()
    scheduler.set_timesteps(sigmas=grid)
    scheduler.sigmas[-1] = sigmas[-1]  # a schedule that ends above 0 stops there
    pack = lambda t: t.flatten(2).transpose(1, 2)  # noqa: E731
    start_noise = noise if add_noise else torch.zeros_like(noise)
    x = pack(start_noise * sigmas[0] + (1 - sigmas[0]) * latent)
    packed_latent, packed_noise = pack(latent), pack(start_noise)
    packed_mask = None if mask is None else pack(mask)
    batch, tokens = x.shape[:2]
    slots = torch.cat([cond.image_slots, torch.ones(tokens // 4, dtype=torch.bool)])[None].expand(batch, -1)
    kwargs = dict(encoder_hidden_states=cond.text[None].expand(batch, -1, -1), img_mask=slots,
                  img_shapes=[[(1, *GRID)]] * batch)
    for i, t in enumerate(scheduler.timesteps):
        v = transformer(hidden_states=x, timestep=t.expand(batch) / 1000, return_dict=False, **kwargs)[0][:, -tokens:]
        x = scheduler.step(v, t, x, return_dict=False)[0]
        if packed_mask is not None:
            kept = sigmas[i + 1] * packed_noise + (1 - sigmas[i + 1]) * packed_latent
            x = x * packed_mask + kept * (1 - packed_mask)
    x = x.transpose(1, 2).reshape(batch, 64, *GRID)
    return x if sigmas[-1] == 0 else x / (1 - sigmas[-1])


# -- schedules ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps, width, height", [(40, 0, 0), (12, 512, 768), (1, 1024, 1024)])
def test_sigmas_node_is_the_builtin_schedule(steps, width, height):
    got = QI21Sigmas.execute("base", steps, width, height)[0]
    assert torch.equal(got, base_sigmas(steps, width or 1024, height or 1024))
    assert torch.equal(QI21Sigmas.execute("turbo", steps, width, height)[0], turbo_sigmas())


def test_sigmas_node_denoise_is_the_tail_of_a_longer_schedule():
    got = QI21Sigmas.execute("base", 10, 512, 512, denoise=0.5)[0]
    assert torch.equal(got, base_sigmas(20, 512, 512)[-11:])
    assert torch.equal(QI21Sigmas.execute("turbo", 40, 0, 0, denoise=0.5)[0], turbo_sigmas()[-5:])


def test_custom_sigmas_equal_diffusers_with_sigmas_and_no_shift(models):
    reference, ours = models
    values = torch.tensor([1.0, 0.9, 0.7, 0.45, 0.2, 0.0])
    cond, noise = prompt(), initial_noise(11, 1, HEIGHT, WIDTH)
    with torch.no_grad():
        expected = diffusers_loop(reference, cond, noise, values[:-1].numpy(), TURBO_SCHEDULER)
        got = sample(ours, cond, sigmas=values, width=WIDTH, height=HEIGHT, noise=noise).latents
    torch.testing.assert_close(got, expected, rtol=0, atol=TOL)


@pytest.mark.parametrize("values, message", [
    pytest.param([1.0, 0.5, 0.7, 0.0], "strictly decreasing", id="not_descending"),
    pytest.param([1.0, float("nan"), 0.0], "NaN", id="nan"),
    pytest.param([1.0], "at least two", id="one_value"),
    pytest.param([1.5, 0.5, 0.0], r"\[0, 1\]", id="above_one"),
])
def test_bad_sigmas_are_refused(values, message):
    with pytest.raises(ValueError, match=message):
        literal_sigmas(torch.tensor(values))


# -- img2img and inpainting against the oracle --------------------------------------------------------------------
@pytest.mark.parametrize("masked", [False, True], ids=["img2img", "inpaint"])
def test_img2img_and_inpainting_equal_the_oracle(models, masked):
    reference, ours = models
    cond, noise = prompt(), initial_noise(5, 2, HEIGHT, WIDTH)
    latent = torch.randn(2, 64, *GRID, generator=torch.Generator().manual_seed(8))
    sigmas = base_sigmas(12, WIDTH, HEIGHT)[-7:]  # denoise 0.5 of a 6-step run
    mask = None
    if masked:
        pixel_mask = torch.zeros(1, HEIGHT, WIDTH)
        pixel_mask[:, 40:150, 60:200] = 1.0
        mask = latent_mask(pixel_mask, GRID, 2)
    with torch.no_grad():
        expected = diffusers_img2img(reference, cond, noise, latent, sigmas, mask)
        got = sample(ours, cond, sigmas=sigmas, width=WIDTH, height=HEIGHT, noise=noise, latent_image=latent,
                     noise_mask=mask).latents
    torch.testing.assert_close(got, expected, rtol=0, atol=TOL)
    if masked:
        kept = (mask == 0).expand_as(latent)
        assert torch.equal(got[kept], latent[kept])  # the masked-out region is the input latent, exactly


def test_all_zero_mask_returns_the_input_latent(models):
    _, ours = models
    latent = torch.randn(1, 64, *GRID)
    with torch.no_grad():
        got = sample(ours, prompt(), sigmas=turbo_sigmas(), width=WIDTH, height=HEIGHT, seed=1, latent_image=latent,
                     noise_mask=torch.zeros(1, 1, *GRID)).latents
    assert torch.equal(got, latent)


def test_mask_is_resized_bilinearly_and_batch_broadcast():
    mask = torch.zeros(1, 64, 64)
    mask[:, :, 32:] = 1.0
    got = latent_mask(mask, (4, 4), 3)
    assert got.shape == (3, 1, 4, 4)
    assert torch.equal(got[0, 0, 0], torch.tensor([0.0, 0.0, 1.0, 1.0])) and torch.equal(got[0], got[2])
    two = torch.stack([mask[0], 1 - mask[0]])
    assert torch.equal(latent_mask(two, (4, 4), 3)[2], latent_mask(two, (4, 4), 3)[0])  # [a, b] -> [a, b, a]


# -- through the nodes ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def graph(models_root):
    return gf.load("model", "turbo", "vae")


def base_run(graph, **extra):
    args = dict(model=graph["model"], positive=gf.synthetic_conditioning(), seed=4, steps=6, cfg=1.0, width=WIDTH,
                height=HEIGHT, batch_size=1)
    out = QI21Sampler.execute(**{**args, **extra})
    return out[0], out.ui["qi21_report"][0]


def test_connected_official_sigmas_equal_the_builtin_run(graph):
    plain, _ = base_run(graph)
    with_sigmas, _ = base_run(graph, sigmas=QI21Sigmas.execute("base", 6, WIDTH, HEIGHT)[0])
    assert torch.equal(plain["samples"], with_sigmas["samples"])


def test_denoise_one_with_a_latent_equals_text_to_image(graph):
    plain, _ = base_run(graph)
    latent = {"samples": torch.randn(1, 64, *GRID)}
    again, _ = base_run(graph, latent_image=latent, width=0, height=0)
    assert torch.equal(plain["samples"], again["samples"])


def test_split_schedule_equals_the_unsplit_run(graph):
    sigmas = QI21Sigmas.execute("base", 6, WIDTH, HEIGHT)[0]
    whole, _ = base_run(graph)
    first, report = base_run(graph, sigmas=sigmas[:4])
    assert report["steps"] == 3
    second, _ = base_run(graph, sigmas=sigmas[3:], latent_image=first, add_noise=False, width=0, height=0)
    torch.testing.assert_close(second["samples"], whole["samples"], rtol=0, atol=TOL)


def test_inpainting_through_the_node_keeps_the_unmasked_latent(graph):
    latent = torch.randn(1, 64, *GRID)
    mask = torch.zeros(1, 1, HEIGHT, WIDTH)
    mask[..., : HEIGHT // 2, :] = 1.0
    out, _ = base_run(graph, latent_image={"samples": latent, "noise_mask": mask}, denoise=0.6, width=0, height=0)
    kept = latent_mask(mask, GRID, 1) == 0
    torch.testing.assert_close(out["samples"][kept.expand_as(latent)], latent[kept.expand_as(latent)],
                               rtol=0, atol=TOL)
    assert "noise_mask" in out  # kept on the LATENT, as ComfyUI's samplers do


def test_notes_for_small_sizes_turbo_schedules_and_other_negative_references(graph):
    _, report = base_run(graph, width=128, height=96)
    assert any("trained at larger sizes" in note for note in report["notes"])
    out = QI21TurboSampler.execute(graph["turbo"], gf.synthetic_conditioning(), 1, WIDTH, HEIGHT, 1, denoise=0.5,
                                   latent_image={"samples": torch.randn(1, 64, *GRID)})
    assert any("distilled for its stored 8-sigma schedule" in n for n in out.ui["qi21_report"][0]["notes"])


@pytest.mark.parametrize("extra, message", [
    pytest.param(dict(denoise=0.0), "denoise = 0.0", id="denoise_zero"),
    pytest.param(dict(latent_image={"samples": torch.zeros(1, 4, 12, 16)}, width=0, height=0), "Stable Diffusion",
                 id="sd_latent"),
    pytest.param(dict(latent_image={"samples": torch.zeros(1, 16, 12, 16)}, width=0, height=0), "Flux",
                 id="flux_latent"),
    pytest.param(dict(latent_image={"samples": torch.zeros(1, 64, 12, 16)}, width=512, height=0), "512x192",
                 id="size_mismatch"),
    pytest.param(dict(add_noise=False), "add_noise is off", id="add_noise_without_latent"),
    pytest.param(dict(sigmas=torch.tensor([0.2, 0.5, 0.0])), "strictly decreasing", id="ascending_sigmas"),
])
def test_bad_sampler_inputs_name_the_problem(graph, extra, message):
    with pytest.raises(ValueError, match=message):
        base_run(graph, **extra)


# -- VAE encode ----------------------------------------------------------------------------------------------------
def test_vae_encode_equals_diffusers_and_decodes():
    from diffusers import AutoencoderKLQwenImage21

    from qi21.model.loaders.vae import vae_from_state_dict
    from qi21.nodes.decode import QI21VAEDecode

    torch.manual_seed(0)
    reference = AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=12, z_dim=64, dim_mult=[1, 2, 4, 8, 8],
                                         num_res_blocks=1, temperal_downsample=[False, True, True, True]).eval()
    vae = vae_from_state_dict(reference.state_dict())
    image = torch.rand(2, 96, 128, 4, generator=torch.Generator().manual_seed(2))
    mask = torch.rand(2, 96, 128, generator=torch.Generator().manual_seed(3))
    latent = QI21VAEEncode.execute(vae, image, mask)[0]["samples"]
    assert latent.shape == (2, 64, 6, 8)
    pixels = image.clone()
    pixels[..., 3] = 1 - mask  # the mask is the alpha (1 = transparent)
    with torch.no_grad():
        expected = reference.encode((pixels * 2 - 1).movedim(-1, 1)[:, :, None]).latent_dist.mode()[:, :, 0]
    torch.testing.assert_close(latent, expected, rtol=0, atol=1e-4)
    rgb, alpha_mask, rgba = QI21VAEDecode.execute(vae, {"samples": latent}).args  # the LATENT round-trips
    with torch.no_grad():
        decoded = reference.decode(expected[:, :, None]).sample[:, :, 0]
    torch.testing.assert_close(rgba, ((decoded + 1) / 2).clamp(0, 1).movedim(1, -1), rtol=0, atol=1e-4)
    opaque = QI21VAEEncode.execute(vae, image[..., :3])[0]["samples"]
    x_rgb = torch.cat([image[..., :3] * 2 - 1, torch.ones(2, 96, 128, 1)], -1).movedim(-1, 1)
    with torch.no_grad():
        expected_rgb = reference.encode(x_rgb[:, :, None]).latent_dist.mode()[:, :, 0]
    torch.testing.assert_close(opaque, expected_rgb, rtol=0, atol=1e-4)


def test_vae_encode_crops_to_multiples_of_32_and_refuses_bad_masks(graph):
    vae = graph["vae"]
    latent = QI21VAEEncode.execute(vae, torch.rand(1, 100, 70, 3))[0]["samples"]
    assert latent.shape == (1, 64, 6, 4)  # 96 x 64 px, centre-cropped
    with pytest.raises(ValueError, match="resize the mask"):
        QI21VAEEncode.execute(vae, torch.rand(1, 64, 64, 3), torch.rand(1, 32, 32))
    constant = QI21VAEEncode.execute(vae, torch.rand(1, 64, 64, 3), torch.zeros(1, 64, 64))[0]["samples"]
    assert constant.shape == (1, 64, 4, 4)  # LoadImage's placeholder mask of another size is broadcast


def test_turbo_sampler_uses_the_folders_own_sigmas(graph):
    """A diffusers Turbo folder's `sample_sigmas` (`DiTSource.sigmas`) is the schedule the Turbo sampler runs, and
    it is not reported as a foreign schedule."""
    from dataclasses import replace

    model = graph["turbo"]
    original = model.source
    model.source = replace(original, sigmas=(1.0, 0.7, 0.35))
    try:
        out = QI21TurboSampler.execute(model, gf.synthetic_conditioning(), 1, WIDTH, HEIGHT, 1)
    finally:
        model.source = original
    report = out.ui["qi21_report"][0]
    assert report["steps"] == 3 and not any("distilled" in note for note in report.get("notes", []))
