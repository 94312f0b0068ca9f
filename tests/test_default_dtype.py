"""The loaders' `default` weight_dtype fits the device (model/loaders/checkpoint.py `default_weight_dtype`): the
file's dtype on a GPU and on a CPU with native bf16 (AVX512-BF16, AMX), fp32 on any other CPU, as ComfyUI core
does there. The run report names the DiT's compute dtype. The capability is stubbed both ways (conftest pins it to
"not native" for the rest of the suite); the real check is compared with the CPU's own flags."""

from pathlib import Path

import pytest
import torch

import graph_fixtures as gf
from qi21.model.loaders import checkpoint
from qi21.nodes.conditioning import QI21TextEncode
from qi21.nodes.loaders import QI21ModelLoader, QI21TextEncoderLoader, QI21VAELoader
from qi21.nodes.parallel import split_model
from qi21.nodes.samplers import QI21Sampler

REAL_CHECK = checkpoint.cpu_has_native_bf16  # taken at import, before conftest's fixture stubs it
CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


def native(monkeypatch, value: bool) -> None:
    monkeypatch.setattr(checkpoint, "cpu_has_native_bf16", lambda: value)


@pytest.mark.parametrize("has_bf16", [False, True])
def test_default_is_fp32_on_a_cpu_without_native_bf16_and_the_file_s_dtype_elsewhere(monkeypatch, has_bf16):
    native(monkeypatch, has_bf16)
    assert checkpoint.default_weight_dtype("default", CPU) == ("default" if has_bf16 else "fp32")
    assert checkpoint.default_weight_dtype(None, "cpu") == (None if has_bf16 else "fp32")
    assert checkpoint.default_weight_dtype("default", GPU) == "default"  # a GPU: always the file's
    for chosen in ("bf16", "fp16", "fp32", "fp8_e4m3fn", torch.bfloat16):
        assert checkpoint.default_weight_dtype(chosen, CPU) == chosen  # an explicit choice is kept


@pytest.mark.parametrize("flag", ["_is_avx512_bf16_supported", "_is_amx_tile_supported"])
def test_native_bf16_is_read_from_torch_s_cpu_checks(monkeypatch, flag):
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: False, raising=False)
    assert REAL_CHECK.__wrapped__() is False  # AVX2 or plain AVX-512: emulated
    monkeypatch.setattr(torch.cpu, flag, lambda: True, raising=False)
    assert REAL_CHECK.__wrapped__() is True


def test_the_check_agrees_with_the_cpu_s_own_flags():
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo on this OS")
    lines = [line for line in cpuinfo.read_text().splitlines() if line.startswith(("flags", "Features"))]
    flags = set(lines[0].split(":", 1)[1].split()) if lines else set()
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512", "DEFAULT"):
        pytest.skip("not an x86 CPU: torch's x86 checks do not apply")
    assert REAL_CHECK.__wrapped__() == bool(flags & {"avx512_bf16", "amx_bf16"})


@pytest.mark.parametrize("has_bf16", [False, True])
def test_the_loaders_follow_it_and_the_report_names_the_compute_dtype(models_root, monkeypatch, has_bf16):
    native(monkeypatch, has_bf16)
    expected = torch.bfloat16 if has_bf16 else torch.float32  # the tiny files are bf16
    model = QI21ModelLoader.execute(gf.SINGLE["model"], "default")[0]
    encoder = QI21TextEncoderLoader.execute(gf.SINGLE["text_encoder"], "default")[0]
    vae = QI21VAELoader.execute(gf.SINGLE["vae"], "default")[0]
    assert (model.compute_dtype, encoder.dtype, vae.dtype) == (expected, expected, expected)
    positive = QI21TextEncode.execute(encoder, "a red circle", None)[0]
    report = QI21Sampler.execute(model, positive, 0, 2, 1.0, 256, 256, 1).ui["qi21_report"][0]
    assert report["compute_dtype"] == ("bfloat16" if has_bf16 else "float32")
    explicit = QI21ModelLoader.execute(gf.SINGLE["model"], "fp32")[0]
    assert QI21Sampler.execute(explicit, positive, 0, 2, 1.0, 256, 256, 1).ui["qi21_report"][0]["compute_dtype"] \
        == "float32"


@pytest.mark.parametrize("has_bf16", [False, True])
def test_a_model_split_over_cpu_ranks_follows_it_too(models_root, monkeypatch, has_bf16):
    native(monkeypatch, has_bf16)
    split = split_model("cpu,cpu", "ulysses", models_root / "diffusion_models" / gf.SINGLE["model"], "default", "auto")
    assert split.args[1] == ("default" if has_bf16 else "fp32")
