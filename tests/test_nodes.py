"""The nodes without ComfyUI: the whole graph (loaders -> references -> encode -> sampler -> decode) on tiny
random checkpoints written in every real file layout, the interrupt path, and each validation error."""

import pytest
import torch

import graph_fixtures as gf
from qi21.nodes import NODES, bridge
from qi21.nodes.conditioning import QI21Reference, QI21TextEncode
from qi21.nodes.decode import QI21VAEDecode
from qi21.nodes.loaders import QI21ModelLoader, QI21VAELoader
from qi21.nodes.placement import KEPT_CACHES
from qi21.nodes.samplers import QI21Sampler, QI21TurboSampler


@pytest.fixture(scope="module")
def loaded(models_root):
    return gf.load("model", "turbo", "text_encoder", "vae", dtype="default")


def rgba_image(width=320, height=256, seed=0):
    """A ComfyUI IMAGE [1, H, W, 4] with a transparent left half."""
    generator = torch.Generator().manual_seed(seed)
    image = torch.rand(1, height, width, 4, generator=generator)
    image[..., 3] = 1.0
    image[:, :, : width // 2, 3] = 0.0
    return image


def test_every_node_has_a_described_schema():
    assert [n.define_schema().node_id for n in NODES] == [  # append-only: saved workflows name these
        "QI21ModelLoader", "QI21TextEncoderLoader", "QI21VAELoader", "QI21Reference", "QI21TextEncode",
        "QI21Sampler", "QI21TurboSampler", "QI21VAEDecode", "QI21Sigmas", "QI21VAEEncode", "QI21LoraLoader",
        "QI21ControlNetLoader", "QI21ControlNetApply", "QI21CacheOptions", "QI21StepCache"]
    for node in NODES:
        schema = node.define_schema()
        assert schema.display_name.startswith("Qwen-Image 2.1") and schema.category == "Qwen-Image 2.1"
        assert schema.description
        widgets = [i for i in schema.inputs if i.io_type in ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")]
        assert all(i.tooltip for i in widgets), f"{schema.node_id}: every widget states its trade-off"


def test_loaders_list_single_files_and_diffusers_folders(models_root):
    assert {gf.SINGLE["model"], gf.SINGLE["turbo"], "diffusers/Qwen-Image-2.1",
            "diffusers/Qwen-Image-2.1-Turbo"} <= set(bridge.model_choices("diffusion_models"))
    assert {gf.SINGLE["text_encoder"], "diffusers/Qwen-Image-2.1"} <= set(bridge.model_choices("text_encoders"))
    assert {gf.SINGLE["vae"], "diffusers/Qwen-Image-2.1"} <= set(bridge.model_choices("vae"))


@pytest.mark.parametrize("name, variant", [
    pytest.param("qwen_image_2.1_bf16.safetensors", "base", id="single file, base"),
    pytest.param("diffusers/Qwen-Image-2.1-Turbo", "turbo", id="diffusers folder, turbo"),
])
def test_model_loader_reads_both_layouts(models_root, name, variant):
    model = QI21ModelLoader.execute(name, "default")[0]
    assert model.source.variant == variant


def run_graph(loaded, sampler="turbo", width=256, height=256, references=1, negative=None, **sampler_kwargs):
    refs = None
    for i in range(references):
        refs = QI21Reference.execute(loaded["vae"], rgba_image(seed=i), 0, references=refs)[0]
    positive = QI21TextEncode.execute(loaded["text_encoder"], "turn <image1> into a watercolour", refs)[0]
    if sampler == "turbo":
        out = QI21TurboSampler.execute(loaded["turbo"], positive, 7, width, height, 1, **sampler_kwargs)
    else:
        neg = QI21TextEncode.execute(loaded["text_encoder"], "blurry", refs)[0] if negative else None
        out = QI21Sampler.execute(loaded["model"], positive, 7, 3, 2.5 if negative else 1.0, width, height, 1,
                                  negative=neg, **sampler_kwargs)
    latent, report = out[0], out.ui["qi21_report"][0]
    return latent, report, QI21VAEDecode.execute(loaded["vae"], latent)


def test_whole_graph_turbo_with_a_reference(loaded):
    latent, report, decoded = run_graph(loaded)
    assert latent["samples"].shape == (1, 64, 16, 16) and latent["samples"].dtype == torch.float32
    rgb, mask, rgba = decoded.args
    assert rgb.shape == (1, 256, 256, 3) and mask.shape == (1, 256, 256) and rgba.shape == (1, 256, 256, 4)
    torch.testing.assert_close(mask, 1.0 - rgba[..., 3])  # ComfyUI convention: 1 = transparent
    assert 0 <= rgba.min() and rgba.max() <= 1
    assert report["steps"] == 8 and report["cache"] == "miss" and report["target_tokens"] == 256
    assert report["prefix_tokens"] > 320 * 256 // 256  # the reference's latent tokens are in the prefix


def test_whole_graph_base_with_cfg_two_references_following_the_last_reference(loaded):
    latent, report, _ = run_graph(loaded, sampler="base", width=0, height=0, references=2, negative=True)
    assert latent["samples"].shape == (1, 64, 256 // 16, 320 // 16)  # 0 x 0 follows the last reference
    assert report["steps"] == 3 and report["batch"] == 1


def test_reference_round_trip_gives_the_grid_the_transformer_expects(loaded):
    """288 x 352 is a multiple of 32 but not of 64: no off-by-one between VAE grid and VLM slots."""
    refs = QI21Reference.execute(loaded["vae"], torch.rand(1, 288, 352, 3), 0)[0]
    assert refs[0].shape == (18, 22) and refs[0].tokens.shape == (18 * 22, 64)
    cond = QI21TextEncode.execute(loaded["text_encoder"], "<image1>", refs)[0]
    assert int(cond.image_slots.sum()) * 4 == 18 * 22
    assert cond.layout((16, 16)).ref_tokens == 18 * 22


def test_sizes_are_floored_to_32_with_a_note(loaded):
    latent, report, _ = run_graph(loaded, width=300, height=270, references=0)
    assert latent["samples"].shape[-2:] == (256 // 16, 288 // 16)
    assert any("floored" in note for note in report["notes"])


def test_a_base_model_in_the_turbo_sampler_is_warned(loaded):
    positive = QI21TextEncode.execute(loaded["text_encoder"], "a cat", None)[0]
    report = QI21TurboSampler.execute(loaded["model"], positive, 1, 256, 256, 1).ui["qi21_report"][0]
    assert any("base model in the turbo sampler" in note for note in report["notes"])


def test_interrupt_mid_sampling_frees_the_cache(loaded, monkeypatch):
    steps = []
    original = bridge.Progress.update

    def interrupt_at_three(self, step, preview=None):
        steps.append(step)
        assert preview is not None and preview.mode == "RGB"  # live latent preview
        original(self, step, preview)
        if step == 3:
            bridge.request_interrupt()

    monkeypatch.setattr(bridge.Progress, "update", interrupt_at_three)
    with pytest.raises(InterruptedError):
        run_graph(loaded, keep_cache=True)
    assert steps == [1, 2, 3, 4][: len(steps)] and len(steps) <= 4  # stops within one step
    assert gf.filled_caches() == [] and len(KEPT_CACHES) == 0
    monkeypatch.undo()
    run_graph(loaded)  # the next run works


def test_validation_errors_are_readable(loaded, models_root):
    assert "not in the diffusion_models folders" in QI21ModelLoader.validate_inputs(model_name="missing.safetensors")
    assert "not in the vae folders" in QI21VAELoader.validate_inputs(vae_name="nope.safetensors")
    assert "width = 16" in QI21Sampler.validate_inputs(width=16, height=0)
    assert "height = 8192" in QI21TurboSampler.validate_inputs(width=0, height=8192)
    assert "steps = 0" in QI21Sampler.validate_inputs(steps=0)
    assert "cfg = 0.5" in QI21Sampler.validate_inputs(cfg=0.5)
    assert QI21Sampler.validate_inputs(width=1024, height=768) is True
    with pytest.raises(ValueError, match="empty"):
        QI21Reference.execute(loaded["vae"], torch.zeros(1, 0, 64, 3), 1024)
    refs = QI21Reference.execute(loaded["vae"], rgba_image(), 0)[0]
    eleven = refs * 10
    with pytest.raises(ValueError, match="at most 10"):
        QI21Reference.execute(loaded["vae"], rgba_image(), 0, references=eleven)
