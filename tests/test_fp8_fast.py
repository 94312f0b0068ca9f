"""`fp8_e4m3fn_fast` (model/layers/fast_gemm.py): fp8 block linears with per-channel weight scales and per-row
activation scales through `torch._scaled_mm`, and the int8 layers' `torch._int_mm` engine.

A CPU has no fast fp8 GEMM, so normal runs here dequantize (and the report says so); `force_scaled_mm()` sends them
through `torch._scaled_mm`, which runs on a CPU too. The kernel path is checked against an emulation written out here
(quantize, dequantize, fp32 matmul): in fp32 they agree to fp32 rounding. Per-row scales make every row's result
independent of the other rows, so the prefix cache, batches and CFG stay as exact as without fp8: the composition
tests check cached == uncached to the fp32 bound, and LoRA, the control net, compiled blocks, streaming and the step
cache on an fp8 base.
"""

import pytest
import torch

import controlnet_fixtures as cf
from dit_fixtures import make_case, unit_scale_dit
from qi21.model.encoders.conditioning import Conditioning
from qi21.model.features.compile import compile_model
from qi21.model.features.control import apply_controlnet
from qi21.model.features.lora import apply_lora
from qi21.model.layers import fast_gemm, formats
from qi21.model.layers.fast_gemm import force_int8_engine, force_scaled_mm
from qi21.model.layers.kitchen import QuantLinear, fp8_rowwise_linears, gemm_summary
from qi21.model.loaders.controlnet import load_controlnet
from qi21.model.loaders.dit import FP8_PARAMS, load_dit
from qi21.model.memory.streaming import StreamedRun
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.sampling.loop import initial_noise, sample
from qi21.model.sampling.step_cache import StepCacheOptions
from qi21.model.transformer.dit import DiTConfig, QwenImage21DiT

ROWWISE = "float8_e4m3fn_rowwise"
CONFIG = DiTConfig(num_layers=3, num_heads=2, head_dim=32, context_in_dim=48, mlp_ratio=3, axes_dims_rope=(4, 14, 14))


# -- the emulation: written out here, not taken from the pack ---------------------------------------------------------
def emulate_rows(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) quantized to e4m3 with scale = row amax / 448 and dequantized again, in fp32."""
    x = x.float()
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0
    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale


def emulated_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Both operands quantized per row (the weight per output channel), dequantized, multiplied in fp32."""
    flat = x.reshape(-1, x.shape[-1])
    return (emulate_rows(flat) @ emulate_rows(weight).T).reshape(*x.shape[:-1], weight.shape[0])


def fp8_segment(layer: QuantLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 rowwise segment's codes and per-channel scales of `layer` (its last segment)."""
    seg = layer.segments[-1]
    assert seg.fmt == ROWWISE
    return getattr(layer, seg.names["weight"]), getattr(layer, seg.names["weight_scale"])


def test_the_recipe_keeps_the_q_and_k_rows_of_a_fused_qkv_in_the_compute_dtype():
    assert fast_gemm.float_rows("blocks.7.qkv.weight", 12288) == 8192
    assert fast_gemm.float_rows("controlnet.blocks.0.qkv.weight", 96) == 64
    for name in ("blocks.7.to_out.weight", "blocks.7.gate_up.weight", "blocks.7.down.weight", "img_in.weight"):
        assert fast_gemm.float_rows(name, 4096) == 0


def random_dit(seed=5) -> QwenImage21DiT:
    return unit_scale_dit(CONFIG, seed)


def fast_copy(dit: QwenImage21DiT) -> QwenImage21DiT:
    """A copy of `dit` with its block linears fp8 rowwise, computing in the model's fp32."""
    copy = random_dit()
    copy.load_state_dict(dit.state_dict())
    assert fp8_rowwise_linears(copy, FP8_PARAMS.fullmatch) == 4 * CONFIG.num_layers
    return copy


def conditioning(seed=3) -> Conditioning:
    g = torch.Generator().manual_seed(seed)
    slots = torch.tensor([False] * 5 + [True] * 4 + [False] * 3)  # one 4x4 reference (4 slots of 2x2 cells)
    return Conditioning(torch.randn(12, 48, generator=g), slots, torch.randn(16, 64, generator=g), ((4, 4),))


def run(model, steps=4, **kwargs):
    with torch.no_grad():
        return sample(model, conditioning(), sigmas=torch.linspace(1.0, 0.0, steps + 1), width=128, height=96,
                      seed=kwargs.pop("seed", 1), **kwargs)


def velocity(model, seed=1, **kwargs):
    _, prefixes, x = make_case(((4, 4),), (4, 6), (5, 7), seed=seed, context_dim=model.config.context_in_dim)
    with torch.no_grad():
        return model(x.to(model.compute_dtype), 0.6, prefixes, **kwargs).float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# -- the GEMM against the emulation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7, 64), (2, 5, 64), (1, 64)])
def test_forced_scaled_mm_equals_quantize_dequantize_fp32_matmul(shape):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=g) * torch.logspace(-3, 2, 96).unsqueeze(1)  # channels of every size
    x = torch.randn(*shape, generator=g) * 30
    x.view(-1, 64)[0] = 0.0  # an all-zero row: scale floor, zero output
    codes, scale = fast_gemm.quantize_weight(weight)
    layer = QuantLinear.from_fp8_rowwise(codes, scale, torch.float32)
    expected = emulated_linear(x, weight)
    with force_scaled_mm():
        assert gemm_summary(layer, "cpu") == {ROWWISE: "kernel"}
        got = layer(x)
        part = layer.rows(x, 32, 80)  # a row range of a fused weight, as the blocks ask for q, k, v
    assert got.dtype == torch.float32 and torch.all(got.view(-1, 96)[0] == 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    torch.testing.assert_close(part, expected[..., 32:80], rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    # the normal CPU path: the same weights dequantized, activations unquantized
    assert gemm_summary(layer, "cpu") == {ROWWISE: "dequantize"}
    dense = x @ (codes.float() * scale).T
    torch.testing.assert_close(layer(x), dense, rtol=1e-5, atol=1e-5 * dense.abs().max().item())


def test_a_fused_qkv_multiplies_q_and_k_in_float_and_v_in_fp8():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 64, generator=g)
    x = torch.randn(2, 5, 64, generator=g) * 30
    layer = QuantLinear.fp8_rowwise_from_dense(weight, torch.float32, fast_gemm.float_rows("blocks.0.qkv.weight", 96))
    expected = torch.cat([x @ weight[:64].T, emulated_linear(x, weight[64:])], dim=-1)
    with force_scaled_mm():
        assert gemm_summary(layer, "cpu") == {ROWWISE: "kernel"}
        got, v_only, across = layer(x), layer.rows(x, 64, 96), layer.rows(x, 40, 80)
    bound = dict(rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    torch.testing.assert_close(got, expected, **bound)
    torch.testing.assert_close(v_only, expected[..., 64:], **bound)
    torch.testing.assert_close(across, expected[..., 40:80], **bound)  # a range over both segments


def test_bf16_output_and_a_gpu_before_ada_dequantizes(monkeypatch):
    codes, scale = fast_gemm.quantize_weight(torch.randn(32, 64))
    layer = QuantLinear.from_fp8_rowwise(codes, scale, torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with force_scaled_mm():
        out = layer(x)
    assert out.dtype == torch.bfloat16 and rel(out, emulated_linear(x, codes.float() * scale)) < 1e-2
    for capability, kernel in (((8, 6), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert fast_gemm.scaled_mm_runs_on(torch.device("cuda")) is kernel
    assert not fast_gemm.scaled_mm_runs_on("cpu") and not fast_gemm.scaled_mm_runs_on("mps")
    with force_scaled_mm():
        assert fast_gemm.scaled_mm_runs_on("cpu")


# -- the loader -------------------------------------------------------------------------------------------------------
def test_loader_quantizes_block_linears_per_channel_and_keeps_the_rest_bf16(tiny_models):
    fast = load_dit(tiny_models["dit"], weight_dtype="fp8_e4m3fn_fast")
    exact = load_dit(tiny_models["dit"], weight_dtype="fp32")
    for name, module in exact.named_modules():
        if not hasattr(module, "weight") or not isinstance(module.weight, torch.Tensor) or module.weight.ndim != 2:
            continue
        ours = fast.get_submodule(name)
        if FP8_PARAMS.fullmatch(f"{name}.weight"):
            keep = 2 * module.out_features // 3 if name.endswith(".qkv") else 0  # q and k stay in bf16
            assert isinstance(ours, QuantLinear)
            assert [s.fmt for s in ours.segments] == ["float"] * bool(keep) + [ROWWISE]
            codes, scale = fp8_segment(ours)
            assert codes.dtype == torch.float8_e4m3fn and scale.shape == (ours.out_features - keep, 1)
            w = module.weight.float()
            got = ours.weight_rows(0, ours.out_features, torch.float32)
            assert torch.equal(got[:keep], w[:keep].bfloat16().float())  # the file's own values
            w = w[keep:]
            step = w.abs().amax(dim=1, keepdim=True) / 448 * 2 ** -6  # e4m3's subnormal step, in weight units
            assert torch.all((got[keep:] - w).abs() <= w.abs() / 16 + step)  # 3 mantissa bits: half an ulp is 1/16
        else:
            assert type(ours) is type(module) and ours.weight.dtype == torch.bfloat16, name
    assert fast.compute_dtype == torch.bfloat16
    assert gemm_summary(fast, "cpu") == {ROWWISE: "dequantize"}  # a CPU in a normal run
    reference = velocity(load_dit(tiny_models["dit"], weight_dtype="bf16"))  # bf16 itself is 14% off fp32 here
    dequantized = velocity(fast)
    with force_scaled_mm():
        scaled = velocity(fast)
    assert rel(dequantized, reference) < 0.03 and rel(scaled, reference) < 0.03  # measured 0.9% and 1.1%


def test_an_fp8_file_keeps_its_codes_and_scales_and_other_formats_are_refused(tmp_path):
    from test_quantized import refuse, write_dit  # noqa: PLC0415 (that suite's quantized files)

    path, _, tensors = write_dit(tmp_path, "qwen_image_2.1_fp8.safetensors", "float8_e4m3fn")
    fast, plain = load_dit(path, weight_dtype="fp8_e4m3fn_fast"), load_dit(path, weight_dtype="bf16")
    qkv = fast.blocks[0].qkv
    assert [s.fmt for s in qkv.segments] == ["float", ROWWISE]  # q and k dequantized once, v kept in fp8
    stem = "transformer_blocks.0.attn.to_"
    codes, scale = fp8_segment(qkv)
    assert torch.equal(codes.view(torch.uint8), tensors[f"{stem}v.weight"].view(torch.uint8))
    assert torch.all(scale == tensors[f"{stem}v.weight_scale"].float())
    rows = tensors[f"{stem}q.weight"].shape[0]
    for i, x in enumerate("qk"):
        file_rows = tensors[f"{stem}{x}.weight"].float() * tensors[f"{stem}{x}.weight_scale"].float()
        assert torch.equal(qkv.weight_rows(i * rows, (i + 1) * rows, torch.float32), file_rows.bfloat16().float())
    assert rel(velocity(fast), velocity(plain)) < 1e-2  # the same weights, bf16 rounding apart
    int8, _, _ = write_dit(tmp_path, "qwen_image_2.1_int8_convrot.safetensors", "int8_convrot")
    refuse(int8, "already quantized .*fp8_e4m3fn_fast does not apply", ValueError, weight_dtype="fp8_e4m3fn_fast")


def test_the_run_report_says_once_that_a_cpu_dequantizes(models_root, tiny_models):
    from qi21.nodes.conditioning import QI21TextEncode
    from qi21.nodes.loaders import QI21ModelLoader, QI21TextEncoderLoader
    from qi21.nodes.samplers import QI21TurboSampler

    model = QI21ModelLoader.execute(tiny_models["turbo_dit"].name, "fp8_e4m3fn_fast")[0]
    encoder = QI21TextEncoderLoader.execute(tiny_models["text_encoder"].name, "default")[0]
    positive = QI21TextEncode.execute(encoder, "a red circle", None)[0]
    out = QI21TurboSampler.execute(model, positive, 7, 128, 128, 1)
    assert torch.isfinite(out[0]["samples"]).all()
    assert out.ui["qi21_report"][0]["quantized_gemm"] == {ROWWISE: "dequantize"}


# -- int8 through torch._int_mm ----------------------------------------------------------------------------------------
def test_int_mm_equals_the_integer_emulation_and_comfy_kitchens_int8_linear():
    ck = pytest.importorskip("comfy_kitchen")
    g = torch.Generator().manual_seed(1)
    weight = torch.randint(-127, 128, (48, 64), generator=g, dtype=torch.int8)
    scale = torch.rand(48, 1, generator=g) / 100
    x = torch.randn(2, 9, 64, generator=g)
    got = fast_gemm.int_mm_linear(x, weight, scale)
    flat = x.reshape(-1, 64).double()
    row_scale = (flat.abs().amax(dim=1, keepdim=True).float() / 127).double()
    codes = (flat.float() / row_scale.float()).round().clamp(-128, 127).double()
    expected = ((codes @ weight.double().T) * (row_scale * scale.double().T)).reshape(2, 9, 48)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())
    kitchen = ck.int8_linear(x, weight, scale, out_dtype=torch.float32)
    torch.testing.assert_close(got, kitchen, rtol=1e-5, atol=1e-5 * kitchen.abs().max().item())


def test_int8_convrot_layers_run_either_engine_alike(tmp_path, monkeypatch):
    pytest.importorskip("comfy_kitchen")
    from test_quantized import write_dit  # noqa: PLC0415

    path, _, _ = write_dit(tmp_path, "qwen_image_2.1_int8_convrot.safetensors", "int8_convrot")
    model = load_dit(path, weight_dtype="fp32", quantized_gemm="kernel")
    dequantized = velocity(load_dit(path, weight_dtype="fp32", quantized_gemm="dequantize"))
    assert fast_gemm.int8_engine("cpu") == "kitchen"  # a CPU keeps today's path
    with force_int8_engine("kitchen"):
        kitchen = velocity(model)
    calls = []
    int_mm_linear = formats.int_mm_linear
    monkeypatch.setattr(formats, "int_mm_linear", lambda *args: calls.append(1) or int_mm_linear(*args))
    with force_int8_engine("int_mm"):
        int_mm = velocity(model)
    assert len(calls) >= 4 * model.config.num_layers  # every block linear took the int_mm engine
    # The same W8A8 arithmetic (each layer equals the other engine to 1e-5: the test above); an activation that
    # sits on a rounding boundary may take the next code in one engine, and the random model amplifies that flip,
    # so the two agree well within what quantizing the activations changes (measured 5.7e-4 against 1.5e-3 on an
    # AVX2 EPYC, identical on an AMX Xeon).
    assert rel(int_mm, kitchen) < 0.5 * rel(kitchen, dequantized)


# -- composition -------------------------------------------------------------------------------------------------------
def test_per_row_scales_keep_the_prefix_cache_exact():
    """Each row's scale is its own, so a target row computes the same in the prefill and in a cached step."""
    fast = fast_copy(random_dit())
    _, prefixes, x = make_case(((4, 4),), (4, 6), (5, 7), batch=2, pad=(0, 3), seed=2, context_dim=48)
    t = torch.tensor([0.7, 0.7])
    with force_scaled_mm(), torch.no_grad():
        whole = fast(x, t / 2, prefixes)
        cache = PrefixKVCache()
        fast(x, t, prefixes, cache=cache, mode="prefill")
        cached = fast(x, t / 2, prefixes, cache=cache, mode="cached")
    torch.testing.assert_close(cached, whole, rtol=0, atol=2e-5)


def test_a_lora_runs_beside_the_fp8_gemm(tiny_models):
    """The LoRA branch adds its term to the fp8 GEMM's output (compute dtype); the frozen fp8 weight is shared."""
    exact = apply_lora(load_dit(tiny_models["dit"], weight_dtype="fp32"), tiny_models["lora"], 0.8)
    fast = load_dit(tiny_models["dit"], weight_dtype="fp32")
    fp8_rowwise_linears(fast, FP8_PARAMS.fullmatch)  # fp32 compute: the comparison is not lost in bf16 rounding
    with_lora = apply_lora(fast, tiny_models["lora"], 0.8)
    assert all(a is b for a, b in zip(fast.parameters(), with_lora.parameters()))
    qkv = with_lora.blocks[0].qkv
    assert isinstance(qkv, QuantLinear) and qkv.adapters
    x = torch.randn(5, qkv.in_features)
    with force_scaled_mm():
        branch = sum(adapter(x, 0, qkv.out_features) for adapter in qkv.adapters)
        torch.testing.assert_close(qkv(x), fast.blocks[0].qkv(x) + branch, rtol=0, atol=1e-6)
        assert rel(velocity(with_lora), velocity(exact)) < 0.03  # measured 0.9%


def test_a_controlnet_loads_in_fp8_and_runs_on_an_fp8_base(tmp_path):
    _, base = cf.tiny_pair4()
    path = cf.write(tmp_path / "fun.safetensors", cf.alibaba_state())
    net, exact_net = load_controlnet(path, "fp8_e4m3fn_fast"), load_controlnet(path, "fp32")
    assert [s.fmt for s in net.blocks[0].qkv.segments] == ["float", ROWWISE] and net.compute_dtype == torch.bfloat16
    assert [s.fmt for s in net.blocks[0].to_out.segments] == [ROWWISE]
    assert not isinstance(net.blocks[0].after_proj, QuantLinear)
    fast = clone_fast(base)
    hint = torch.randn(8 * 8, 129, generator=torch.Generator().manual_seed(2))
    cond, noise = conditioning(), initial_noise(1, 1, 128, 128)
    with torch.no_grad(), force_scaled_mm():
        got = sample(apply_controlnet(fast, net, lambda grid: hint, strength=0.7), cond,
                     sigmas=torch.linspace(1, 0, 4), width=128, height=128, noise=noise)
    exact = sample(apply_controlnet(base, exact_net, lambda grid: hint, strength=0.7), cond,
                   sigmas=torch.linspace(1, 0, 4), width=128, height=128, noise=noise)
    assert rel(got.latents, exact.latents) < 0.05


def clone_fast(base):
    from qi21.model.loaders.lora import clone_tree  # noqa: PLC0415

    copy = clone_tree(base)
    fp8_rowwise_linears(copy, FP8_PARAMS.fullmatch)
    return copy


def test_compiled_blocks_trace_the_scaled_mm_path_without_a_break():
    from torch._dynamo.utils import counters

    fast = fast_copy(random_dit())
    compiled = fast_copy(random_dit())
    compile_model(compiled, "blocks", "eager")
    torch._dynamo.reset()
    counters.clear()
    try:
        with force_scaled_mm():
            velocities = []
            for dit in (fast, compiled):
                _, prefixes, x = make_case(((4, 4),), (4, 6), (5, 7), context_dim=48)
                cache, t = PrefixKVCache(), torch.tensor([0.7])
                with torch.no_grad():
                    dit(x, t, prefixes, cache=cache, mode="prefill")  # eagerly, once (compiled.py)
                    velocities.append(dit(x, t / 2, prefixes, cache=cache, mode="cached"))
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(velocities[1], velocities[0], rtol=0, atol=1e-5)


def test_streaming_and_the_step_cache_on_an_fp8_base():
    fast = fast_copy(random_dit())
    noise = initial_noise(1, 1, 96, 128)
    with force_scaled_mm():
        resident = run(fast, noise=noise)
        with torch.no_grad(), StreamedRun(fast, (0, 2), "device") as streamed:
            moved = run(fast, noise=noise, new_cache=streamed.new_cache)
        stepped = run(fast, steps=12, step_cache=StepCacheOptions(threshold=1e9, edit_threshold=1e9))
    assert torch.equal(moved.latents, resident.latents)
    assert stepped.report["step_cache"]["skipped"] > 0 and torch.isfinite(stepped.latents).all()


def test_every_option_off_loads_no_fp8_layer(tiny_models):
    for dtype in ("default", "bf16", "fp32"):
        model = load_dit(tiny_models["dit"], weight_dtype=dtype)
        assert gemm_summary(model, "cpu") == {} and not any(isinstance(m, QuantLinear) for m in model.modules())
