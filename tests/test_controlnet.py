"""The Qwen-Image 2.1 Fun ControlNet Union: its three file layouts, the controlled forward against an independent
implementation of the published facts (diffusers' own blocks, hooked by hand here), and the claim that sets the pack
apart: with the control on, the prefix cache still gives what a run without it gives, step for step."""

import math

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21TransformerBlock

import controlnet_fixtures as cf
from dit_fixtures import make_case, reference_velocity
from qi21.demo import tiny_checkpoints as tiny
from qi21.model.encoders.conditioning import Conditioning
from qi21.model.encoders.control import control_latents
from qi21.model.features.control import apply_controlnet
from qi21.model.features.lora import apply_lora
from qi21.model.loaders.controlnet import load_controlnet
from qi21.model.loaders.safetensors_io import CheckpointError
from qi21.model.prefix_cache.kept_entries import PrefixCacheStore
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.sampling.loop import sample
from qi21.model.transformer.controlnet import percent_to_sigma
from qi21.model.transformer.dit import DiTConfig, QwenImage21DiT
from qi21.model.vae.autoencoder import QwenImage21VAE

GRID = (4, 6)  # target latent cells (64 x 96 px)
WIDTH, HEIGHT = GRID[1] * 16, GRID[0] * 16
SIGMAS = torch.linspace(1.0, 0.0, 9)  # 8 steps; [0.2, 0.8] leaves steps out at both ends
TOL = 1e-5


@pytest.fixture(scope="module")
def pair():
    return cf.tiny_pair4()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model_patches")
    state = cf.alibaba_state()
    int8, twin = cf.int8_state(state)
    return {"alibaba": cf.write(folder / "fun_controlnet_original.safetensors", state),
            "comfy": cf.write(folder / "qwen_image_2.1_fun_controlnet_union_bf16.safetensors", cf.fused_state(state)),
            "int8": cf.write(folder / "qwen_image_2.1_fun_controlnet_union_int8_convrot.safetensors", int8),
            "twin": cf.write(folder / "dequantized.safetensors", twin), "state": state}


@pytest.fixture(scope="module")
def net(files):
    return load_controlnet(files["alibaba"])


@pytest.fixture(scope="module")
def vae():
    torch.manual_seed(11)
    return QwenImage21VAE(tiny.TINY_VAE).eval()


def images(seed=5):
    g = torch.Generator().manual_seed(seed)
    control = torch.rand(1, 40, 56, 3, generator=g)  # another size: stretched to the target
    inpaint = torch.rand(2, HEIGHT, WIDTH, 4, generator=g)  # RGBA batch: first image, RGB
    mask = torch.zeros(1, 30, 44)
    mask[:, 5:20, 10:30] = 1.0
    return control, inpaint, mask


def conditioning(seed=3, refs=((4, 4),), text=(5, 3)):
    g = torch.Generator().manual_seed(seed)
    slots = []
    for run, shape in zip(text, list(refs) + [None]):
        slots += [False] * run + ([True] * (shape[0] * shape[1] // 4) if shape else [])
    tokens = sum(h * w for h, w in refs)
    return Conditioning(torch.randn(len(slots), 48, generator=g), torch.tensor(slots),
                        torch.randn(tokens, 64, generator=g) if tokens else None, tuple(refs))


def controlled(model, net, vae, strength=1.0, window=(0.0, 1.0), which=("control_image",)):
    control, inpaint, mask = images()
    given = {"control_image": control, "inpaint_image": inpaint, "mask": mask}
    given = {k: v for k, v in given.items() if k in which}
    hint_for = lambda grid: control_latents(vae, grid, **given)  # noqa: E731
    return apply_controlnet(model, net, hint_for, strength, *window, inputs=tuple(given))


# -- files -------------------------------------------------------------------------------------------------------
def test_the_three_layouts_load_and_the_two_float_ones_are_the_same_net(files, net):
    fused = load_controlnet(files["comfy"])
    assert (net.layout, fused.layout) == ("alibaba", "comfy")
    assert net.config.num_blocks == 2 and net.config.width == 64 and net.config.control_in_dim == 129
    for (name, a), (_, b) in zip(net.state_dict().items(), fused.state_dict().items()):
        assert torch.equal(a, b), name
    # fused gate_up is [gate; up]: our gate_up rows are the file's gate_layer then proj
    state = files["state"]
    torch.testing.assert_close(net.blocks[1].gate_up.weight[:192], state["control_blocks.1.img_mlp.gate_layer.weight"])
    assert torch.equal(net.blocks[0].before_proj_bias, state["control_blocks.0.before_proj.bias"])


def test_int8_convrot_file_runs_quantized_close_to_its_dequantized_twin(files, pair):
    int8, twin = load_controlnet(files["int8"]), load_controlnet(files["twin"])
    assert int8.layout == "comfy int8"
    assert type(int8.blocks[0].qkv).__name__ == "QuantLinear" and int8.blocks[0].qkv.segments[0].fmt == \
        "int8_tensorwise"
    assert type(int8.control_img_in).__name__ == "Linear"  # control_img_in, biases and norms stay float
    _, model = pair
    hint = lambda grid: torch.randn(grid[0] * grid[1], 129, generator=torch.Generator().manual_seed(0))  # noqa: E731
    cond = conditioning()
    got, expected = (sample(apply_controlnet(model, n, hint), cond, sigmas=SIGMAS[:3], width=WIDTH, height=HEIGHT)
                     .latents for n in (int8, twin))
    rel = ((got - expected).abs().max() / expected.abs().max()).item()
    assert rel < 0.02, rel  # W8A8: activations are quantized per row too


def test_a_bf16_net_beside_an_fp32_model_keeps_its_weights_and_computes_in_the_models_dtype(files, net, pair):
    _, model = pair
    half = load_controlnet(files["alibaba"], weight_dtype="bf16")
    assert half.compute_dtype == torch.bfloat16 and half.blocks[0].qkv.weight.dtype == torch.bfloat16
    hint = lambda grid: torch.randn(grid[0] * grid[1], 129, generator=torch.Generator().manual_seed(0))  # noqa: E731
    cond = conditioning()
    on = sample(apply_controlnet(model, half, hint), cond, sigmas=SIGMAS[:3], width=WIDTH, height=HEIGHT)
    full = sample(apply_controlnet(model, net, hint), cond, sigmas=SIGMAS[:3], width=WIDTH, height=HEIGHT)
    assert half.blocks[0].qkv.weight.dtype == torch.bfloat16  # no fp32 copy of the net was kept
    # the control's K/V are more layers of the model's fp32 cache: 1 control block beside 2 base blocks
    assert on.latents.dtype == torch.float32 and on.report["control"]["cache_bytes"]["control"] * 2 == \
        on.report["control"]["cache_bytes"]["base"]
    assert ((on.latents - full.latents).abs().max() / full.latents.abs().max()).item() < 0.02


def test_other_patches_and_models_are_refused_by_name(tmp_path, pair):
    zimage = cf.write(tmp_path / "z_image_fun.safetensors", {"control_all_x_embedder.2-1.weight": torch.zeros(4, 4)})
    with pytest.raises(CheckpointError, match="Z-Image Fun ControlNet"):
        load_controlnet(zimage)
    dit = cf.write(tmp_path / "dit.safetensors", tiny.dit_state_dict(tiny.TINY_DIT))
    with pytest.raises(CheckpointError, match="Qwen-Image 2.1 DiT.*not the Qwen-Image 2.1 Fun ControlNet"):
        load_controlnet(dit)
    broken = dict(cf.alibaba_state())
    del broken["control_blocks.1.attn.to_k.weight"]
    with pytest.raises(CheckpointError, match="missing.*to_k"):
        load_controlnet(cf.write(tmp_path / "broken.safetensors", broken))


def test_a_net_for_another_model_is_refused(net):
    with torch.device("meta"):
        three = QwenImage21DiT(DiTConfig(num_layers=3, num_heads=2, head_dim=32, context_in_dim=48))
        wide = QwenImage21DiT(DiTConfig(num_layers=4, num_heads=4, head_dim=32, context_in_dim=48))
    with pytest.raises(ValueError, match="2 blocks does not fit a DiT of 3"):
        apply_controlnet(three, net, lambda grid: None)
    with pytest.raises(ValueError, match="2 heads of 32.*the model 4 of 32"):
        apply_controlnet(wide, net, lambda grid: None)


# -- the forward against the facts ------------------------------------------------------------------------------
def oracle_velocity(reference, state, kwargs, t, hint, strength):
    """diffusers' transformer with the Fun ControlNet written out from docs/controlnet.md by hooks: X kept before
    block 0; after base block 2k control block k (a diffusers block with the file's weights and the base block's
    own arguments) runs on c_k, c_0 = before_proj(J) + X with J = control_img_in(hint) on the target rows and 0
    elsewhere; strength * after_proj_k(c_{k+1}) is added to every row."""
    blocks = []
    for k in range(cf.BLOCKS):
        block = QwenImage21TransformerBlock(cf.WIDTH, 2, cf.HEAD_DIM, mlp_ratio=3).eval()
        prefix = f"control_blocks.{k}."
        block.load_state_dict({key[len(prefix):]: v for key, v in state.items()
                               if key.startswith(prefix) and "_proj." not in key})
        blocks.append(block)
    linear = lambda x, name: x @ state[name + ".weight"].T + state[name + ".bias"]  # noqa: E731
    seen, handles = {}, []

    def keep_x(module, args, kw):
        seen["x"], seen["kw"] = kw["hidden_states"].clone(), kw

    def run_control(k):
        def hook(module, args, kw, out):
            if k == 0:
                j = torch.zeros_like(seen["x"])
                j[:, -hint.shape[0]:] = linear(hint, "control_img_in")
                seen["c"] = linear(j, "control_blocks.0.before_proj") + seen["x"]
            seen["c"] = blocks[k](**{**kw, "hidden_states": seen["c"]})
            return out + strength * linear(seen["c"], f"control_blocks.{k}.after_proj")
        return hook

    handles.append(reference.transformer_blocks[0].register_forward_pre_hook(keep_x, with_kwargs=True))
    for k in range(cf.BLOCKS):
        handles.append(reference.transformer_blocks[2 * k].register_forward_hook(run_control(k), with_kwargs=True))
    try:
        return reference_velocity(reference, kwargs, t)
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("batch, strength", [(1, 1.0), (2, 0.5)])
def test_uncached_controlled_forward_equals_the_facts_written_out(pair, files, net, batch, strength):
    reference, model = pair
    kwargs, prefixes, target = make_case([(4, 4)], GRID, (5, 3), batch=batch)
    hint = torch.randn(GRID[0] * GRID[1], 129, generator=torch.Generator().manual_seed(2))
    patched = apply_controlnet(model, net, lambda grid: hint, strength)
    t = torch.full((batch,), 0.6)
    with torch.no_grad():
        expected = oracle_velocity(reference, files["state"], kwargs, t, hint, strength)
        got = patched(target, t, prefixes, list(range(batch)),  # make_case gives each sample its own prompt
                      hooks=[patched.options.control.stream(GRID, patched.config.num_layers, "cpu", torch.float32)])
        plain = model(target, t, prefixes, list(range(batch)))
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)
    assert (got - plain).abs().max() > 0.1  # the control changes the result


# -- the prefix cache with the control on ----------------------------------------------------------------------
CASES = {
    "control image": dict(which=("control_image",)),
    "mask + inpaint": dict(which=("inpaint_image", "mask")),
    "both, strength 0.5": dict(which=("control_image", "inpaint_image", "mask"), strength=0.5),
    "window 0.2-0.8": dict(which=("control_image",), window=(0.2, 0.8)),
    "cfg": dict(which=("control_image", "mask"), cfg=3.0),
    "batch 2": dict(which=("control_image",), batch=2),
    "lora": dict(which=("control_image", "inpaint_image", "mask"), lora=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cache_on_equals_cache_off_per_step_and_for_the_loop(pair, net, vae, case, tmp_path):
    _, model = pair
    options = dict(CASES[case])
    cfg, batch, lora = options.pop("cfg", 1.0), options.pop("batch", 1), options.pop("lora", False)
    patched = controlled(model, net, vae, **options)
    if lora:
        path = tmp_path / "lora.safetensors"
        from safetensors.torch import save_file
        save_file(tiny.lora_state_dict(model.config, seed=4), str(path))
        patched = apply_lora(patched, path, 0.8)
    negative = conditioning(seed=9, text=(4, 6)) if cfg > 1 else None
    runs = {}
    for cache in (True, False):
        steps = []
        with torch.no_grad():
            result = sample(patched, conditioning(), sigmas=SIGMAS, width=WIDTH, height=HEIGHT, seed=1,
                            batch_size=batch, negative=negative, cfg=cfg, prefix_cache=cache,
                            callback=lambda info, steps=steps: steps.append(info.latents.clone()))
        runs[cache] = (result, steps)
    (on, on_steps), (off, off_steps) = runs[True], runs[False]
    for i, (a, b) in enumerate(zip(on_steps, off_steps)):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL, msg=f"step {i + 1}")
    torch.testing.assert_close(on.latents, off.latents, rtol=0, atol=TOL)
    report = on.report["control"]
    assert report["strength"] == options.get("strength", 1.0)
    assert report["window"] == list(options.get("window", (0.0, 1.0)))
    assert report["file"] == "fun_controlnet_original.safetensors"
    streams = report["cache_bytes"]
    assert streams["control"] * 2 == streams["base"]  # 2 control blocks beside 4 base blocks: +50 %
    partial = 0 < report["active_steps"] < 8
    assert ("base_uncontrolled" in streams) == partial and partial == (case == "window 0.2-0.8")
    assert on.report["cache_bytes"] == sum(streams.values())
    plain = sample(model, conditioning(), sigmas=SIGMAS, width=WIDTH, height=HEIGHT, seed=1, batch_size=batch,
                   negative=negative, cfg=cfg) if not lora else None
    if plain is not None:
        assert (plain.latents - on.latents).abs().max() > 1e-3  # the control did something


def test_window_follows_core_sigma_rule(pair, net, vae):
    _, model = pair
    patched = controlled(model, net, vae, window=(0.2, 0.8))
    start, end = percent_to_sigma(0.2), percent_to_sigma(0.8)
    assert math.isclose(start, math.exp(0.69) / (math.exp(0.69) + 0.25))
    assert percent_to_sigma(0.0) == 1.0 and percent_to_sigma(1.0) == 0.0
    active = [patched.options.control.active(s) for s in SIGMAS[:-1].tolist()]
    assert active == [end <= s <= start for s in SIGMAS[:-1].tolist()]
    assert active[0] is False and active[-1] is False and any(active)


def test_kept_cache_keys_on_net_and_strength_not_on_the_image(pair, net, vae):
    _, model = pair
    store = PrefixCacheStore(budget_bytes=None)
    cond = conditioning()
    run = lambda m: sample(m, cond, sigmas=SIGMAS[:4], width=WIDTH, height=HEIGHT, keep_cache=True,  # noqa: E731
                           store=store)
    first = controlled(model, net, vae, which=("control_image",))
    with torch.no_grad():
        assert run(first).report["cache"] == "miss"
        other_image = controlled(model, net, vae, which=("control_image", "mask"))  # a new copy, same net + strength
        hit = run(other_image)
        assert hit.report["cache"] == "hit"
        fresh = sample(other_image, cond, sigmas=SIGMAS[:4], width=WIDTH, height=HEIGHT)
        torch.testing.assert_close(hit.latents, fresh.latents, rtol=0, atol=TOL)
        assert run(controlled(model, net, vae, strength=0.5)).report["cache"] == "miss"
        assert run(model).report["cache"] == "miss"  # the plain model never reads a controlled prefix
    keys = [key for key, _ in store._entries.values()]  # (model, dtype, [control], loras)
    assert len(keys) == 3 and {key[2][2] for key in keys if len(key) == 4} == {1.0, 0.5}
    assert len({key[0] for key in keys}) == 1  # every key names the model the control was applied to


def test_strength_zero_or_no_input_returns_the_model_itself(pair, net):
    _, model = pair
    assert apply_controlnet(model, net, lambda grid: None, 0.0) is model
    assert apply_controlnet(model, net, lambda grid: None, 1.0, inputs=()) is model
    copy = apply_controlnet(model, net, lambda grid: None, 1.0)
    assert copy is not model and getattr(model, "control", None) is None
    shared = {id(p) for p in model.parameters()}
    assert all(id(p) in shared for name, p in copy.named_parameters() if not name.startswith("control_net."))
    with pytest.raises(ValueError, match="start <= end"):
        apply_controlnet(model, net, lambda grid: None, 1.0, 0.8, 0.2)


# -- the 129-channel control latent ---------------------------------------------------------------------------
def test_control_latent_channels_follow_core(vae):
    import torch.nn.functional as F

    control, inpaint, mask = images()
    size = (HEIGHT, WIDTH)
    with torch.no_grad():
        got = control_latents(vae, GRID, control, inpaint, mask).T.reshape(129, *GRID)
        none = control_latents(vae, GRID, control_image=control).T.reshape(129, *GRID)
        norm = lambda px: vae.latent_format.normalize(vae.encode(2 * px - 1).float())[0]  # noqa: E731
        stretched = F.interpolate(control.movedim(-1, 1), size=size, mode="bicubic")
        regen = (F.interpolate(mask[:, None], size=size, mode="bilinear") >= 0.5).float()
        grey = F.interpolate(inpaint[:1, ..., :3].movedim(-1, 1), size=size, mode="bicubic") * (1 - regen) + 0.5 * regen
        expected_keep = 1 - F.interpolate(regen, size=GRID, mode="nearest")[0, 0]
        torch.testing.assert_close(got[:64], norm(stretched), rtol=0, atol=1e-5)
        torch.testing.assert_close(got[64], expected_keep, rtol=0, atol=0)
        torch.testing.assert_close(got[65:], norm(grey), rtol=0, atol=1e-5)
    assert 0 < got[64].sum() < got[64].numel()  # the mask keeps part of the image
    assert torch.equal(none[64], torch.zeros(GRID)) and torch.equal(none[65:], torch.zeros(64, *GRID))
    ignored = control_latents(vae, GRID, inpaint_image=inpaint)  # no mask: core drops the inpaint image
    assert torch.equal(ignored, torch.zeros(GRID[0] * GRID[1], 129))


# -- the nodes -------------------------------------------------------------------------------------------------
def test_nodes_load_apply_sample_and_report(models_root):
    import graph_fixtures as gf
    from qi21.nodes.controlnet import QI21ControlNetApply, QI21ControlNetLoader
    from qi21.nodes.samplers import QI21TurboSampler

    loaded = gf.load("turbo", "vae")
    net = QI21ControlNetLoader.execute(tiny.CONTROLNET_FILE, "fp32")[0]
    assert net.layout == "comfy" and net.source == tiny.CONTROLNET_FILE
    assert "not in the model_patches folders" in QI21ControlNetLoader.validate_inputs(control_net_name="x.sft")
    control, inpaint, mask = images()
    apply = lambda **kw: QI21ControlNetApply.execute(loaded["turbo"], net, loaded["vae"], **kw)[0]  # noqa: E731
    assert apply(strength=1.0) is loaded["turbo"]  # no control image and no mask: unchanged, as core does
    assert "after end_percent" in QI21ControlNetApply.validate_inputs(start_percent=0.9, end_percent=0.1)
    model = apply(strength=0.8, control_image=control, mask=mask)
    cond = gf.synthetic_conditioning()
    out = QI21TurboSampler.execute(model, cond, 0, 64, 64, 1, sigmas=SIGMAS[::4].clone())
    report = out.ui["qi21_report"][0]
    assert report["cache"] == "miss" and report["control"]["file"] == tiny.CONTROLNET_FILE
    assert report["control"]["strength"] == 0.8 and report["control"]["inputs"] == ["control_image", "mask"]
    assert report["control"]["cache_bytes"]["control"] * 2 == report["control"]["cache_bytes"]["base"]  # 1 of 2
    samples = out[0]["samples"]
    plain = QI21TurboSampler.execute(loaded["turbo"], cond, 0, 64, 64, 1, sigmas=SIGMAS[::4].clone())[0]["samples"]
    assert torch.isfinite(samples).all() and (samples - plain).abs().max() > 1e-3


def test_an_interrupt_mid_window_frees_both_streams_caches(pair, net):
    _, model = pair
    made = []

    def new_cache():
        made.append(PrefixKVCache())
        return made[-1]

    def interrupt(info):
        if info.step == 3:
            raise KeyboardInterrupt

    hint = lambda grid: torch.zeros(grid[0] * grid[1], 129)  # noqa: E731
    patched = apply_controlnet(model, net, hint, 1.0, 0.2, 0.8)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        sample(patched, conditioning(), sigmas=SIGMAS, width=WIDTH, height=HEIGHT, callback=interrupt,
               new_cache=new_cache)
    assert len(made) == 2 and not any(cache.filled for cache in made)  # plain, controlled (base + control layers)
