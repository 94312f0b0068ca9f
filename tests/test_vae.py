"""The Qwen-Image 2.1 VAE against diffusers' `AutoencoderKLQwenImage21` (the oracle), its tiling, and its loaders.

Tiny random models with the released structure (5 stages, 16x compression, 64 latent channels, residual
stages, temporal stages 1-3) but 8/12 channels wide, fp32 on CPU. Our single-frame network must give
diffusers' 1-frame output; the tiling must stay close to one pass with bounded memory; both file layouts must
load to the same weights, and every other kind of file must be refused with an error that says what it is.
"""

import inspect
import json
import re
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLQwenImage21
from safetensors.torch import save_file
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from qi21.model.loaders.vae import comfy_to_diffusers_key, load_vae, vae_from_state_dict
from qi21.model.vae.autoencoder import LATENTS_MEAN, LATENTS_STD, VAETiling, _run_tiled, _tile_spans

# The released structure, narrow.
TINY = dict(base_dim=8, decoder_base_dim=12, z_dim=64, dim_mult=[1, 2, 4, 8, 8], num_res_blocks=2,
            temperal_downsample=[False, True, True, True])
# Another stage plan: one resnet per stage, a temporal first stage, and a 32->32 temporal stage whose
# AvgDown3D groups span a whole [zero frame | frame] block (groups of 8, where the release has 4).
OTHER = dict(base_dim=8, decoder_base_dim=8, z_dim=64, dim_mult=[1, 2, 4, 4, 4], num_res_blocks=1,
             temperal_downsample=[True, False, True, True])


def reference_vae(kwargs: dict, seed: int = 0) -> AutoencoderKLQwenImage21:
    """diffusers' VAE with random weights; gammas and biases are randomised too, so a misplaced one shows."""
    torch.manual_seed(seed)
    model = AutoencoderKLQwenImage21(**kwargs).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gamma"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.05 * torch.randn_like(param))
    return model


def reference_encode(model, images):
    return model.encode(images[:, :, None]).latent_dist.mode()[:, :, 0]  # argmax, as the pipeline samples


def reference_decode(model, latents):
    return model.decode(latents[:, :, None]).sample[:, :, 0]


@pytest.fixture(scope="module")
def pair():
    """(diffusers model, ours with the same weights via the in-memory diffusers layout)."""
    reference = reference_vae(TINY)
    return reference, vae_from_state_dict(reference.state_dict())


@pytest.fixture(scope="module")
def other_pair():
    reference = reference_vae(OTHER, seed=1)
    return reference, vae_from_state_dict(reference.state_dict())


# -- numerics against diffusers -------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [(64, 96), (96, 160), (48, 80)])
def test_encode_matches_diffusers(pair, size):
    reference, ours = pair
    images = torch.rand(2, 4, *size) * 2 - 1
    with torch.no_grad():
        expected, got = reference_encode(reference, images), ours.encode(images)
    assert got.shape == (2, 64, size[0] // 16, size[1] // 16)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("size", [(64, 96), (96, 160), (48, 80)])
def test_decode_matches_diffusers(pair, size):
    reference, ours = pair
    latents = torch.randn(2, 64, size[0] // 16, size[1] // 16)
    with torch.no_grad():
        expected, got = reference_decode(reference, latents), ours.decode(latents)
    assert got.shape == (2, 4, *size)
    assert got.abs().max() <= 1.0 and (got.abs() == 1.0).any()  # clamped, as diffusers clamps
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_another_stage_plan_matches_diffusers(other_pair):
    reference, ours = other_pair
    assert ours.config.temporal_downsample == (True, False, True, True)  # read from the time_conv keys
    images, latents = torch.rand(1, 4, 64, 96) * 2 - 1, torch.randn(1, 64, 4, 6)
    with torch.no_grad():
        torch.testing.assert_close(ours.encode(images), reference_encode(reference, images), rtol=0, atol=1e-4)
        torch.testing.assert_close(ours.decode(latents), reference_decode(reference, latents), rtol=0, atol=1e-4)


def test_bf16_matches_diffusers_in_bf16():
    """Half precision takes diffusers' fp32 RMS-norm path (here slab by slab), so bf16 agrees too."""
    reference = reference_vae(TINY).to(torch.bfloat16)
    ours = vae_from_state_dict(reference.state_dict(), weight_dtype="bf16")
    images, latents = torch.rand(1, 4, 32, 48) * 2 - 1, torch.randn(1, 64, 2, 3)
    with torch.no_grad():
        got_z, got_x = ours.encode(images), ours.decode(latents)
        want_z = reference_encode(reference, images.bfloat16())
        want_x = reference_decode(reference, latents.bfloat16())
    assert got_z.dtype == got_x.dtype == torch.bfloat16
    torch.testing.assert_close(got_z.float(), want_z.float(), rtol=0, atol=2e-2)
    torch.testing.assert_close(got_x.float(), want_x.float(), rtol=0, atol=2e-2)


def test_rgb_images_get_an_opaque_alpha(pair):
    reference, ours = pair
    rgb = torch.rand(2, 3, 64, 96) * 2 - 1
    rgba = torch.cat([rgb, torch.ones(2, 1, 64, 96)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(ours.encode(rgb), ours.encode(rgba), rtol=0, atol=0)
        torch.testing.assert_close(ours.encode(rgb), reference_encode(reference, rgba), rtol=0, atol=1e-4)


def test_normalisation_uses_the_published_statistics(pair):
    defaults = inspect.signature(AutoencoderKLQwenImage21.__init__).parameters
    assert list(LATENTS_MEAN) == defaults["latents_mean"].default
    assert list(LATENTS_STD) == defaults["latents_std"].default
    _, ours = pair
    z = torch.randn(2, 64, 3, 5) * 4
    mean, std = torch.tensor(LATENTS_MEAN).view(1, 64, 1, 1), torch.tensor(LATENTS_STD).view(1, 64, 1, 1)
    latent_format = ours.latent_format
    torch.testing.assert_close(latent_format.normalize(z), (z - mean) / std, rtol=0, atol=0)  # the pipeline's formula
    torch.testing.assert_close(latent_format.denormalize(latent_format.normalize(z)), z, rtol=0, atol=1e-5)


def test_bad_inputs_are_refused_with_the_fix(pair):
    _, ours = pair
    with pytest.raises(ValueError, match=r"divisible by 16; got 40x96\. Resize or crop to 32x96"):
        ours.encode(torch.zeros(1, 4, 40, 96))
    with pytest.raises(ValueError, match="RGBA or"):
        ours.encode(torch.zeros(1, 2, 32, 32))
    with pytest.raises(ValueError, match="Denormalize"):
        ours.decode(torch.zeros(1, 16, 2, 2))


# -- tiling ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length,tile,overlap", [
    pytest.param(5, 8, 2, id="axis shorter than a tile"),
    pytest.param(24, 8, 4, id="24 by tiles of 8, overlap 4"),
    pytest.param(57, 16, 8, id="57 by tiles of 16, overlap 8"),
    pytest.param(100, 64, 16, id="100 by tiles of 64, overlap 16"),
    pytest.param(40, 16, 0, id="no overlap"),
])
def test_tile_spans_cover_the_axis_with_at_least_the_overlap(length, tile, overlap):
    spans = _tile_spans(length, tile, overlap)
    assert spans[0][0] == 0 and spans[-1][1] == length
    assert all(end - start == min(tile, length) for start, end in spans)
    assert all(a_end - b_start >= overlap for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_tiled_blending_is_exact_for_a_local_function():
    """Where each tile sees all it needs (the margin dropped from each overlap exceeds the function's reach),
    tiles and blends must reproduce one pass exactly, in both directions (pixels out, latents out)."""
    grid = (20, 36)
    weight = torch.randn(4, 1, 3, 3)

    def to_pixels(z):  # (B, 8, h, w) -> (B, 4, 16h, 16w), reach 1 px
        up = F.interpolate(torch.tanh(z[:, :4]), scale_factor=16.0, mode="nearest")
        return F.conv2d(up, weight, padding=1, groups=4)

    def to_cells(x):  # (B, 4, 16h, 16w) -> (B, 4, h, w), reach 0 cells
        return F.avg_pool2d(x * x, 16)

    tiling = VAETiling(tile=8, overlap=4)  # 1-cell margin = 16 px >= 1 px reach
    z = torch.randn(2, 8, *grid)
    core = (..., slice(1, -1), slice(1, -1))  # the image border itself is zero-padded either way
    tiled = _run_tiled(to_pixels, z, grid, 1, 16, 4, tiling)
    torch.testing.assert_close(tiled[core], to_pixels(z)[core], rtol=0, atol=1e-5)
    x = torch.randn(2, 4, grid[0] * 16, grid[1] * 16)
    torch.testing.assert_close(_run_tiled(to_cells, x, grid, 16, 1, 4, tiling), to_cells(x), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def local_vae():
    """A tiny VAE whose residual branches and mid-block attention are scaled to 5%.

    A trained VAE's output depends mostly on nearby latents; random full-strength weights do not (the
    decoder's receptive field is ~18 latent cells, and the mid-block attention is global), and no overlap
    short of the whole image would bring tiles within 2e-2 of one pass. Damping the residual branches
    (as SkipInit-style initialisations do) gives a network with a local effective receptive field while
    every path stays live; the parameter-free shortcuts carry the signal, so a misplaced tile is O(1) wrong.
    """
    model = vae_from_state_dict(reference_vae(TINY).state_dict())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".conv2." in name or ".attentions.0.proj." in name:
                param.mul_(0.05)
    return model


def test_tiled_decode_of_a_wide_image_stays_within_2e_2_of_one_pass(local_vae):
    torch.manual_seed(1)
    latents = torch.randn(1, 64, 16, 32)  # 256 x 512 px: 3 tiles of 256 px, 128 px overlaps
    tiling = VAETiling(tile=16, overlap=8)
    with torch.no_grad():
        whole = local_vae.decode(latents, tiled=False)
        tiled = local_vae.decode(latents, tiled=True, tiling=tiling)
    assert len(_tile_spans(32, 16, 8)) == 3
    assert (tiled - whole).abs().max() <= 2e-2
    torch.testing.assert_close(tiled.mean(), whole.mean(), rtol=0, atol=1e-3)

    with torch.no_grad():  # and back: tiled encode of the same picture
        tiled_latents = local_vae.encode(whole, tiled=True, tiling=tiling)
        assert (tiled_latents - local_vae.encode(whole, tiled=False)).abs().max() <= 2e-2


class PeakLiveBytes(TorchDispatchMode):
    """A tracking allocator for CPU: the largest total size of tensor storages alive at once.

    Every aten op's outputs are recorded with a weak reference to their storage; after each op, storages that
    died are dropped and the live total is compared with the peak. Tensors that existed before (weights,
    inputs) are not counted, so the number is the activation memory of the call.
    """

    def __init__(self):
        super().__init__()
        self.live, self.peak = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.live = {ptr: entry for ptr, entry in self.live.items() if not entry[0].expired()}
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                self.live.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self.live.values()))
        return out


def peak_bytes(fn) -> int:
    with torch.no_grad(), PeakLiveBytes() as tracker:
        fn()
    return tracker.peak


def test_tiled_decode_memory_is_bounded_by_one_tile(other_pair):
    """Tiled peak = one tile's activations + the fp32 output being blended (20 bytes per pixel); it does not
    grow with the image beyond that, while one pass grows with it."""
    _, model = other_pair
    tiling = VAETiling(tile=4, overlap=2)
    one_tile = peak_bytes(lambda: model.decode(torch.randn(1, 64, 4, 4), tiled=False))
    for width in (8, 16):  # 3 and 7 tiles wide
        latents = torch.randn(1, 64, 4, width)
        blend_buffers = (4 + 1) * 4 * (4 * 16) * (width * 16)  # fp32 RGBA sum + fp32 weight sum
        tiled = peak_bytes(partial(model.decode, latents, tiled=True, tiling=tiling))
        assert tiled <= 1.1 * one_tile + blend_buffers
    assert peak_bytes(lambda: model.decode(latents, tiled=False)) > 3 * one_tile  # 4x16 cells in one pass


def test_tiled_none_switches_to_tiles_above_the_threshold(other_pair):
    _, model = other_pair
    calls = []
    hook = model.decoder.register_forward_pre_hook(lambda module, args: calls.append(tuple(args[0].shape[-2:])))
    tiling = VAETiling(tile=4, overlap=2, auto_above=4 * 8)
    try:
        with torch.no_grad():
            for shape, tiled, expected in [((4, 8), None, [(4, 8)]), ((4, 10), None, [(4, 4)] * 4),
                                           ((4, 10), False, [(4, 10)]), ((4, 4), True, [(4, 4)])]:
                calls.clear()
                model.decode(torch.randn(1, 64, *shape), tiled=tiled, tiling=tiling)
                assert calls == expected, (shape, tiled)
    finally:
        hook.remove()


# -- loading ---------------------------------------------------------------------------------------------------
def wan_name(name: str, num_res_blocks: int) -> str:
    """ComfyUI's (Wan 2.2) name for a diffusers VAE tensor, written from docs/checkpoints.md and the
    `nn.Sequential` indices of ComfyUI's `vae2_2.py`, independently of the loader's rename rules."""
    residual = {"norm1": "residual.0", "conv1": "residual.2", "norm2": "residual.3", "conv2": "residual.6",
                "conv_shortcut": "shortcut"}
    part = name.split(".")
    if part[0] in ("quant_conv", "post_quant_conv"):
        return {"quant_conv": "conv1", "post_quant_conv": "conv2"}[part[0]] + "." + part[1]
    side, block, rest = part[0], part[1], part[2:]
    if block in ("conv_in", "norm_out", "conv_out"):
        return f"{side}." + {"conv_in": "conv1", "norm_out": "head.0", "conv_out": "head.2"}[block] + "." + rest[-1]
    if block == "mid_block":
        if rest[0] == "attentions":
            return f"{side}.middle.1." + ".".join(rest[2:])
        return f"{side}.middle.{2 * int(rest[1])}.{residual[rest[2]]}.{rest[-1]}"
    stage = "downsamples" if block == "down_blocks" else "upsamples"
    if rest[1] in ("downsampler", "upsampler"):
        slot = num_res_blocks if side == "encoder" else num_res_blocks + 1
        return f"{side}.{stage}.{rest[0]}.{stage}.{slot}." + ".".join(rest[2:])
    return f"{side}.{stage}.{rest[0]}.{stage}.{rest[2]}.{residual[rest[3]]}.{rest[-1]}"


def comfy_state_dict(reference: AutoencoderKLQwenImage21) -> dict[str, torch.Tensor]:
    """The reference's weights as ComfyUI's single file holds them: Wan names, causal convs 5-D."""
    out = {}
    for name, tensor in reference.state_dict().items():
        causal = name.endswith(".weight") and tensor.ndim == 4 and not re.search(r"resample\.1|to_qkv|\.proj\.", name)
        out[wan_name(name, reference.config.num_res_blocks)] = tensor.unsqueeze(2).contiguous() if causal else tensor
    return out


@pytest.fixture(scope="module")
def files(pair, tmp_path_factory):
    """The tiny model written in both layouts: a diffusers model folder and a ComfyUI single file."""
    reference, _ = pair
    root = tmp_path_factory.mktemp("vae_files")
    vae_dir = root / "Qwen-Image-2.1" / "vae"
    vae_dir.mkdir(parents=True)
    save_file(reference.state_dict(), str(vae_dir / "diffusion_pytorch_model.safetensors"))
    config = {"_class_name": "AutoencoderKLQwenImage21", **dict(reference.config)}
    (vae_dir / "config.json").write_text(json.dumps(config))
    comfy = root / "qwen_image_2.1_vae_bf16.safetensors"
    save_file(comfy_state_dict(reference), str(comfy))
    return {"root": root, "diffusers": vae_dir, "comfy": comfy}


def test_both_layouts_load_to_the_same_weights_and_outputs(pair, files):
    reference, ours = pair
    from_comfy = load_vae(files["comfy"], weight_dtype="fp32")
    from_diffusers = load_vae(files["root"] / "Qwen-Image-2.1", weight_dtype="fp32")  # model root -> vae/
    assert (from_comfy.source.layout, from_diffusers.source.layout) == ("comfyui", "diffusers")
    assert from_comfy.config == from_diffusers.config == ours.config
    assert from_diffusers.source.config_from == "config.json"
    for name, tensor in from_diffusers.state_dict().items():
        assert torch.equal(tensor, from_comfy.state_dict()[name]), name
        assert torch.equal(tensor, ours.state_dict()[name]), name
    assert not any(p.requires_grad for p in from_comfy.parameters())
    assert not any(p.is_meta for p in from_comfy.state_dict().values())
    images, latents = torch.rand(1, 4, 64, 96) * 2 - 1, torch.randn(1, 64, 4, 6)
    with torch.no_grad():
        torch.testing.assert_close(from_comfy.encode(images), reference_encode(reference, images), rtol=0, atol=1e-4)
        torch.testing.assert_close(from_comfy.decode(latents), reference_decode(reference, latents), rtol=0, atol=1e-4)
        torch.testing.assert_close(from_comfy.decode(latents), from_diffusers.decode(latents), rtol=0, atol=0)


def test_config_is_inferred_from_shapes_when_no_config_exists(pair, files, tmp_path):
    _, ours = pair
    bare = tmp_path / "diffusion_pytorch_model.safetensors"
    bare.write_bytes((files["diffusers"] / "diffusion_pytorch_model.safetensors").read_bytes())
    for path in (bare, files["comfy"]):
        model = load_vae(path, weight_dtype="fp32")
        assert model.source.config_from == "tensor shapes"
        assert model.config == ours.config  # including the temporal stages and the published statistics


def test_default_dtype_is_the_files_and_fp16_warns(files):
    assert load_vae(files["comfy"]).dtype == torch.float32  # the tiny file is fp32
    assert load_vae(files["comfy"], weight_dtype="bf16").dtype == torch.bfloat16
    with pytest.warns(UserWarning, match="overflows fp16"):
        assert load_vae(files["comfy"], weight_dtype="fp16").dtype == torch.float16


@pytest.mark.parametrize("comfy,diffusers", [
    ("encoder.conv1.weight", "encoder.conv_in.weight"),
    ("encoder.downsamples.0.downsamples.0.residual.0.gamma", "encoder.down_blocks.0.resnets.0.norm1.gamma"),
    ("encoder.downsamples.1.downsamples.0.shortcut.weight", "encoder.down_blocks.1.resnets.0.conv_shortcut.weight"),
    ("encoder.downsamples.3.downsamples.1.residual.6.bias", "encoder.down_blocks.3.resnets.1.conv2.bias"),
    ("encoder.downsamples.1.downsamples.2.resample.1.weight", "encoder.down_blocks.1.downsampler.resample.1.weight"),
    ("encoder.downsamples.2.downsamples.2.time_conv.weight", "encoder.down_blocks.2.downsampler.time_conv.weight"),
    ("encoder.middle.1.to_qkv.weight", "encoder.mid_block.attentions.0.to_qkv.weight"),
    ("encoder.middle.2.residual.3.gamma", "encoder.mid_block.resnets.1.norm2.gamma"),
    ("encoder.head.0.gamma", "encoder.norm_out.gamma"),
    ("encoder.head.2.weight", "encoder.conv_out.weight"),
    ("conv1.weight", "quant_conv.weight"),
    ("conv2.bias", "post_quant_conv.bias"),
    ("decoder.conv1.weight", "decoder.conv_in.weight"),
    ("decoder.middle.0.residual.2.weight", "decoder.mid_block.resnets.0.conv1.weight"),
    ("decoder.middle.1.proj.bias", "decoder.mid_block.attentions.0.proj.bias"),
    ("decoder.upsamples.2.upsamples.0.shortcut.weight", "decoder.up_blocks.2.resnets.0.conv_shortcut.weight"),
    ("decoder.upsamples.4.upsamples.2.residual.6.weight", "decoder.up_blocks.4.resnets.2.conv2.weight"),
    ("decoder.upsamples.0.upsamples.3.resample.1.weight", "decoder.up_blocks.0.upsampler.resample.1.weight"),
    ("decoder.upsamples.2.upsamples.3.time_conv.bias", "decoder.up_blocks.2.upsampler.time_conv.bias"),
    ("decoder.head.2.weight", "decoder.conv_out.weight"),
])
def test_released_comfy_names_map_to_diffusers(comfy, diffusers):
    """Names of the released file (docs/checkpoints.md), at the released depth (2 and 3 resnets per stage)."""
    assert comfy_to_diffusers_key(comfy) == diffusers
    assert wan_name(diffusers, 2) == comfy


# -- files that are not this VAE --------------------------------------------------------------------------------
def _write(path, tensors):
    save_file({k: torch.zeros(v) for k, v in tensors.items()}, str(path))
    return path


def _dit(path):
    return _write(path, {"img_in.weight": (8, 64), "txt_in.text_norm.weight": (8,), "modulation.1.weight": (32, 8),
                         "transformer_blocks.0.attn.norm_q.weight": (8,), "proj_out.weight": (64, 8)})


def _text_encoder(path):
    return _write(path, {"model.embed_tokens.weight": (16, 8), "model.layers.0.self_attn.q_proj.weight": (8, 8),
                         "model.visual.deepstack_merger_list.0.norm.weight": (8,)})


def _wan21(path):
    return _write(path, {"decoder.middle.0.residual.0.gamma": (8, 1, 1, 1), "encoder.conv1.weight": (8, 3, 3, 3, 3),
                         "decoder.head.2.weight": (3, 8, 3, 3, 3), "conv2.weight": (16, 16, 1, 1, 1)})


def _qwen_image_1(path):  # diffusers' AutoencoderKLQwenImage: same mid block names, no residual stages
    return _write(path, {"decoder.mid_block.resnets.0.norm1.gamma": (8, 1, 1, 1),
                         "encoder.conv_in.weight": (8, 3, 3, 3, 3),
                         "decoder.up_blocks.0.resnets.0.conv1.weight": (8, 8, 3, 3, 3),
                         "post_quant_conv.weight": (16, 16, 1, 1, 1),
                         "decoder.up_blocks.0.upsamplers.0.resample.1.weight": (4, 8, 3, 3)})


def _pickle(path):
    torch.save({"encoder.conv_in.weight": torch.zeros(2, 2)}, str(path))
    return path


@pytest.mark.parametrize("make,name,found", [
    pytest.param(_dit, "qwen_image_2.1_bf16.safetensors", "DiT", id="DiT"),
    pytest.param(_text_encoder, "qwen3vl_8b_bf16.safetensors", "text encoder", id="text encoder"),
    pytest.param(_wan21, "qwen_image_vae.safetensors", "Wan 2.1 / Qwen-Image 1.x VAE", id="Wan 2.1 VAE"),
    pytest.param(_qwen_image_1, "diffusion_pytorch_model.safetensors", "Wan 2.1 / Qwen-Image 1.x VAE",
                 id="Qwen-Image 1.x VAE folder file"),
    pytest.param(_pickle, "vae.pt", "pickle", id="pickle"),
])
def test_other_files_are_refused_naming_what_they_are(make, name, found, tmp_path, monkeypatch):
    path = make(tmp_path / name)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a checkpoint was unpickled"))
    with pytest.raises(ValueError, match=re.escape(name)) as error:
        load_vae(path)
    assert found in str(error.value)


def test_a_truncated_file_is_refused(files, tmp_path):
    data = files["comfy"].read_bytes()
    cut = tmp_path / "qwen_image_2.1_vae_bf16.safetensors"
    cut.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ValueError, match=r"qwen_image_2\.1_vae_bf16\.safetensors is truncated"):
        load_vae(cut)


def test_a_video_vae_with_a_temporal_kernel_is_refused(pair, tmp_path):
    reference, _ = pair
    state = comfy_state_dict(reference)
    state["decoder.head.2.weight"] = state["decoder.head.2.weight"].repeat(1, 1, 3, 1, 1)
    path = tmp_path / "wan2.2_vae.safetensors"
    save_file(state, str(path))
    with pytest.raises(ValueError, match=r"wan2\.2_vae\.safetensors: decoder\.head\.2\.weight has temporal kernel 3"):
        load_vae(path)


def test_a_config_json_that_contradicts_the_weights_is_refused(files, tmp_path):
    folder = tmp_path / "vae"
    folder.mkdir()
    (folder / "diffusion_pytorch_model.safetensors").write_bytes(
        (files["diffusers"] / "diffusion_pytorch_model.safetensors").read_bytes())
    config = json.loads((files["diffusers"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "base_dim": 96}))
    with pytest.raises(ValueError, match="base_dim = 96 but the weights have 8"):
        load_vae(folder)
    (folder / "config.json").write_text(json.dumps({**config, "_class_name": "AutoencoderKLQwenImage"}))
    with pytest.raises(ValueError, match="not an AutoencoderKLQwenImage21"):
        load_vae(folder)
