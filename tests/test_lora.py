"""LoRA (model/loaders/lora.py, nodes/lora.py): every key format against diffusers' transformer with PEFT, on Base and
Turbo, at two strengths and chained; the prefix cache knows the LoRA; no second copy of the DiT; every refusal.

The oracle: tiny LoRA files are written by the tests in each key format; diffusers' `QwenImage21Transformer2DModel`
gets the same low-rank pairs through PEFT (`load_lora_adapter` + `set_adapters(weights=strengths)`), with
`alpha / rank` folded into the down matrix and ComfyUI's fused keys (`img_mlp.gate_up`, `attn.to_qkv`) given to
PEFT as the split modules they fuse (the same weights, which PEFT can express only that way). One test also
reads the files through diffusers' own key converter (`QwenImage21Pipeline.lora_state_dict`).
"""

import copy
import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import QwenImage21Pipeline, QwenImage21Transformer2DModel
from safetensors.torch import save_file

import graph_fixtures as gf
from dit_fixtures import make_case, reference_velocity, tiny_pair
from oracle import BASE_SCHEDULER, TURBO_SCHEDULER, diffusers_loop
from qi21.demo import tiny_checkpoints as tiny
from qi21.model.encoders.conditioning import Conditioning
from qi21.model.features.lora import apply_lora, lora_set
from qi21.model.layers.linear import Linear
from qi21.model.loaders.checkpoint import CheckpointError
from qi21.model.loaders.dit import load_dit
from qi21.model.loaders.lora import LoraError, read_lora
from qi21.model.prefix_cache.kept_entries import PrefixCacheStore
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.sampling.loop import initial_noise, record_of, sample
from qi21.model.sampling.schedule import TURBO_SIGMAS, base_sigmas, turbo_sigmas
from qi21.nodes import bridge
from qi21.nodes.loaders import QI21ModelLoader
from qi21.nodes.lora import QI21LoraLoader
from qi21.nodes.samplers import QI21Sampler, QI21TurboSampler

TOL = 1e-5
# loading a second adapter into the PEFT oracle is what the chained tests mean to do
pytestmark = pytest.mark.filterwarnings("ignore:Already found a `peft_config` attribute:UserWarning")
BLOCK_MODULES = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.gate_layer", "img_mlp.proj",
                 "img_mlp.out")
TOP_MODULES = ("img_in", "txt_in.in_layer", "txt_in.out_layer", "time_text_embed.timestep_embedder.linear_1",
               "time_text_embed.timestep_embedder.linear_2", "modulation.1", "norm_out.linear", "proj_out")
FUSED = {"img_mlp.gate_up": ("img_mlp.gate_layer", "img_mlp.proj"), "attn.to_qkv": ("attn.to_q", "attn.to_k",
                                                                                       "attn.to_v")}


# -- LoRAs as the tests write them ----------------------------------------------------------------------------------
def module_shape(reference, module: str) -> tuple[int, int]:
    """(out, in) of a diffusers module, fused ComfyUI names included."""
    for fused, parts in FUSED.items():
        if module.endswith(fused):
            shapes = [module_shape(reference, module[: -len(fused)] + part) for part in parts]
            return sum(out for out, _ in shapes), shapes[0][1]
    return tuple(reference.get_submodule(module).weight.shape)


def make_lora(reference, modules, rank=4, alpha=None, seed=0, size=0.5):
    """{diffusers module: (down [rank, in], up [out, rank], alpha or None)}, random, scaled so the LoRA changes
    the output clearly without blowing it up."""
    generator = torch.Generator().manual_seed(seed)
    lora = {}
    for module in modules:
        out, fan_in = module_shape(reference, module)
        down = torch.randn(rank, fan_in, generator=generator) / math.sqrt(fan_in)
        up = size * torch.randn(out, rank, generator=generator) / math.sqrt(rank)
        lora[module] = (down, up, alpha)
    return lora


def all_modules(num_layers, fused=False):
    blocks = ("attn.to_qkv", "attn.to_out.0", "img_mlp.gate_up", "img_mlp.out") if fused else BLOCK_MODULES
    return [f"transformer_blocks.{i}.{m}" for i in range(num_layers) for m in blocks] + list(TOP_MODULES)


#: key format -> (module name -> key stem, down suffix, up suffix, writes alpha, 1x1-conv shapes)
FORMATS = {
    "diffusers": (lambda m: f"transformer.{m}", ".lora_A.weight", ".lora_B.weight", False, False),
    "peft_default": (lambda m: f"base_model.model.{m}", ".lora_A.default.weight", ".lora_B.default.weight", False,
                     False),
    "kohya": (lambda m: "lora_unet_" + m.replace(".", "_"), ".lora_down.weight", ".lora_up.weight", True, False),
    "comfyui": (lambda m: f"diffusion_model.{m}", ".lora_down.weight", ".lora_up.weight", True, False),
    "lycoris_locon": (lambda m: "lycoris_" + m.replace(".", "_"), ".lora_down.weight", ".lora_up.weight", True, True),
    "bare": (lambda m: m, ".lora_A.weight", ".lora_B.weight", True, False),
}


def lora_file_dict(lora, fmt: str) -> dict[str, torch.Tensor]:
    stem_of, down_suffix, up_suffix, with_alpha, conv = FORMATS[fmt]
    out = {}
    for module, (down, up, alpha) in lora.items():
        stem = stem_of(module)
        out[stem + down_suffix] = down[:, :, None, None] if conv else down
        out[stem + up_suffix] = up[:, :, None, None] if conv else up
        if alpha is not None:
            assert with_alpha, f"{fmt} files carry no alpha"
            out[stem + ".alpha"] = torch.tensor(float(alpha))
    return out


def write_lora(path, tensors: dict) -> str:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return str(path)


def peft_reference(reference, loras):
    """A copy of diffusers' transformer with each (lora, strength) loaded through PEFT as an adapter."""
    model = copy.deepcopy(reference)
    names = []
    for i, (lora, _) in enumerate(loras):
        state = {}
        for module, (down, up, alpha) in lora.items():
            scaled = down * (1.0 if alpha is None else alpha / down.shape[0])
            split = [(module, up)]
            for fused, parts in FUSED.items():
                if module.endswith(fused):
                    split = [(module[: -len(fused)] + part, rows) for part, rows in
                             zip(parts, up.chunk(len(parts)))]
            for name, rows in split:
                state[f"transformer.{name}.lora_A.weight"] = scaled
                state[f"transformer.{name}.lora_B.weight"] = rows
        names.append(f"lora{i}")
        model.load_lora_adapter(state, prefix="transformer", adapter_name=names[-1])
    model.set_adapters(names, weights=[strength for _, strength in loras])
    return model.eval()


# -- the two tiny models ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def turbo_pair(tiny_models):
    """(diffusers' transformer, ours) for the tiny set's Turbo: its diffusers folder and its ComfyUI file."""
    reference = QwenImage21Transformer2DModel.from_pretrained(tiny_models["diffusers_turbo"], subfolder="transformer",
                                                              torch_dtype=torch.float32).eval()
    return reference, load_dit(tiny_models["turbo_dit"], weight_dtype="fp32")


@pytest.fixture(scope="module", params=["base", "turbo"])
def pair(request, dit_pair, turbo_pair):
    return dit_pair if request.param == "base" else turbo_pair


def case_for(model):
    return make_case(((4, 4),), (4, 6), (5, 7), context_dim=model.config.context_in_dim)


def velocities(model, kwargs, prefixes, x, t):
    """Our velocity uncached, and prefill + cached at the same timestep (all must equal the oracle's)."""
    cache = PrefixKVCache()
    return (model(x, t, prefixes), model(x, t, prefixes, cache=cache, mode="prefill"),
            model(x, t, prefixes, cache=cache, mode="cached"))


def assert_matches_oracle(ours, reference, loras, t=0.7):
    kwargs, prefixes, x = case_for(ours)
    t = torch.tensor([t])
    with torch.no_grad():
        expected = reference_velocity(peft_reference(reference, loras), kwargs, t)
        for got in velocities(ours, kwargs, prefixes, x, t):
            torch.testing.assert_close(got, expected, rtol=0, atol=TOL)
        moved = (expected - reference_velocity(reference, kwargs, t)).abs().max().item()
    assert moved > 0.05, "the LoRA must change the output clearly, or the comparison proves nothing"


# -- exactness ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_key_format_equals_diffusers_with_peft_at_two_strengths(pair, fmt, tmp_path):
    reference, ours = pair
    alpha = 2.0 if FORMATS[fmt][3] else None  # alpha / rank = 0.5 where the format stores alpha
    lora = make_lora(reference, all_modules(ours.config.num_layers), alpha=alpha, seed=1)
    path = write_lora(tmp_path / f"{fmt}.safetensors", lora_file_dict(lora, fmt))
    for strength in (1.0, -0.6):
        with_lora = apply_lora(ours, path, strength)
        assert lora_set(with_lora) == ((f"{fmt}.safetensors", strength),)
        assert_matches_oracle(with_lora, reference, [(lora, strength)])


@pytest.mark.parametrize("fmt", ["comfyui", "diffusers"])
def test_fused_keys_land_on_the_same_rows_as_the_split_ones(pair, fmt, tmp_path):
    """ComfyUI's fused `img_mlp.gate_up` (rows [gate; up]) and diffusers' fused `attn.to_qkv` (rows [q; k; v])."""
    reference, ours = pair
    lora = make_lora(reference, all_modules(ours.config.num_layers, fused=True), alpha=2.0 if fmt == "comfyui"
                     else None, seed=2)
    path = write_lora(tmp_path / "fused.safetensors", lora_file_dict(lora, fmt))
    assert_matches_oracle(apply_lora(ours, path, 0.8), reference, [(lora, 0.8)])


def test_two_chained_loras_equal_two_peft_adapters(pair, tmp_path):
    reference, ours = pair
    layers = ours.config.num_layers
    first = make_lora(reference, all_modules(layers), rank=4, alpha=4.0, seed=3)
    second = make_lora(reference, [f"transformer_blocks.{i}.attn.to_q" for i in range(layers)]
                       + [f"transformer_blocks.{layers - 1}.img_mlp.gate_up", "proj_out"], rank=3, seed=4)
    a = apply_lora(ours, write_lora(tmp_path / "a.safetensors", lora_file_dict(first, "kohya")), 0.8)
    ab = apply_lora(a, write_lora(tmp_path / "b.safetensors", lora_file_dict(second, "comfyui")), -0.5)
    assert lora_set(ab) == (("a.safetensors", 0.8), ("b.safetensors", -0.5))
    assert len(ab.blocks[0].qkv.adapters) == 2 and len(a.blocks[0].qkv.adapters) == 1
    assert ours.blocks[0].qkv.adapters == ()
    assert_matches_oracle(ab, reference, [(first, 0.8), (second, -0.5)])
    assert_matches_oracle(a, reference, [(first, 0.8)])  # the first copy is not changed by the second LoRA


def test_diffusers_own_converter_reads_our_formats_the_same_way(dit_pair, tmp_path):
    """kohya, ComfyUI and PEFT `.default` files through `QwenImage21Pipeline.lora_state_dict` equal our reading of
    the same files. Block keys only, and no kohya `img_mlp_gate_layer`: diffusers 0.42.1's kohya converter knows
    neither 2.1's top-level names (`txt_in_in_layer` stays one name) nor `gate_layer` (it becomes `gate.layer`),
    which PEFT then skips; our reader maps flattened names back through the model's own module list."""
    reference, ours = dit_pair
    lora = make_lora(reference, all_modules(ours.config.num_layers)[:-len(TOP_MODULES)], alpha=2.0, seed=5)
    for fmt in ("kohya", "comfyui", "bare"):
        tensors = lora_file_dict({m: v for m, v in lora.items() if fmt != "kohya" or "gate_layer" not in m}, fmt)
        if fmt == "bare":  # PEFT's `.default` names without a prefix, as ComfyUI's qwen loader knows them
            tensors = {k.replace(".lora_A.weight", ".lora_A.default.weight").replace(
                ".lora_B.weight", ".lora_B.default.weight"): v for k, v in tensors.items()}
        path = write_lora(tmp_path / f"{fmt}.safetensors", tensors)
        expected_model = copy.deepcopy(reference)
        expected_model.load_lora_adapter(QwenImage21Pipeline.lora_state_dict(dict(tensors)), prefix="transformer",
                                         adapter_name="x")
        expected_model.set_adapters(["x"], weights=[0.7])
        kwargs, prefixes, x = case_for(ours)
        t = torch.tensor([0.4])
        with torch.no_grad():
            expected = reference_velocity(expected_model, kwargs, t)
            got = apply_lora(ours, path, 0.7)(x, t, prefixes)
        torch.testing.assert_close(got, expected, rtol=0, atol=TOL)


def conditioning_for(model, seed=3):
    generator = torch.Generator().manual_seed(seed)
    slots = [False] * 5 + [True] * 16 + [False] * 4
    return Conditioning(text=torch.randn(len(slots), model.config.context_in_dim, generator=generator),
                        image_slots=torch.tensor(slots), references=torch.randn(64, 64, generator=generator),
                        ref_shapes=((8, 8),))


def test_sampling_loops_with_loras_equal_diffusers_loops(dit_pair, turbo_pair, tmp_path):
    """A Base loop with two chained LoRAs and a Turbo loop with one, final latents against diffusers' loop on the
    PEFT model (prefix cache on: prefill at step 1, cached steps after)."""
    width, height = 256, 384
    for (reference, ours), sigmas, grid, config, loras in (
        (dit_pair, base_sigmas(6, width, height), np.linspace(1.0, 1 / 6, 6), BASE_SCHEDULER,
         [("kohya", 1.0, 4.0), ("diffusers", 0.5, None)]),
        (turbo_pair, turbo_sigmas(), list(TURBO_SIGMAS), TURBO_SCHEDULER, [("comfyui", 0.75, 2.0)]),
    ):
        model, applied = ours, []
        for i, (fmt, strength, alpha) in enumerate(loras):
            lora = make_lora(reference, all_modules(ours.config.num_layers), alpha=alpha, seed=10 + i, size=0.3)
            model = apply_lora(model, write_lora(tmp_path / f"{fmt}{i}.safetensors", lora_file_dict(lora, fmt)),
                               strength)
            applied.append((lora, strength))
        cond = conditioning_for(ours)
        noise = initial_noise(7, 1, height, width)
        with torch.no_grad():
            expected = diffusers_loop(peft_reference(reference, applied), cond, noise, grid, config)
            got = sample(model, cond, sigmas=sigmas, width=width, height=height, noise=noise)
            plain = sample(ours, cond, sigmas=sigmas, width=width, height=height, noise=noise)
        torch.testing.assert_close(got.latents, expected, rtol=0, atol=TOL)
        assert (got.latents - plain.latents).abs().max() > 0.01
        assert got.report["loras"] == [{"name": f"{fmt}{i}.safetensors", "strength": s}
                                       for i, (fmt, s, _) in enumerate(loras)]
        assert "loras" not in plain.report


# -- every weight format ----------------------------------------------------------------------------------------
class Int8Linear(Linear):
    """A stand-in for a quantized format: int8 rows with a per-row scale, dequantized in `weight_rows`."""

    def __init__(self, linear: Linear):
        super().__init__(linear.weight.shape[1], linear.weight.shape[0])
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        self.weight = torch.nn.Parameter((w / scale).round().to(torch.int8), requires_grad=False)
        self.scale = torch.nn.Parameter(scale, requires_grad=False)

    def weight_rows(self, start, end, dtype):
        return (self.weight[start:end].float() * self.scale[start:end]).to(dtype)


@pytest.mark.parametrize("weight_dtype", ["bf16", "fp16", "fp8_e4m3fn", "int8 (a quantized Linear)"])
def test_every_weight_format_takes_the_branch_in_the_compute_dtype_without_touching_the_weights(
        tiny_models, weight_dtype, tmp_path):
    if weight_dtype.startswith("int8"):
        model = load_dit(tiny_models["dit"], weight_dtype="fp32")
        model.blocks[0].qkv = Int8Linear(model.blocks[0].qkv)
    else:
        model = load_dit(tiny_models["dit"], weight_dtype=weight_dtype)
    lora = read_lora(tiny_models["root"] / "loras" / tiny.SPEED_LORA_FILE, model.config)
    with_lora = apply_lora(model, tiny_models["root"] / "loras" / tiny.SPEED_LORA_FILE, 0.9)
    for (name, param), (copy_name, copied) in zip(model.named_parameters(), with_lora.named_parameters()):
        assert name == copy_name and copied is param  # the same Parameters: dtype, storage and values
    assert type(with_lora.blocks[0].qkv) is type(model.blocks[0].qkv)
    dtype = model.compute_dtype
    x = torch.randn(5, model.config.width).to(dtype)
    base, copied = model.blocks[0].qkv, with_lora.blocks[0].qkv
    width = model.config.width
    pairs = {p.module.rsplit(".", 1)[-1]: p for p in lora.pairs if p.target.linear == "blocks.0.qkv"}
    for start, end, name in ((0, width, "to_q"), (width, 2 * width, "to_k"), (2 * width, 3 * width, "to_v")):
        pair = pairs[name]
        branch = F.linear(F.linear(x, pair.down.float().to(dtype)), (pair.up.float() * (0.9 * pair.scale)).to(dtype))
        got = copied.rows(x, start, end)
        assert got.dtype == dtype
        torch.testing.assert_close(got, base.rows(x, start, end) + branch, rtol=0, atol=0)
    kwargs, prefixes, latents = make_case(((4, 4),), (4, 6), (5, 7), context_dim=model.config.context_in_dim)
    with torch.no_grad():
        out = with_lora(latents, torch.tensor([0.5]), prefixes)
    assert out.dtype == dtype and torch.isfinite(out).all()


# -- the node, the prefix cache and memory -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_root(tiny_models, tmp_path_factory):
    """The tiny set's folders (linked) plus a `loras/` folder of this module's own, as the loaders' models root."""
    root = tmp_path_factory.mktemp("lora_models")
    for folder in ("diffusion_models", "text_encoders", "vae", "diffusers"):
        (root / folder).symlink_to(tiny_models["root"] / folder, target_is_directory=True)
    (root / "loras").mkdir()
    shutil.copy(tiny_models["root"] / "loras" / tiny.SPEED_LORA_FILE, root / "loras" / tiny.SPEED_LORA_FILE)
    bridge.set_models_root(root)
    yield root
    bridge.set_models_root(None)


def run_base(model, cond, keep_cache, seed=1):
    out = QI21Sampler.execute(model, cond, seed, 3, 1.0, 256, 256, 1, keep_cache=keep_cache)
    return out[0]["samples"], out.ui["qi21_report"][0]


def test_the_node_lists_the_loras_folder_and_checks_its_widgets(lora_root):
    assert tiny.SPEED_LORA_FILE in bridge.model_choices("loras")
    assert QI21LoraLoader.validate_inputs(lora_name=tiny.SPEED_LORA_FILE, strength=1.0) is True
    assert "not in the loras folders" in QI21LoraLoader.validate_inputs(lora_name="missing.safetensors")
    assert "strength = 11.0" in QI21LoraLoader.validate_inputs(lora_name=tiny.SPEED_LORA_FILE, strength=11.0)
    model = QI21ModelLoader.execute(gf.SINGLE["model"], "fp32")[0]
    with pytest.raises(ValueError, match="not in the loras folders"):
        QI21LoraLoader.execute(model, "../diffusion_models/" + gf.SINGLE["model"], 1.0)


def test_keep_cache_knows_the_lora_and_the_plain_branch_stays_plain(lora_root):
    cond = gf.synthetic_conditioning()
    model = QI21ModelLoader.execute(gf.SINGLE["model"], "fp32")[0]
    with gf.default_store_budget(2**30):
        strong = QI21LoraLoader.execute(model, tiny.SPEED_LORA_FILE, 1.0)[0]
        first, report = run_base(strong, cond, keep_cache=True)
        assert report["cache"] == "miss" and report["loras"] == [{"name": tiny.SPEED_LORA_FILE, "strength": 1.0}]
        again, report = run_base(strong, cond, keep_cache=True)
        assert report["cache"] == "hit"
        torch.testing.assert_close(again, first, rtol=0, atol=TOL)  # cached step 1 vs prefill: <= 2e-5 apart

        weak = QI21LoraLoader.execute(model, tiny.SPEED_LORA_FILE, 0.5)[0]
        half, report = run_base(weak, cond, keep_cache=True)
        assert report["cache"] == "miss" and report["loras"] == [{"name": tiny.SPEED_LORA_FILE, "strength": 0.5}]
        fresh_model = QI21ModelLoader.execute(gf.SINGLE["model"], "fp32")[0]
        fresh, _ = run_base(QI21LoraLoader.execute(fresh_model, tiny.SPEED_LORA_FILE, 0.5)[0], cond, False)
        torch.testing.assert_close(half, fresh, rtol=0, atol=0)
        assert (half - first).abs().max() > 1e-3

        plain, report = run_base(model, cond, keep_cache=True)  # the other branch: the model without the LoRA
        assert report["cache"] == "miss" and "loras" not in report
        never_lora, _ = run_base(QI21ModelLoader.execute(gf.SINGLE["model"], "fp32")[0], cond, False)
        torch.testing.assert_close(plain, never_lora, rtol=0, atol=0)
        assert (plain - first).abs().max() > 1e-3


def test_the_cache_key_holds_the_lora_set_and_strengths(dit_pair, tmp_path):
    reference, ours = dit_pair
    path = write_lora(tmp_path / "k.safetensors", lora_file_dict(make_lora(reference, ["proj_out"]), "diffusers"))
    one, half = apply_lora(ours, path, 1.0), apply_lora(ours, path, 0.5)
    keys = [PrefixCacheStore.key(m, "cond", dtype=torch.float32, identity=record_of(m).kept_identity(m))
            for m in (ours, one, half)]
    assert keys[0][-1] == () and keys[1][-1] == (("lora", (("k.safetensors", 1.0),)),)
    assert keys[2][-1] == (("lora", (("k.safetensors", 0.5),)),)
    assert len(set(keys)) == 3


def branch_bytes(*models) -> int:
    """Bytes the LoRA branches of these models hold (the file's pairs and their stacked per-device copies)."""
    storages = {}
    for model in models:
        for linear in model.modules():
            for branch in getattr(linear, "adapters", ()):
                tensors = [t for p in branch.pairs for t in (p.down, p.up)]
                tensors += [t for plan in branch._plans.values() if plan is not None for t in plan]
                storages.update({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors})
    return sum(storages.values())


def test_a_lora_adds_no_second_copy_of_the_dit(lora_root):
    model = QI21ModelLoader.execute(gf.SINGLE["model"], "fp32")[0]
    dit_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    cond = gf.synthetic_conditioning()
    run_base(model, cond, keep_cache=False)  # what a run keeps alive anyway (the layout's RoPE tables)
    _, before = gf.leftovers()
    branches = [QI21LoraLoader.execute(model, tiny.SPEED_LORA_FILE, s)[0] for s in (1.0, 0.5)]  # two graph branches
    chained = QI21LoraLoader.execute(branches[0], tiny.SPEED_LORA_FILE, 0.3)[0]
    for m in (*branches, chained):
        run_base(m, cond, keep_cache=False)
    _, after = gf.leftovers()
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for m in (*branches, chained):
        assert {p.untyped_storage().data_ptr() for p in m.parameters()} == storages
        assert m.manager is None and m is not model
    lora_bytes = branch_bytes(*branches, chained)
    assert after - before <= lora_bytes + 2**14, f"{after - before} bytes added; the LoRA branches hold {lora_bytes}"
    assert lora_bytes < dit_bytes / 2
    assert all(linear.adapters == () for linear in model.modules() if isinstance(linear, Linear))


def test_unloading_releases_the_branches_device_copies(lora_root):
    """When ComfyUI unloads a LoRA model, the sampler's unload hook frees the branches' stacked copies (they would
    otherwise stay where the model ran while its weights are offloaded); the next run rebuilds them, same result."""
    from qi21.nodes.placement import dit_unloaded

    model = QI21LoraLoader.execute(QI21ModelLoader.execute(gf.SINGLE["model"], "fp32")[0], tiny.SPEED_LORA_FILE,
                                   1.0)[0]
    cond = gf.synthetic_conditioning()
    first = run_base(model, cond, keep_cache=False)
    branches = [b for linear in model.modules() for b in getattr(linear, "adapters", ())]
    assert branches and any(branch._plans for branch in branches)
    dit_unloaded(model)
    assert all(not branch._plans for branch in branches)
    again = run_base(model, cond, keep_cache=False)
    assert torch.equal(first[0], again[0])


# -- refusals ------------------------------------------------------------------------------------------------------
@pytest.fixture
def base_model(dit_pair):
    _, ours = dit_pair
    return ours


def refused(model, tmp_path, tensors, match, name="bad.safetensors"):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LoraError, match=match) as error:
        apply_lora(model, write_lora(tmp_path / name, tensors), 1.0)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(m.adapters == () for m in model.modules() if isinstance(m, Linear))
    return str(error.value)


def pair_for(module, rows, cols, rank=4, prefix="transformer."):
    return {f"{prefix}{module}.lora_A.weight": torch.randn(rank, cols),
            f"{prefix}{module}.lora_B.weight": torch.randn(rows, rank)}


def test_a_file_that_matches_nothing_is_refused_with_a_sample_and_the_formats(base_model, tmp_path):
    tensors = {**pair_for("encoder.layers.0.q", 64, 64), "lora_unet_foo_bar.lora_down.weight": torch.randn(4, 8),
               "lora_unet_foo_bar.lora_up.weight": torch.randn(8, 4)}
    message = refused(base_model, tmp_path, tensors, "none of its 4 keys is a LoRA layer", "nothing.safetensors")
    assert "nothing.safetensors" in message and "transformer.encoder.layers.0.q.lora_A.weight" in message
    assert "kohya / musubi ('lora_unet_'" in message and "LyCORIS LoCon" in message and "diffusers / PEFT" in message


def test_a_partly_matched_file_loads_and_the_report_counts_what_was_ignored(base_model, tmp_path):
    tensors = {**pair_for("transformer_blocks.0.attn.to_q", 64, 64),
               "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.randn(4, 8),
               "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.randn(8, 4),
               "transformer.transformer_blocks.0.img_norm1.diff": torch.randn(32),  # affine-free: no weight
               "transformer.transformer_blocks.1.attn.to_k.hada_w1_a": torch.randn(64, 4)}
    model = apply_lora(base_model, write_lora(tmp_path / "partial.safetensors", tensors), 1.0)
    (note,) = model.options.loras[0].notes
    assert note.startswith("LoRA partial.safetensors: 4 of its keys were ignored")
    assert "2 text-encoder keys" in note and "1 LyCORIS LoHa (hada_*)" in note and "1 layer pair(s) applied" in note
    assert "1 keys that name no Linear of the Qwen-Image 2.1 DiT" in note and "img_norm1.diff" in note
    cond = conditioning_for(base_model)
    with torch.no_grad():
        result = sample(model, cond, sigmas=base_sigmas(2, 256, 256), width=256, height=256, seed=0)
    assert note in result.report["notes"]


@pytest.mark.parametrize("family, keys", [
    ("Qwen-Image 1.x", ["transformer.transformer_blocks.0.attn.add_q_proj.lora_A.weight",
                        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight"]),
    ("Qwen-Image 1.x", ["lora_unet_transformer_blocks_0_img_mod_1.lora_down.weight",
                        "lora_unet_transformer_blocks_0_txt_mlp_net_2.lora_down.weight"]),
    ("Flux", ["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight",
              "lora_unet_single_blocks_0_linear1.lora_down.weight"]),
    ("Flux", ["transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight",
              "transformer.transformer_blocks.0.attn.add_q_proj.lora_A.weight"]),
    ("Stable Diffusion 1.x / SDXL", ["lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight"]),
    ("Stable Diffusion 1.x / SDXL", ["unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight"]),
])
def test_a_lora_for_another_model_family_is_refused_by_name(base_model, tmp_path, family, keys):
    message = refused(base_model, tmp_path, {k: torch.randn(4, 64) for k in keys}, f"is a LoRA for {family}")
    assert "not for Qwen-Image 2.1" in message and "transformer_blocks.N.attn.to_q" in message


@pytest.mark.parametrize("what, tensors, match", [
    ("rank", {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(4, 64),
              "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.randn(64, 3)},
     r"down \[4, 64\] and up \[64, 3\], expected \[rank, 64\] and \[64, rank\]"),
    ("input width", pair_for("transformer_blocks.0.attn.to_out.0", 64, 96),
     r"to_out.0: down \[4, 96\] and up \[64, 4\], expected \[rank, 64\]"),
    ("output rows", pair_for("transformer_blocks.1.img_mlp.proj", 384, 64),
     r"img_mlp.proj: down \[4, 64\] and up \[384, 4\], expected \[rank, 64\] and \[192, rank\]"),
    ("block", pair_for("transformer_blocks.7.attn.to_q", 64, 64), "targets transformer block 7, but the model has 3"),
    ("half a pair", {"lora_unet_transformer_blocks_0_attn_to_v.lora_down.weight": torch.randn(4, 64)},
     "only lora_unet_transformer_blocks_0_attn_to_v.lora_down.weight; a LoRA layer needs both"),
    ("DoRA", {**pair_for("img_in", 64, 64), "transformer.img_in.dora_scale": torch.randn(1, 64)}, "DoRA"),
    ("PEFT DoRA", {**pair_for("img_in", 64, 64), "transformer.img_in.lora_magnitude_vector": torch.randn(64)},
     r"DoRA \(lora_magnitude_vector\)"),
    ("dtype", {"transformer.img_in.lora_A.weight": torch.zeros(4, 64, dtype=torch.int32),
               "transformer.img_in.lora_B.weight": torch.randn(64, 4)}, "is I32 .4, 64., expected a float matrix"),
])
def test_a_lora_that_does_not_fit_is_refused_before_any_change(base_model, tmp_path, what, tensors, match):
    message = refused(base_model, tmp_path, {**pair_for("proj_out", 64, 64), **tensors}, match)
    assert "bad.safetensors does not fit this Qwen-Image 2.1 model (3 blocks, width 64" in message, what


def test_a_pickled_lora_is_refused_unread(base_model, tmp_path):
    path = tmp_path / "lora.pt"
    torch.save({"transformer.img_in.lora_A.weight": torch.randn(4, 64)}, path)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        apply_lora(base_model, path, 1.0)


def test_a_turbo_sampler_run_with_a_lora_reports_it(lora_root):
    turbo = QI21ModelLoader.execute(gf.SINGLE["turbo"], "fp32")[0]
    with_lora = QI21LoraLoader.execute(turbo, tiny.SPEED_LORA_FILE, 0.25)[0]
    report = QI21TurboSampler.execute(with_lora, gf.synthetic_conditioning(), 1, 256, 256, 1).ui["qi21_report"][0]
    assert report["loras"] == [{"name": tiny.SPEED_LORA_FILE, "strength": 0.25}]
    assert with_lora.source is turbo.source  # the samplers' Base/Turbo check still sees the variant


def test_tiny_pair_is_untouched_by_this_module(dit_pair):
    """The module-scoped oracle pair is shared: no test here may leave an adapter on it."""
    _, fresh = tiny_pair()
    _, ours = dit_pair
    assert all(m.adapters == () for m in ours.modules() if isinstance(m, Linear))
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), fresh.state_dict().values()))
