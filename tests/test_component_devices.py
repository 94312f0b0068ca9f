"""Per-component devices in ComfyUI's own way (as ComfyUI-MultiGPU does it): the Text Encoder Loader's and the VAE
Loader's `device` input (default, cpu, and each GPU torch sees), honoured by the nodes that use them. A GPU named
by a workflow that this machine does not have is refused by name, with the devices that are here. On CPUs only:
the GPU choices are exercised through a monkeypatched GPU count, the placement on a second GPU is not."""

import pytest
import torch

import graph_fixtures as gf
from qi21.nodes import bridge
from qi21.nodes.conditioning import QI21TextEncode
from qi21.nodes.decode import QI21VAEDecode
from qi21.nodes.encode import QI21VAEEncode
from qi21.nodes.loaders import QI21TextEncoderLoader, QI21VAELoader
from qi21.nodes.validation import widget_option

LOADERS = {"text_encoder": QI21TextEncoderLoader, "vae": QI21VAELoader}


def device_options(node) -> list:
    spec = next(s for s in node.define_schema().inputs if s.id == "device")
    return list(widget_option(spec, "options"))


@pytest.fixture
def gpus(monkeypatch):
    """Set how many GPUs torch is said to see."""
    return lambda count: monkeypatch.setattr(bridge, "gpu_count", lambda: count)


@pytest.fixture
def no_compute_device(monkeypatch):
    """A compute device that must not be asked for: a component on `cpu` runs there, not on ComfyUI's device."""
    def refuse():
        raise AssertionError("the compute device was used for a component loaded with device = cpu")

    monkeypatch.setattr(bridge, "compute_device", refuse)


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_a_machine_without_gpus_offers_default_and_cpu_only(kind, gpus):
    gpus(0)
    assert device_options(LOADERS[kind]) == ["default", "cpu"]
    spec = next(s for s in LOADERS[kind].define_schema().inputs if s.id == "device")
    assert spec.optional and spec.default == "default"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has GPUs")
@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_this_cpu_machine_offers_default_and_cpu_only(kind):
    assert device_options(LOADERS[kind]) == ["default", "cpu"]


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_each_gpu_torch_sees_is_offered_after_default_and_cpu(kind, gpus):
    gpus(2)
    assert device_options(LOADERS[kind]) == ["default", "cpu", "cuda:0", "cuda:1"]


@pytest.mark.parametrize("kind", sorted(LOADERS))
@pytest.mark.parametrize("count", [0, 1])
def test_a_gpu_this_machine_lacks_is_refused_naming_the_input_and_the_devices_here(models_root, kind, count, gpus):
    gpus(count)
    node = LOADERS[kind]
    here = ", ".join(["default", "cpu"] + [f"cuda:{i}" for i in range(count)])
    name = f"{node.define_schema().display_name}'s device"
    seen = "1 GPU" if count else "no GPU"
    expected = (f"{name} = 'cuda:1': this machine has no GPU cuda:1 (torch sees {seen}); expected one of {here}. The "
                "workflow was probably saved on a machine with more GPUs.")
    assert node.validate_inputs(gf.SINGLE[kind], weight_dtype="fp32", device="cuda:1") == expected
    with pytest.raises(ValueError) as error:
        node.execute(gf.SINGLE[kind], "fp32", device="cuda:1")
    assert str(error.value) == expected
    with pytest.raises(ValueError, match=r"device = 'gpu1': expected one of default, cpu"):
        node.execute(gf.SINGLE[kind], "fp32", device="gpu1")
    assert node.validate_inputs(gf.SINGLE[kind], weight_dtype="fp32", device=None) is True  # linked: at run time


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_an_existing_gpu_passes_validation(models_root, kind, gpus):
    gpus(2)
    assert LOADERS[kind].validate_inputs(gf.SINGLE[kind], weight_dtype="fp32", device="cuda:1") is True
    assert bridge.chosen_device("cuda:1") == torch.device("cuda", 1)
    assert bridge.chosen_device("default") is None


def test_the_vae_on_cpu_encodes_and_decodes_as_the_default_does(models_root, no_compute_device, monkeypatch):
    latent = {"samples": torch.linspace(-1, 1, 64 * 4 * 6).reshape(1, 64, 4, 6)}
    image = torch.rand(1, 64, 96, 3, generator=torch.Generator().manual_seed(0))
    on_cpu = QI21VAELoader.execute(gf.SINGLE["vae"], "default", device="cpu")[0]
    assert on_cpu.preferred_device == torch.device("cpu") and on_cpu.dtype == torch.float32  # default = fp32 on cpu
    got = QI21VAEDecode.execute(on_cpu, latent).args, QI21VAEEncode.execute(on_cpu, image)[0]["samples"]
    monkeypatch.undo()  # the default VAE runs on the compute device (this machine's CPU)
    default = QI21VAELoader.execute(gf.SINGLE["vae"], "default")[0]
    assert default.preferred_device is None
    expected = QI21VAEDecode.execute(default, latent).args, QI21VAEEncode.execute(default, image)[0]["samples"]
    for a, b in zip(got[0], expected[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)


def test_the_text_encoder_on_cpu_encodes_there(models_root, no_compute_device):
    encoder = QI21TextEncoderLoader.execute(gf.SINGLE["text_encoder"], "default", device="cpu")[0]
    assert encoder.preferred_device == torch.device("cpu") and encoder.dtype == torch.float32
    assert QI21TextEncode.execute(encoder, "a red bicycle", None)[0].text.device.type == "cpu"
