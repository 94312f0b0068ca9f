"""Random sizes, aspects, channel counts and reference counts through the reference layer and the samplers, on
the tiny model: every input either works (sides x32, the documented size, finite latents of the right shape, a
report that adds up) or fails with one of the documented messages, never anything else.

Examples are derandomized and kept few (deadline off: the first sampler call builds RoPE tables) so CI time and
results are fixed; the references skip the VAE and the text encoder, whose behaviour on these images
test_bad_inputs.py and test_text_encoder.py cover: their latents and states are random, their token counts real.
"""

import re

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings, strategies as st

import graph_fixtures as gf
from qi21.model.encoders.pipeline import MAX_REFERENCES, check_room_for_reference
from qi21.model.encoders.references import MAX_ASPECT, MAX_VLM_PIXELS, MIN_VLM_PIXELS, prepare_reference, reference_size
from qi21.model.vae.latents import sampling_size, target_size
from qi21.nodes.placement import KEPT_CACHES
from qi21.nodes.samplers import MAX_SIZE, MIN_SIZE, QI21Sampler, QI21TurboSampler

pytestmark = pytest.mark.slow  # hypothesis properties: many examples each

SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
#: The only ways a reference may be refused (references.py `_check_size` and `_rgba_source`).
REFERENCE_ERRORS = re.compile(
    r"Reference image \d+x\d+ (at resolution \d+|keeping its own size \(resolution 0\)) becomes \d+x\d+: "
    r"(\d+ pixels, (below|above) the vision processor's (minimum|maximum)|more elongated than 200:1)"
    r".* (Use resolution (>=|<=) (\d+)\.|Crop the image first\.|Crop the image to a less elongated shape first\.)$"
)

# Sides from 1 px to 700 px (aspects up to 1:700), plus slivers up to 1:2000 in both directions.
sides = st.integers(min_value=1, max_value=700)
sliver = st.tuples(st.integers(1, 8), st.integers(300, 2000))
image_sizes = st.one_of(st.tuples(sides, sides), sliver, sliver.map(lambda wh: wh[::-1]))


def random_image(width, height, channels, seed=0):
    return torch.rand(1, height, width, channels, generator=torch.Generator().manual_seed(seed))


@settings(max_examples=60, **SETTINGS)
@given(size=image_sizes, channels=st.sampled_from([1, 3, 4]), resolution=st.sampled_from([0, 256, 320, 512]))
def test_a_reference_is_prepared_on_the_32_grid_or_refused_with_a_working_resolution(size, channels, resolution):
    width, height = size
    image = random_image(width, height, channels)
    try:
        prepared = prepare_reference(image, None, resolution)
    except ValueError as error:
        found = REFERENCE_ERRORS.search(str(error))
        assert found, f"undocumented error: {error}"
        event(f"refused: {found.group(5).split(' ')[0]} {found.group(6) or ''}")
        if found.group(6) == ">=" and int(found.group(7)) <= 512:  # the advice works (when cheap to check)
            assert prepare_reference(image, None, int(found.group(7))).vlm_tokens > 0
        return
    w, h = prepared.size
    assert (w, h) == reference_size(width, height, resolution)
    assert w % 32 == 0 and h % 32 == 0 and MIN_VLM_PIXELS <= w * h <= MAX_VLM_PIXELS
    assert max(w, h) <= MAX_ASPECT * min(w, h)
    assert prepared.pixels.shape == (1, 4, h, w) and prepared.vlm_image.size == (w, h)
    assert torch.isfinite(prepared.pixels).all() and prepared.pixels.abs().max() <= 1
    assert prepared.vlm_tokens * 4 == prepared.latent_grid[0] * prepared.latent_grid[1]
    if channels != 4:
        assert torch.all(prepared.pixels[0, 3] == 1.0)  # no alpha given: opaque


@pytest.fixture(scope="module")
def models(models_root):
    yield gf.load("model", "turbo")
    KEPT_CACHES.clear()


@pytest.fixture(scope="module")
def small_store():
    """A store budget of about three one-reference prefixes, so random runs evict."""
    # 3 x (2 layers x K/V x 2 heads x 32 x ~340 tokens, fp32)
    with gf.default_store_budget(3 * 2 * 2 * 2 * 32 * 340 * 4) as store:
        yield store


reference_shapes = st.lists(st.tuples(st.integers(16, 600), st.integers(16, 600)), max_size=MAX_REFERENCES + 1)
# 0 (follow the last reference / 1024), a usable size (twice as likely) or one below the minimum
usable = st.integers(MIN_SIZE, 512)
target_sides = st.one_of(st.just(0), usable, usable, st.integers(1, MIN_SIZE - 1))


@settings(max_examples=20, **SETTINGS)
@example(shapes=[(300, 200)] * 11, width=0, height=0, turbo=False, steps=1, batch=1, keep=False, seed=0)
@example(shapes=[(64, 600), (600, 64)] * 5, width=0, height=0, turbo=True, steps=1, batch=2, keep=True, seed=1)
@example(shapes=[], width=0, height=0, turbo=False, steps=2, batch=1, keep=True, seed=2)  # 1024 x 1024
@given(shapes=reference_shapes, width=target_sides, height=target_sides, turbo=st.booleans(),
       steps=st.integers(1, 3), batch=st.integers(1, 2), keep=st.booleans(), seed=st.integers(0, 2**32))
def test_random_references_and_sizes_sample_finite_latents_or_fail_as_documented(models, small_store, shapes, width,
                                                                                 height, turbo, steps, batch, keep,
                                                                                 seed):
    prepared = []
    for i, (w, h) in enumerate(shapes):
        try:
            check_room_for_reference(prepared)
        except ValueError as error:
            assert i == MAX_REFERENCES and "takes at most 10" in str(error)
            event("11th reference refused")
            return
        try:
            prepared.append(prepare_reference(random_image(w, h, 3, seed=i), None, 288))
        except ValueError as error:
            assert REFERENCE_ERRORS.search(str(error)), f"undocumented error: {error}"
            event("a reference refused")
    cond = gf.synthetic_conditioning(prepared, seed=seed % 1000)
    node = QI21TurboSampler if turbo else QI21Sampler
    kwargs = dict(seed=seed, width=width, height=height, batch_size=batch, keep_cache=keep)
    if not turbo:
        kwargs.update(steps=steps, cfg=1.0)
    model = models["turbo" if turbo else "model"]
    bad = [(name, value) for name, value in (("width", width), ("height", height)) if 0 < value < MIN_SIZE]
    if bad:
        with pytest.raises(ValueError, match=rf"{bad[0][0]} = {bad[0][1]}: use 0 .* from {MIN_SIZE} to {MAX_SIZE}"):
            node.execute(model, cond, **kwargs)
        event("size below the minimum refused")
        return

    out = node.execute(model, cond, **kwargs)
    wanted = target_size(width, height, cond.ref_shapes[-1] if cond.ref_shapes else None)
    w, h = sampling_size(*wanted)
    latents, report = out[0]["samples"], out.ui["qi21_report"][0]
    assert latents.shape == (batch, 64, h // 16, w // 16) and torch.isfinite(latents).all()
    assert report["target_tokens"] == (h // 16) * (w // 16) and report["batch"] == batch
    assert report["steps"] == (8 if turbo else steps)
    assert report["prefix_tokens"] == cond.text.shape[0] - int(cond.image_slots.sum()) + sum(
        a * b for a, b in cond.ref_shapes)
    event(f"sampled with {len(prepared)} references" if len(prepared) < 5 else "sampled with 5-10 references")
    floored = any("floored" in note for note in report.get("notes", []))
    assert floored == ((w, h) != tuple(wanted))
    assert small_store.nbytes <= small_store.budget_bytes
