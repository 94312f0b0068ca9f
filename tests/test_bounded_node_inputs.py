"""The pass over every node input and HTTP route the pack owns for unbounded work (issue 58, item 2): numbers that
do not fit, strings and lists without a bound, values a link may carry that no widget would send. Each was found by
calling the node as an API client (or a link) can, and each now ends in a clear error, within a second, naming the
input and quoting at most a short prefix of the value; the next run equals a clean one.

Found: `steps` or `denoise` = 10^400 raised OverflowError from the denoise arithmetic; a 10^400 `seed`, `cfg`,
`width` or `resolution` was refused with a message that printed all 401 digits; a string `steps` raised a
TypeError; a 10-million-character prompt took 50 s to tokenize before the RoPE limit refused it; a linked SIGMAS of a
million values would run a million steps, and one holding a NaN was refused with a 20-MB message that listed every
value; the worker route read only the part of a body that had arrived with aiohttp's first `read`."""

import asyncio
import time

import pytest
import torch

import graph_fixtures as gf
from qi21.model.encoders.prompt_template import CHARS_PER_POSITION, MAX_ROPE_POSITIONS
from qi21.model.sampling.schedule import MAX_SIGMAS, literal_sigmas
from qi21.nodes import bridge
from qi21.nodes.conditioning import QI21Reference, QI21TextEncode
from qi21.nodes.placement import KEPT_CACHES
from qi21.nodes.samplers import QI21Sampler, QI21TurboSampler
from qi21.nodes.schedule import QI21Sigmas
from qi21.nodes.validation import quoted

HUGE = 10 ** 400


@pytest.fixture(scope="module")
def loaded(models_root):
    return gf.load("text_encoder", "vae", "model")


@pytest.fixture(scope="module")
def positive():
    return gf.synthetic_conditioning(text_runs=[8])


def _base(loaded, positive, *args, **inputs):
    seed, steps, cfg, width, height, batch = (*args, *(1, 2, 1.0, 64, 64, 1)[len(args):])
    return QI21Sampler.execute(loaded["model"], positive, seed, steps, cfg, width, height, batch, **inputs)


def refused(call, message: str) -> str:
    start = time.monotonic()
    with pytest.raises(ValueError, match=message) as raised:
        call()
    assert time.monotonic() - start < 2.0
    text = str(raised.value)
    assert len(text) < 500, text[:600]
    return text


@pytest.fixture
def clean(loaded, positive):
    """A clean run before the hostile ones; the test checks the one after against it."""
    KEPT_CACHES.clear()
    before = _base(loaded, positive)[0]["samples"]
    yield lambda: torch.equal(_base(loaded, positive)[0]["samples"], before)
    KEPT_CACHES.clear()


SAMPLER_CASES = {
    "steps 10^400": (dict(args=(1, HUGE)), "steps = an integer of about 401 digits: expected a value from 1 to 200"),
    "steps -10^400": (dict(args=(1, -HUGE)), "steps = a negative integer of about 401 digits: at least 1 step"),
    "steps a string": (dict(args=(1, "40")), "steps = '40': expected a number from 1 to 200"),
    "seed 10^400": (dict(args=(HUGE,)), "seed = an integer of about 401 digits: expected a value from 0 to"),
    "seed 2^64": (dict(args=(2 ** 64,)), "seed = 18446744073709551616: expected a value"),
    "cfg 10^400": (dict(args=(1, 2, HUGE)), "cfg = an integer of about 401 digits: expected a value from 1.0 to 20.0"),
    "width 10^400": (dict(args=(1, 2, 1.0, HUGE)), "width = an integer of about 401 digits: use 0"),
    "width a list": (dict(args=(1, 2, 1.0, [64] * 10_000)), "width = a list of 10000: expected a number|width = \\["),
    "batch 10^400": (dict(args=(1, 2, 1.0, 64, 64, HUGE)), "batch_size = an integer of about 401 digits"),
    "denoise 10^400": (dict(denoise=HUGE), "denoise = an integer of about 401 digits"),
    "denoise a string": (dict(denoise="x" * 10_000), "denoise = 'xxxx.*10,000 characters"),
}


@pytest.mark.parametrize("case", sorted(SAMPLER_CASES))
def test_sampler_numbers_are_refused_by_name_and_quoted_short(loaded, positive, clean, case):
    inputs, message = SAMPLER_CASES[case]
    inputs = dict(inputs)
    args = inputs.pop("args", ())
    refused(lambda: _base(loaded, positive, *args, **inputs), message)
    assert clean()


def test_the_turbo_sampler_and_the_sigmas_node_too(loaded, positive):
    refused(lambda: QI21TurboSampler.execute(loaded["model"], positive, HUGE, 64, 64, 1), "seed = an integer")
    refused(lambda: QI21TurboSampler.execute(loaded["model"], positive, 1, 64, 64, 1, denoise=-HUGE),
            "denoise = a negative integer")
    refused(lambda: QI21Sigmas.execute("base", HUGE, 64, 64), "steps = an integer of about 401 digits")
    refused(lambda: QI21Sigmas.execute("base", 40, 64, 64, denoise=HUGE), "denoise = an integer of about 401")
    refused(lambda: QI21Sigmas.execute("base", "forty", 64, 64), "steps = 'forty': expected a number")
    text = refused(lambda: QI21Sigmas.execute("base", 40, 64, 64, denoise=1e-300), "4e\\+301-step schedule")
    assert "39,999" not in text  # was: all 302 digits of the schedule's length


def test_a_reference_resolution_that_does_not_fit(loaded):
    image = torch.rand(1, 64, 64, 3)
    refused(lambda: QI21Reference.execute(loaded["vae"], image, HUGE), "resolution = an integer of about 401 digits")
    refused(lambda: QI21Reference.execute(loaded["vae"], image, "1024"), "resolution = '1024': expected a number")
    refused(lambda: QI21Reference.execute(loaded["vae"], image, True), "resolution = True: expected a number")


def test_a_huge_prompt_is_refused_before_it_is_tokenized(loaded):
    limit = MAX_ROPE_POSITIONS * CHARS_PER_POSITION
    text = refused(lambda: QI21TextEncode.execute(loaded["text_encoder"], "a " * 5_000_000),
                   f"is 10,000,000 characters; at most {limit:,} are read")
    assert text.count("a a") < 30
    encoded = QI21TextEncode.execute(loaded["text_encoder"], "a red square")[0]  # the next prompt as usual
    assert encoded is not None


def test_a_prompt_at_the_character_bound_is_still_tokenized_and_judged_by_its_tokens(loaded):
    """The character bound never refuses what fits: at 32 characters per position, a prompt at the bound is far
    beyond the positions in any real text, and it is the token count that refuses it."""
    prompt = "ab " * (MAX_ROPE_POSITIONS * CHARS_PER_POSITION // 3)
    refused(lambda: QI21TextEncode.execute(loaded["text_encoder"], prompt), "RoPE positions")


def test_a_linked_sigmas_is_bounded_and_never_echoed_whole(loaded, positive, clean):
    refused(lambda: _base(loaded, positive, sigmas=torch.linspace(1, 0, 1_000_000)),
            f"holds 1,000,000 values; at most {MAX_SIGMAS:,} are run")
    poisoned = torch.linspace(1, 0, MAX_SIGMAS)
    poisoned[5] = float("nan")
    text = refused(lambda: _base(loaded, positive, sigmas=poisoned), "holds NaN or infinite values")
    assert f"({MAX_SIGMAS:,} values)" in text
    refused(lambda: literal_sigmas(torch.linspace(2, 0, MAX_SIGMAS)), "must lie in \\[0, 1\\]")
    refused(lambda: literal_sigmas(torch.zeros([1] * 40)), "one schedule")
    assert clean()


def test_quoted_cuts_every_kind_of_value():
    assert quoted("x" * 10_000).endswith("(10,000 characters)") and len(quoted("x" * 10_000)) < 100
    assert quoted(HUGE) == "an integer of about 401 digits"
    assert quoted(10 ** 5000) == "an integer of about 5001 digits"  # str() of it would raise
    assert len(quoted(list(range(10_000)))) < 100 and quoted(1.5) == "1.5"


def test_the_route_reads_a_body_that_arrives_in_parts():
    """aiohttp's `request.content.read(n)` returns what has arrived: the route reads to the end, and stops reading
    once a body passes its bound."""
    def reader(data: bytes, part: int = 1000):
        chunks = [data[i:i + part] for i in range(0, len(data), part)]
        calls = []

        async def read(n):
            calls.append(n)
            return chunks.pop(0) if chunks else b""
        return read, calls

    body = b"x" * 250_000
    read, _ = reader(body)
    assert asyncio.run(bridge.read_capped(read, 1 << 20)) == body
    read, calls = reader(b"y" * 250_000)
    assert asyncio.run(bridge.read_capped(read, 100_000)) is None and len(calls) <= 101
    read, _ = reader(b"")
    assert asyncio.run(bridge.read_capped(read, 10)) == b""


def test_window_inputs_are_range_checked_before_they_are_compared():
    from qi21.nodes.controlnet import QI21ControlNetApply
    from qi21.nodes.step_cache import QI21StepCache

    for node in (QI21StepCache, QI21ControlNetApply):
        assert "start_percent = 'x': expected a number" in node.validate_inputs(start_percent="x", end_percent=0.5)
        message = node.validate_inputs(start_percent=HUGE, end_percent=0.5)
        assert "start_percent = an integer of about 401 digits" in message and len(message) < 200
    assert "start_percent" in QI21StepCache.validate_inputs(start_percent=0.9, end_percent=0.2)  # the order, as before


@pytest.mark.parametrize("loader, name_input", [("QI21ModelLoader", "model_name"), ("QI21VAELoader", "vae_name"),
                                                ("QI21TextEncoderLoader", "text_encoder_name"),
                                                ("QI21LoraLoader", "lora_name")])
def test_a_10000_character_file_name_is_quoted_short(models_root, loader, name_input):
    from qi21.nodes import NODES

    node = next(n for n in NODES if n.__name__ == loader)
    message = node.validate_inputs(**{name_input: "m" * 10_000})
    assert "(10,000 characters) is not in the" in message and len(message) < 300, message[:400]
    with pytest.raises(FileNotFoundError) as raised:
        bridge.model_path("vae", "v" * 10_000)
    assert len(str(raised.value)) < 1000
