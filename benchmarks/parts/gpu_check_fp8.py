"""gpu_check.py's `fp8` section: the cached step (1 reference, the check's blocks and size: 32 at 1024x1024 on a GPU)
in bf16, with `fp8_e4m3fn_fast` (block linears fp8 rowwise, `torch._scaled_mm`) and with int8 ConvRot block linears on
each int8 engine (comfy-kitchen's `int8_linear`, `torch._int_mm`), eager and with compiled blocks; ms, the ratio to
our bf16 eager step and each velocity's difference to it (read against the `drift` section's bf16-vs-fp32).

The quantized models are copies of the check's bf16 model sharing its other weights, their block linears quantized in
memory (per output channel for fp8, by comfy-kitchen's ConvRot quantizer for int8), so all 32 blocks fit without
writing files. The int8 rows' ratio says which engine `model/layers/fast_gemm.py`'s INT8_ENGINE_BY_CAPABILITY should
name for this GPU. The dry run forces `_scaled_mm` on the CPU (the numerics path) and traces compiled blocks with
dynamo's "eager" backend; its times mean nothing.
"""

import contextlib

import torch

from parts.gpu_check_common import Check, rel_diff, table
from qi21.model.layers.fast_gemm import force_int8_engine, force_scaled_mm, scaled_mm_runs_on
from qi21.model.layers.kitchen import QuantLinear, fp8_rowwise_linears, set_gemm
from qi21.model.layers.linear import Linear
from qi21.model.loaders.dit import FP8_PARAMS
from qi21.model.loaders.lora import clone_tree
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.transformer.compiled import compile_blocks

CONVROT_GROUP = 256  # the released int8 files' rotation


def int8_convrot_copy(model):
    """A copy of `model` whose block linears are int8 ConvRot (per-channel scales), as the released int8 files."""
    from comfy_kitchen.tensor import TensorWiseINT8Layout

    copy = clone_tree(model)
    for name, module in list(copy.named_modules()):
        if isinstance(module, Linear) and FP8_PARAMS.fullmatch(f"{name}.weight"):
            q, params = TensorWiseINT8Layout.quantize(module.weight.float(), is_weight=True, per_channel=True,
                                                      convrot=True, convrot_groupsize=CONVROT_GROUP)
            layer = QuantLinear(module.weight.shape[1], module.weight.shape[0], module.weight.dtype)
            layer.add_segment("int8_tensorwise", {"weight": q, "weight_scale": params.scale},
                              {"convrot": True, "convrot_groupsize": CONVROT_GROUP})
            parent, _, leaf = name.rpartition(".")
            setattr(copy.get_submodule(parent), leaf, layer)
    set_gemm(copy, "kernel")  # the int8 GEMM on a CPU too (the dry run), where "auto" would dequantize
    return copy


def fp8_copy(model):
    copy = clone_tree(model)
    fp8_rowwise_linears(copy, FP8_PARAMS.fullmatch)
    return copy


def run(check: Check) -> list[dict]:
    _, ours = check.pair()
    _, prefix, target, _ = check.case(1)
    backend = "eager" if check.dry_run else "inductor"
    t = torch.tensor([0.8], device=check.device)
    variants = [("bf16", lambda: ours, contextlib.nullcontext),
                ("fp8_e4m3fn_fast", lambda: fp8_copy(ours),
                 lambda: force_scaled_mm() if check.dry_run else contextlib.nullcontext()),
                ("int8 ConvRot, comfy-kitchen", lambda: int8_convrot_copy(ours), lambda: force_int8_engine("kitchen")),
                ("int8 ConvRot, torch._int_mm", lambda: int8_convrot_copy(ours), lambda: force_int8_engine("int_mm"))]
    rows, base, eager_bf16 = [], None, None
    with torch.no_grad():
        for name, build, context in variants:
            model = build()
            for mode in ("eager", "compiled"):
                torch._dynamo.reset()
                run_model = model if mode == "eager" else clone_tree(model)
                if mode == "compiled":
                    compile_blocks(run_model, "blocks", backend)
                cache = PrefixKVCache()
                with context():
                    run_model(target, t, [prefix], cache=cache, mode="prefill")  # compiled: each block eagerly once

                    def step(run_model=run_model, cache=cache):
                        return run_model(target, t, [prefix], cache=cache, mode="cached")

                    got = step().float()
                    ms = check.median_ms(step)
                base = ms if base is None else base
                eager_bf16 = got if eager_bf16 is None else eager_bf16
                rows.append({"model": name, "mode": mode, "ms": ms, "vs_bf16_eager": ms / base,
                             "rel_diff": rel_diff(got, eager_bf16)})
            del model
            torch._dynamo.reset()
            if check.cuda:
                torch.cuda.empty_cache()
    fp8_gemm = "torch._scaled_mm" if check.dry_run or scaled_mm_runs_on(check.device) else "dequantized (no fp8 GEMM)"
    table(f"fp8: one cached step, {ours.config.num_layers} blocks, 1 reference, {check.size}x{check.size}; fp8 GEMM: "
          f"{fp8_gemm}; compiled: {backend}" + (" (dry run: no timing means anything)" if check.dry_run else ""),
          ["model", "mode", "ms per step", "vs bf16 eager", "rel. diff vs bf16 eager"],
          [[r["model"], r["mode"], f"{r['ms']:.1f}", f"{r['vs_bf16_eager']:.3f}", f"{r['rel_diff']:.2e}"]
           for r in rows])
    return rows
