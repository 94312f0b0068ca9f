"""The text encoder gives the same conditioning on every supported transformers release.

diffusers 0.42.1, the oracle of test_text_encoder.py, cannot be installed beside transformers 4.x, so on the
lowest supported release (CI's second environment, docs/development.md "Lowest supported versions") the
comparison goes through numbers recorded once: `te_recorded.json` holds, for a few prompts with and without
references, the kept token ids and each kept state projected on 4 fixed random directions, written on the main
environment's transformers, where test_text_encoder.py shows the same encoder equal to diffusers within 1e-5.
Both environments compare against the file: the main one pins the recording to the oracle, the lowest one its
releases to the recording.

The recording depends on the tiny model (te_fixtures, seed 0), the generated tokenizer and these cases; after a
deliberate change to one of them, rewrite it with the test setting QI21_REWRITE_TE_RECORDING=1 on the main
environment (`QI21_REWRITE_TE_RECORDING=1 python -m pytest -q tests/test_text_encoder_versions.py`) and check
that test_text_encoder.py still passes there.
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from qi21.model.encoders.references import prepare_reference
from qi21.model.loaders.text_encoder import load_text_encoder
from te_fixtures import tiny_reference_model, write_qwen2_tokenizer, write_single_file

RECORDING = Path(__file__).with_name("te_recorded.json")
REWRITE_ENV = "QI21_REWRITE_TE_RECORDING"
#: fp32 on the CPU: releases reorder a few sums (about 1e-6 per state); a wrong mask, position or layer moves
#: the projections by far more than this
ATOL = 1e-4
#: (prompts, reference seeds): text only, one RGBA reference, two references (the leading run kept and reused)
CASES = {
    "text": (["A cat", "a much longer prompt about <image1> and a dog"], []),
    "one_reference": (["Put <image1> on the left", " "], [1]),
    "two_references": (["Put <image1> beside <image2> at dawn"], [2, 3]),
}


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    root = tmp_path_factory.mktemp("te_versions")
    write_single_file(tiny_reference_model(), root / "qwen3vl_tiny.safetensors", "comfyui")
    write_qwen2_tokenizer(root / "qwen3vl_tiny_tokenizer")
    return load_text_encoder(root / "qwen3vl_tiny.safetensors", weight_dtype="fp32")


def reference(seed: int):
    rng = np.random.default_rng(seed)
    array = rng.integers(0, 256, size=(256, 256, 4), dtype=np.uint8)
    array[..., 3] = rng.choice([0, 128, 255], size=(256, 256))  # transparent, half and opaque pixels
    return prepare_reference(torch.from_numpy(array.astype(np.float32) / 255.0)[None], resolution=256)


def fingerprint(encoder, prompts, seeds, reuse: bool) -> dict:
    encoder.prompt_cache.clear()
    budget, encoder.prompt_cache.budget_bytes = encoder.prompt_cache.budget_bytes, (2**31 if reuse else 0)
    try:
        batch = encoder.encode_batch(prompts, [reference(seed) for seed in seeds])
    finally:
        encoder.prompt_cache.budget_bytes = budget
        encoder.prompt_cache.clear()
    directions = torch.randn(encoder.hidden_size, 4, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return {"token_ids": [p.token_ids.tolist() for p in batch.prompts],
            "projected": [(p.embeds.double() @ directions).tolist() for p in batch.prompts]}


def test_the_conditioning_is_the_recorded_one(encoder):
    got = {name: fingerprint(encoder, prompts, seeds, reuse=True) for name, (prompts, seeds) in CASES.items()}
    if os.environ.get(REWRITE_ENV):
        rounded = {name: {"token_ids": case["token_ids"],
                          "projected": [[[round(v, 6) for v in row] for row in p] for p in case["projected"]]}
                   for name, case in got.items()}
        RECORDING.write_text(json.dumps({"transformers": transformers.__version__, "cases": rounded}) + "\n",
                             encoding="utf-8")
    recorded = json.loads(RECORDING.read_text(encoding="utf-8"))["cases"]
    assert sorted(recorded) == sorted(CASES)
    for name, (prompts, seeds) in CASES.items():
        # the plain full encode (no kept leading run) is held to the same numbers
        for case in (got[name], fingerprint(encoder, prompts, seeds, reuse=False)):
            assert case["token_ids"] == recorded[name]["token_ids"], name
            for ours, theirs in zip(case["projected"], recorded[name]["projected"]):
                assert np.abs(np.array(ours) - np.array(theirs)).max() <= ATOL, name
