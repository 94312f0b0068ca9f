"""fit = pad (model/encoders/canvas.py, docs/pad-and-crop.md): a reference, a VAE-encoded image or a Fun ControlNet
image keeps its own pixels, padded on the right and bottom to multiples of 32; the box travels in the LATENT and
VAE Decode crops back to it, so an edit comes out at its input's exact size and pixel grid.

The tiny random checkpoints check the plumbing (sizes, boxes, every pixel kept, the defaults untouched, caches,
CFG, batches, several references, the control image); the trained toy checks what a user sees: the edit of the
issue's 270x262 picture lays over its input (issue 59).
"""

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

import graph_fixtures as gf
from qi21.demo import toy_model
from qi21.model.encoders.canvas import CROP_KEY, mask_on_canvas, pad_images, padded_size, padded_target
from qi21.model.encoders.control import control_latents
from qi21.model.encoders.references import MIN_VLM_PIXELS, prepare_reference, reference_size
from qi21.model.sampling.img2img import latent_mask
from qi21.nodes.conditioning import QI21Reference, QI21TextEncode
from qi21.nodes.decode import QI21VAEDecode
from qi21.nodes.encode import QI21VAEEncode
from qi21.nodes.samplers import QI21Sampler, QI21TurboSampler


@pytest.fixture(scope="module")
def loaded(models_root):
    return gf.load("model", "turbo", "text_encoder", "vae", dtype="default")


def picture(width=270, height=262, seed=0, channels=3) -> torch.Tensor:
    """A ComfyUI IMAGE of 8-bit values (exactly what LoadImage gives for a PNG)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (1, height, width, channels), generator=generator).float() / 255.0


# -- the arithmetic ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size, canvas", [((270, 262), (288, 288)), ((288, 320), (288, 320)), ((100, 90), (256, 256)),
                                          ((600, 40), (608, 128)), ((33, 1000), (64, 1024))])
def test_the_canvas_rounds_up_to_32_and_reaches_the_vision_minimum(size, canvas):
    got = padded_size(*size, min_pixels=MIN_VLM_PIXELS)
    assert got == canvas and got[0] * got[1] >= MIN_VLM_PIXELS and got[0] % 32 == got[1] % 32 == 0
    assert padded_size(*size) == tuple(-(-side // 32) * 32 for side in size)  # VAE Encode: x32 only


def test_a_padded_reference_keeps_every_pixel_of_the_image():
    image = picture()
    prepared = prepare_reference(image, resolution=0, fit="pad")
    assert (prepared.width, prepared.height, prepared.crop) == (288, 288, (270, 262))
    assert prepared.vlm_image.size == (288, 288) and prepared.latent_grid == (18, 18)
    pixels = (prepared.pixels[0] + 1) / 2  # (4, H, W) in [0, 1]
    own = image[0].movedim(-1, 0)
    torch.testing.assert_close(pixels[:3, :262, :270], own, rtol=0, atol=1e-6)  # not resampled
    torch.testing.assert_close(pixels[:3, :262, 270:], own[:, :, -1:].expand(-1, -1, 18), rtol=0, atol=1e-6)  # edge
    torch.testing.assert_close(pixels[:3, 262:, :270], own[:, -1:, :].expand(-1, 26, -1), rtol=0, atol=1e-6)
    assert bool((pixels[3] == 1).all())  # an opaque picture stays opaque: its padding is not "empty canvas"
    vlm = np.asarray(prepared.vlm_image)
    assert np.array_equal(vlm[:262, :270], np.rint(image[0].numpy() * 255).astype(np.uint8))


def test_transparency_marks_the_padding_as_transparent():
    image = picture(channels=4)
    image[..., 3] = 1.0
    image[:, :, :100, 3] = 0.0
    pixels = prepare_reference(image, resolution=0, fit="pad").pixels[0]
    assert bool((pixels[3, :, 270:] == -1).all()) and bool((pixels[3, 262:, :] == -1).all())
    assert bool((pixels[3, :262, 100:270] == 1).all())


def test_only_a_picture_larger_than_the_resolution_is_scaled_down():
    big = prepare_reference(picture(600, 500), resolution=256, fit="pad")
    width, height = big.crop
    assert width * height <= 256 * 256 and abs(width / height - 600 / 500) < 0.01
    assert (big.width, big.height) == padded_size(width, height, MIN_VLM_PIXELS)
    assert prepare_reference(picture(600, 500), resolution=1024, fit="pad").crop == (600, 500)
    assert prepare_reference(picture(600, 500), resolution=0, fit="pad").crop == (600, 500)


def test_a_canvas_the_vision_processor_would_rescale_is_refused_with_the_resolution_that_works():
    with pytest.raises(ValueError, match="padded to 4128x4128 .* at most 4096"):
        prepare_reference(Image.new("RGB", (4100, 4100)), resolution=0, fit="pad")
    with pytest.raises(ValueError, match="fit must be one of resize, pad"):
        prepare_reference(picture(), fit="crop")


def test_resize_stays_the_reference_pipeline_s():
    image = picture()
    for resolution in (0, 256, 384):
        default, explicit = prepare_reference(image, resolution=resolution), prepare_reference(
            image, resolution=resolution, fit="resize")
        size = reference_size(270, 262, resolution)
        pil = Image.fromarray(np.rint(image[0].numpy() * 255).astype(np.uint8)).convert("RGBA")
        wanted = np.asarray(pil.resize(size, resample=Image.Resampling.LANCZOS, reducing_gap=None))
        wanted = torch.from_numpy(2.0 * (wanted.astype(np.float32) / 255.0) - 1.0).permute(2, 0, 1)
        assert default.crop is None and explicit.crop is None and default.size == size
        assert torch.equal(default.pixels[0], wanted) and torch.equal(explicit.pixels, default.pixels)


def test_the_target_follows_the_first_padded_reference():
    assert padded_target(((16, 20), (18, 18)), (None, None), 0, 0) is None  # no padded reference: today's rule
    assert padded_target(((16, 20), (18, 18)), (None, (270, 262)), 0, 0) == ((288, 288), (270, 262))
    assert padded_target(((18, 18), (16, 20)), ((270, 262), (300, 250)), 0, 0) == ((288, 288), (270, 262))
    assert padded_target(((18, 18),), ((270, 262),), 512, 0) == ((512, 288), None)  # another size: no crop
    assert padded_target(((18, 18),), ((270, 262),), 300, 300) == ((300, 300), (270, 262))  # floored to 288


def test_a_mask_drawn_on_the_picture_is_padded_like_it():
    mask = torch.zeros(2, 262, 270)
    mask[:, 200:, 250:] = 1.0  # touches the bottom-right corner: continues into the padding
    padded = mask_on_canvas(mask, (270, 262), (288, 288))
    assert padded.shape == (2, 288, 288) and torch.equal(padded[:, :262, :270], mask)
    assert bool((padded[:, 262:, 250:] == 1).all()) and bool((padded[:, :200, 270:] == 0).all())
    other = torch.zeros(1, 64, 64)
    assert mask_on_canvas(other, (270, 262), (288, 288)) is other  # another size: stretched as ComfyUI does


# -- the nodes -----------------------------------------------------------------------------------------------------


def edit(loaded, images, fits, sampler="turbo", width=0, height=0, **kwargs):
    refs = None
    for image, fit in zip(images, fits):
        refs = QI21Reference.execute(loaded["vae"], image, 0, references=refs,
                                     **({} if fit is None else {"fit": fit}))[0]
    positive = QI21TextEncode.execute(loaded["text_encoder"], "make <image1> blue", refs)[0]
    if sampler == "turbo":
        out = QI21TurboSampler.execute(loaded["turbo"], positive, 7, width, height, kwargs.pop("batch_size", 1),
                                       **kwargs)
    else:
        negative = QI21TextEncode.execute(loaded["text_encoder"], "blurry", refs)[0]
        out = QI21Sampler.execute(loaded["model"], positive, 7, 2, 2.5, width, height, kwargs.pop("batch_size", 1),
                                  negative=negative, **kwargs)
    return out[0], out.ui["qi21_report"][0]


def test_an_edit_with_a_padded_reference_comes_out_at_the_input_s_size(loaded):
    latent, report = edit(loaded, [picture()], ["pad"])
    assert latent["samples"].shape[-2:] == (18, 18) and latent[CROP_KEY] == (270, 262)
    assert report["crop"] == {"box": [0, 0, 270, 262], "canvas": [288, 288]}
    rgb, mask, rgba = QI21VAEDecode.execute(loaded["vae"], latent).args
    assert rgb.shape == (1, 262, 270, 3) and mask.shape == (1, 262, 270) and rgba.shape == (1, 262, 270, 4)
    whole = QI21VAEDecode.execute(loaded["vae"], {"samples": latent["samples"]}).args[2]  # a LATENT without the box
    assert whole.shape == (1, 288, 288, 4) and torch.equal(rgba, whole[:, :262, :270])


def test_with_the_option_off_nothing_changes(loaded):
    """No `fit` (a saved workflow), fit = resize and the sampler's own reading: the same latents, bit for bit, and
    nothing added to the LATENT or the report."""
    image = picture()
    saved, saved_report = edit(loaded, [image], [None])
    explicit, explicit_report = edit(loaded, [image], ["resize"])
    assert set(saved) == set(explicit) == {"samples"} and "crop" not in saved_report
    assert saved["samples"].shape[-2:] == (16, 16)  # 270x262 floored to 256x256, as before
    assert torch.equal(saved["samples"], explicit["samples"])
    encoded = QI21VAEEncode.execute(loaded["vae"], image)[0]
    assert set(encoded) == {"samples"} and torch.equal(
        encoded["samples"], QI21VAEEncode.execute(loaded["vae"], image, fit="crop")[0]["samples"])
    assert encoded["samples"].shape[-2:] == (16, 16)
    gray = torch.rand(1, 200, 240, 3)
    assert torch.equal(control_latents(loaded["vae"], (12, 14), gray), control_latents(loaded["vae"], (12, 14), gray,
                                                                                        fit="stretch"))


def test_padding_composes_with_several_references_cfg_batches_and_a_kept_cache(loaded):
    images = [picture(270, 262, 1), picture(320, 256, 2)]
    latent, report = edit(loaded, images, ["resize", "pad"], sampler="base", batch_size=2, keep_cache=True)
    assert latent["samples"].shape == (2, 64, 16, 20) and latent[CROP_KEY] == (320, 256)  # x32 already: no padding
    latent, report = edit(loaded, images[::-1], ["pad", "pad"], sampler="base", batch_size=2, keep_cache=True)
    assert latent["samples"].shape == (2, 64, 16, 20) and latent[CROP_KEY] == (320, 256)  # follows the first
    images = [picture(270, 262, 1), picture(300, 250, 2)]
    first, report = edit(loaded, images, ["pad", "pad"], sampler="base", batch_size=2, keep_cache=True)
    again, second = edit(loaded, images, ["pad", "pad"], sampler="base", batch_size=2, keep_cache=True)
    assert first[CROP_KEY] == (270, 262) and first["samples"].shape == (2, 64, 18, 18)
    # the padded reference is the one kept: the resized one of the first run shares only the leading text with it
    assert report["cache"] in ("miss", "partial") and second["cache"] == "hit"
    torch.testing.assert_close(first["samples"], again["samples"], rtol=0, atol=1e-5)
    rgba = QI21VAEDecode.execute(loaded["vae"], first).args[2]
    assert rgba.shape == (2, 262, 270, 4)


def test_vae_encode_with_pad_keeps_every_pixel_and_inpainting_follows_it(loaded):
    image = picture()
    latent = QI21VAEEncode.execute(loaded["vae"], image, fit="pad")[0]
    assert latent["samples"].shape[-2:] == (18, 18) and latent[CROP_KEY] == (270, 262)
    mask = torch.zeros(1, 262, 270)
    mask[:, 100:200, 100:200] = 1.0
    start = dict(latent, noise_mask=mask)
    positive = QI21TextEncode.execute(loaded["text_encoder"], "a cat", None)[0]
    out = QI21TurboSampler.execute(loaded["turbo"], positive, 3, 0, 0, 1, latent_image=start, denoise=0.5)[0]
    assert out[CROP_KEY] == (270, 262) and out["samples"].shape[-2:] == (18, 18)
    rgb = QI21VAEDecode.execute(loaded["vae"], out).args[0]
    assert rgb.shape == (1, 262, 270, 3)
    # the unmasked latent cells are kept: the mask was padded onto the canvas, not stretched over it
    kept = latent_mask(mask_on_canvas(mask, (270, 262), (288, 288)), (18, 18), 1)[0, 0] == 0
    stretched = latent_mask(mask, (18, 18), 1)[0, 0] == 0
    assert not torch.equal(kept, stretched)  # stretching would have kept other cells
    torch.testing.assert_close(out["samples"][0][:, kept], latent["samples"][0][:, kept], rtol=0, atol=1e-5)
    assert not torch.allclose(out["samples"][0][:, ~kept], latent["samples"][0][:, ~kept], atol=1e-3)


def test_a_bad_box_on_a_latent_is_refused_by_name(loaded):
    latent = QI21VAEEncode.execute(loaded["vae"], picture(), fit="pad")[0]
    with pytest.raises(ValueError, match="qi21_crop must be \\(width, height\\) within the 288x288 image"):
        QI21VAEDecode.execute(loaded["vae"], dict(latent, **{CROP_KEY: (300, 10)}))


def test_the_control_image_is_padded_the_same_way(loaded):
    control = picture(270, 262, 3)
    padded = pad_images(control, (288, 288))
    got = control_latents(loaded["vae"], (18, 18), control, fit="pad")
    torch.testing.assert_close(got, control_latents(loaded["vae"], (18, 18), padded), rtol=0, atol=1e-6)
    mask = torch.zeros(1, 262, 270)
    mask[:, :50, :50] = 1.0
    keep = control_latents(loaded["vae"], (18, 18), control, control, mask, fit="pad")[:, 64].view(18, 18)
    assert bool((keep[:3, :3] == 0).all()) and bool((keep[4:, 4:] == 1).all())


# -- the toy: what a user sees (issue 59) --------------------------------------------------------------------------

needs_toy = pytest.mark.skipif(not toy_model.toy_available(), reason="the toy's files are not in demo/toy/")


def circle_picture(width=270, height=262, centre=(90, 80), radius=50) -> Image.Image:
    """The issue's picture: a red circle on white, drawn 4x larger and downsampled (soft edges, like a photo)."""
    scale = 4
    canvas = Image.new("RGBA", (width * scale, height * scale), (255, 255, 255, 255))
    x, y = centre[0] * scale, centre[1] * scale
    ImageDraw.Draw(canvas).ellipse((x - radius * scale, y - radius * scale, x + radius * scale, y + radius * scale),
                                   fill=(220, 40, 40, 255))
    return canvas.resize((width, height), Image.Resampling.LANCZOS)


def shape_centre(rgba) -> tuple[float, float]:
    """(x, y) in pixels of the image's own grid: the mean of the pixels far from white."""
    image = np.asarray(torch.as_tensor(rgba).float())
    ys, xs = np.nonzero(np.abs(image[..., :3] - 1.0).max(axis=-1) > 0.35)
    return float(xs.mean()), float(ys.mean())


@pytest.fixture(scope="module")
def toy(toy_models):
    from qi21.demo.toy_eval import ToyPipeline
    return ToyPipeline(toy_models["root"])


def toy_edit(toy, fit, seed=0, steps=20, centre=(90, 80)):
    from qi21.demo.toy_eval import analyse
    from qi21.model.encoders.canvas import crop_images
    from qi21.model.encoders.pipeline import decode_images, encode_prepared, encode_prompt
    from qi21.model.sampling.loop import sample
    from qi21.model.sampling.schedule import base_sigmas

    prepared = prepare_reference(circle_picture(centre=centre), resolution=0, fit=fit)
    positive = encode_prompt(toy.text_encoder, "make the circle blue", (encode_prepared(toy.vae, prepared),))
    target = padded_target(positive.ref_shapes, positive.ref_crops, 0, 0)
    (width, height), box = target or ((prepared.width, prepared.height), None)
    result = sample(toy.dit(), positive, sigmas=base_sigmas(steps, width, height), width=width, height=height,
                    seed=seed)
    rgba = decode_images(toy.vae, positive.latent_format.denormalize(result.latents.float()))[2]
    rgba = rgba if box is None else crop_images(rgba, box)
    return rgba[0], analyse(rgba[0]).colour


@needs_toy
def test_on_the_toy_a_padded_edit_lays_over_its_input(toy):
    """The issue's picture: 270x262, a red circle centred at (90, 80), "make the circle blue". Today (resolution 0)
    the output is 256x256 and the circle lands 5 px off where it was; padded, the output is exactly 270x262 and the
    circle lands nearer. Not within 1-2 px: the toy redraws the circle rather than copying it, and even at its own
    256x256 size (nothing resampled or padded) it lands about 3-4 px off (docs/pad-and-crop.md), so this bound is
    that redrawing, not the grid."""
    source = shape_centre(torch.from_numpy(np.array(circle_picture())).float() / 255)
    today, today_colour = toy_edit(toy, "resize")
    padded, colour = toy_edit(toy, "pad")
    assert today.shape[:2] == (256, 256) and padded.shape[:2] == (262, 270)
    assert today_colour == colour == "blue"
    today_off, padded_off = (float(np.hypot(*np.subtract(shape_centre(image), source))) for image in (today, padded))
    assert today_off > 4.5 and padded_off < today_off - 1.0  # 5.0 and 3.7 px when this was written


@needs_toy
def test_on_the_toy_a_circle_where_it_learnt_to_draw_stays_within_its_floor(toy):
    """The same edit with the circle at (198, 132), a place the toy was trained to draw at ("on the right", jittered
    by (6, 4)): there the toy redraws a circle on its own 256x256 canvas 1.5-4.1 px from where it was (seeds 0-3,
    docs/pad-and-crop.md), and the padded edit lands as near (1.7 px at seed 0), while today's resampled output is
    10 px off: 270 -> 256 moves x = 198 by 10 px."""
    source = shape_centre(torch.from_numpy(np.array(circle_picture(centre=(198, 132)))).float() / 255)
    today, today_colour = toy_edit(toy, "resize", centre=(198, 132))
    padded, colour = toy_edit(toy, "pad", centre=(198, 132))
    assert padded.shape[:2] == (262, 270) and today_colour == colour == "blue"
    today_off, padded_off = (float(np.hypot(*np.subtract(shape_centre(image), source))) for image in (today, padded))
    assert today_off > 7.0 and padded_off < 3.0, (today_off, padded_off)  # 10.3 and 1.7 px when this was written


@needs_toy
def test_on_the_toy_img2img_with_pad_keeps_the_shape_within_2_px(toy):
    """VAE Encode today centre-crops 270x262 to 256x256 (7 and 3 px off the left and top); with pad the img2img
    edit keeps the circle where it was, to about a pixel."""
    from qi21.model.encoders.canvas import crop_images
    from qi21.model.encoders.pipeline import decode_images, encode_images, encode_prepared
    from qi21.model.sampling.img2img import denoise_tail
    from qi21.model.sampling.loop import sample
    from qi21.model.sampling.schedule import base_sigmas

    picture_ = circle_picture()
    image = torch.from_numpy(np.array(picture_.convert("RGB"))).float()[None] / 255
    source = shape_centre(image[0])
    offsets = {}
    for fit in ("crop", "pad"):
        prepared = prepare_reference(picture_, resolution=0, fit="pad" if fit == "pad" else "resize")
        positive = toy.condition("make the circle blue", (encode_prepared(toy.vae, prepared),))
        raw, _ = encode_images(toy.vae, image, fit=fit)
        height, width = raw.shape[-2] * 16, raw.shape[-1] * 16
        sigmas = denoise_tail(lambda n, w=width, h=height: base_sigmas(n, w, h), 10, 0.75)
        result = sample(toy.dit(), positive, sigmas=sigmas, width=width, height=height, seed=0,
                        latent_image=positive.latent_format.normalize(raw))
        rgba = decode_images(toy.vae, positive.latent_format.denormalize(result.latents.float()))[2]
        if fit == "pad":
            rgba = crop_images(rgba, (270, 262))
            assert rgba.shape[1:3] == (262, 270)
        offsets[fit] = float(np.hypot(*np.subtract(shape_centre(rgba[0]), source)))
    assert offsets["pad"] < 2.0 and offsets["crop"] > 4.0, offsets
