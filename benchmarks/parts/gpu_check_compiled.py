"""gpu_check.py's `compiled` section: one cached step (1 reference) eager, with compiled blocks, with compiled blocks
replayed as CUDA graphs, and diffusers' on the same weights: ms per step, the first compiled call's seconds, and how
far each velocity is from our eager one (next to diffusers', bf16's own drift).

The compiled rows use the loader's `compile` option (model/transformer/compiled.py) on a copy of the check's model
sharing its weights, after the prefill, which each block runs eagerly once. On a GPU they compile with inductor; the
dry run traces the same graphs with dynamo's "eager" backend (the path, the graphs and their guards, not inductor's
code: tests/test_compiled.py compiles with inductor on a CPU) and "blocks+cudagraphs" is the same as "blocks" there.
"""

import time

import torch

from parts.gpu_check_common import Check, dit_calls, rel_diff, table
from qi21.model.loaders.lora import clone_tree
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.transformer.compiled import compile_blocks

MODES = (("compiled", "blocks"), ("compiled + CUDA graphs", "blocks+cudagraphs"))


def run(check: Check) -> list[dict]:
    reference, ours = check.pair()
    _, prefix, target, kwargs = check.case(1)
    backend = "eager" if check.dry_run else "inductor"
    t = torch.tensor([0.8], device=check.device)
    rows = []
    with torch.no_grad():  # not inference_mode: dynamo traces inference tensors, but guards on the mode too
        our_prefill, our_step, their_prefill, their_step = dit_calls(check, reference, ours, prefix, target, kwargs)
        our_prefill()
        their_prefill()
        eager = our_step().float()
        rows.append({"path": "ours eager", "ms": check.median_ms(our_step), "first_call_s": None, "rel_diff": 0.0})
        rows.append({"path": "diffusers", "ms": check.median_ms(their_step), "first_call_s": None,
                     "rel_diff": rel_diff(their_step(), eager)})
        for name, mode in MODES:
            torch._dynamo.reset()  # every row compiles from nothing: its first call is the cold compile
            model = clone_tree(ours)
            compile_blocks(model, mode, backend)
            cache = PrefixKVCache()
            model(target, t, [prefix], cache=cache, mode="prefill")  # each block's first call runs eagerly

            def step(model=model, cache=cache):
                return model(target, t, [prefix], cache=cache, mode="cached")

            check.sync()
            start = time.perf_counter()
            got = step().float()
            check.sync()
            rows.append({"path": name, "ms": check.median_ms(step), "first_call_s": time.perf_counter() - start,
                         "rel_diff": rel_diff(got, eager)})
        torch._dynamo.reset()
    base = rows[0]["ms"]
    table(f"compiled: one cached step, {ours.config.num_layers} blocks, 1 reference, {check.size}x{check.size} "
          f"({'dynamo eager backend: no inductor numbers' if check.dry_run else 'inductor'})",
          ["path", "ms per step", "vs ours eager", "first call s (compile)", "rel. diff vs ours eager"],
          [[r["path"], f"{r['ms']:.1f}", f"{r['ms'] / base:.3f}",
            "-" if r["first_call_s"] is None else f"{r['first_call_s']:.1f}", f"{r['rel_diff']:.2e}"] for r in rows])
    if not check.cuda:
        print("compiled + CUDA graphs: CUDA only; on this device the same as compiled")
    return rows
