"""Ours against diffusers 0.42.1 on the same weights, in one run each, ratios printed side by side: a DiT step, whole
sampling loops, partial prefix reuse, the host's cost per step, the released width on a GPU, and bf16's own drift.

    python benchmarks/speed.py dit [--layers 4] [--repeats 5] [--threads N] [--roofline | --roofline-only]
    python benchmarks/speed.py sampling [--layers 2] [--steps 40] ...
    python benchmarks/speed.py prefix-reuse [--layers 2] ...
    python benchmarks/speed.py host-overhead [--repeats 3]
    python benchmarks/speed.py gpu [--layers 32] [--repeats 5] [--no-flex]     (a CUDA device)
    python benchmarks/speed.py bf16-drift
    python benchmarks/speed.py cpu-dtype [--rounds 3] [--steps 20]    (bf16 against fp32 on this CPU)

The CPU questions share one scaled shape that keeps the released model's ratios (`build_models`, `build_inputs`:
heads of 128, width 1024, SwiGLU x3, ~75 text tokens, a 1024-token target, references of 1024 tokens; only the layer
count is cut), `flops` (FlopCounterMode with the CPU attention's formula) and `cpu_bench_args`; benchmarks/variants.py
and benchmarks/comfyui.py use them too. `python benchmarks/speed.py QUESTION --help` says what each prints.
"""

import argparse
import collections
import copy
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
from parts import cpu_dtype
from qi21.model.encoders.conditioning import Conditioning
from qi21.model.loaders.dit_keys import convert_state_dict
from qi21.model.prefix_cache.kept_entries import PrefixCacheStore
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.prefix_cache.leading_runs import prefix_runs
from qi21.model.prefix_cache.lifecycle import share_leading_runs
from qi21.model.sampling.loop import initial_noise, sample
from qi21.model.sampling.schedule import TURBO_SIGMAS, base_sigmas, turbo_sigmas
from qi21.model.transformer.dit import DiTConfig, PrefixInputs, QwenImage21DiT

# -- dit ---------------------------------------------------------------------------------------------------------------
DIT_HELP = """\
DiT step benchmark: ours vs diffusers 0.42.1 on the same weights, in one run, ratios printed.

Scaled shape that keeps the released model's ratios: heads of 128, width 1024 (8 heads), SwiGLU x3, text
width = model width, ~75 text tokens, a 1024-token (512x512) target, and 0, 1 or 2 references of 1024
tokens. Only the layer count is cut (`--layers`), which scales every time alike.

For each reference count it times, interleaving ours and diffusers' calls and taking medians:
- prefill: the first step, which runs the whole sequence and fills the prefix cache;
- cached step: a later step that runs only the target rows against the cache;
- our uncached/cached time ratio next to the ratio FlopCounterMode predicts for our two forwards.

`--roofline` adds where our cached step's process CPU time goes (GEMMs, attention, norms, RoPE, modulation, copies,
the rest) and the fraction of this machine's GEMM roofline its GEMMs reach (parts/dit_roofline.py); `--roofline-only`
skips the comparison.

    python benchmarks/speed.py dit [--layers 4] [--repeats 5] [--threads N] [--roofline | --roofline-only]
"""

TEXT_TOKENS = 75
TARGET = (32, 32)  # latent tokens: 512x512 px
REFERENCE = (32, 32)


def build_models(layers: int, heads: int = 8, context_in_dim: int = 1024):
    """(diffusers' transformer, ours, diffusers' KV cache class) on the same random weights: heads of 128, SwiGLU x3."""
    from diffusers import QwenImage21Transformer2DModel
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    torch.manual_seed(0)
    reference = QwenImage21Transformer2DModel(num_layers=layers, num_attention_heads=heads, attention_head_dim=128,
                                              context_in_dim=context_in_dim, mlp_ratio=3).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.normal_(0, 0.02)
    config = DiTConfig(num_layers=layers, num_heads=heads, head_dim=128, context_in_dim=context_in_dim, mlp_ratio=3)
    ours = QwenImage21DiT(config)
    ours.load_state_dict(convert_state_dict(reference.state_dict()))
    return reference, ours.eval(), QwenImage21KVCache


def build_inputs(references: int, text_tokens: int = TEXT_TOKENS, context_dim: int = 1024, grid=TARGET,
                 lead: int = 20):
    """Template-like prompt: `lead` text tokens, then each reference's slots and 3 more, then the rest of the
    `text_tokens`; references and target of `grid` latent tokens. (our prefix, target, diffusers' keyword arguments,
    conditioning)."""
    slots = [False] * lead
    for _ in range(references):
        slots += [True] * (grid[0] * grid[1] // 4) + [False] * 3
    slots += [False] * (text_tokens - slots.count(False))
    slot_mask = torch.tensor(slots)
    text = torch.randn(1, len(slots), context_dim)
    ref_latents = torch.randn(1, references * grid[0] * grid[1], 64)
    target = torch.randn(1, grid[0] * grid[1], 64)
    conditioning = Conditioning(text=text[0], image_slots=slot_mask, references=ref_latents[0] if references else None,
                                ref_shapes=(tuple(grid),) * references)
    prefix = PrefixInputs(layout=conditioning.layout(grid), text=text[0], references=conditioning.references)
    reference_kwargs = dict(
        hidden_states=torch.cat([ref_latents, target], dim=1),
        encoder_hidden_states=text,
        img_shapes=[[(1, *grid)] * references + [(1, *grid)]],
        img_mask=torch.cat([slot_mask, torch.ones(grid[0] * grid[1] // 4, dtype=torch.bool)])[None],
    )
    return prefix, target, reference_kwargs, conditioning


def timed(fn, repeats):
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _cpu_sdpa_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    """FLOPs of torch's CPU flash-attention op (QK^T and PV), which FlopCounterMode does not know."""
    batch, heads, q_len, dim = query.shape
    return 4 * batch * heads * q_len * key.shape[-2] * dim


_cpu_sdpa_flops._get_raw = True  # take the tensors as they are (no shape wrapping)


def flops(fn) -> int:
    """GEMM and attention FLOPs of one call. On CPU every SDPA call (ours and the public one) lands in
    `_scaled_dot_product_flash_attention_for_cpu`, so it gets its formula here; text-segment masks are
    counted as full attention, as for any masked SDPA."""
    counter = FlopCounterMode(display=False, custom_mapping={
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops})
    with counter:
        fn()
    return counter.get_total_flops()


def cpu_bench_args(doc: str, layers: int, repeats: int, add=None) -> argparse.Namespace:
    """The CPU benchmarks' command line: `--layers`, `--repeats`, `--threads` (torch's thread count, set here) and
    whatever `add(parser)` adds."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--threads", type=int, default=None)
    if add is not None:
        add(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def run_dit():
    def add(parser):
        parser.add_argument("--roofline", action="store_true", help="also the cached step's breakdown")
        parser.add_argument("--roofline-only", action="store_true", help="only the cached step's breakdown")

    args = cpu_bench_args(DIT_HELP, layers=4, repeats=5, add=add)
    reference, ours, ReferenceCache = build_models(args.layers)
    if not args.roofline_only:
        compare(args, reference, ours, ReferenceCache)
    if args.roofline or args.roofline_only:
        roofline(args, reference, ours, ReferenceCache)


def roofline(args, reference, ours, ReferenceCache) -> None:
    from parts import dit_roofline

    t = torch.tensor([0.8])
    results, sides = {}, {}
    for references in (0, 1, 2):
        prefix, target, kwargs, _ = build_inputs(references)
        cache, ref_cache = PrefixKVCache(), ReferenceCache(args.layers)
        with torch.inference_mode():
            ours(target, t, [prefix], cache=cache, mode="prefill")
            reference(timestep=t, kv_cache=ref_cache, kv_cache_mode="extract", **kwargs)
        step = partial(ours, target, t, [prefix], cache=cache, mode="cached")
        ref_step = partial(reference, timestep=t, kv_cache=ref_cache, kv_cache_mode="cached", **kwargs)
        results[references] = dit_roofline.breakdown(step, args.repeats)
        sides[references] = (dit_roofline.split_step(step, args.repeats, dit_roofline.ours_wrapped),
                             dit_roofline.split_step(ref_step, args.repeats, dit_roofline.timed_functional))
    dit_roofline.print_table(results, dit_roofline.machine_rate(args.repeats))
    dit_roofline.print_split(sides)


def compare(args, reference, ours, ReferenceCache) -> None:
    t = torch.tensor([0.8])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 CPU, {args.layers} layers, "
          f"width 1024, heads 8x128, target {TARGET[0] * TARGET[1]} tokens, text {TEXT_TOKENS} tokens, "
          f"median of {args.repeats}")
    header = ("refs", "prefix", "prefill ours/diffusers", "cached ours/diffusers", "ours uncached/cached",
              "FLOP-predicted", "measured/predicted", "cache MiB ours", "cache MiB diffusers")
    print(" | ".join(header))
    for references in (0, 1, 2):
        prefix, target, kwargs, _ = build_inputs(references)
        ours_cache, ref_cache = PrefixKVCache(), ReferenceCache(args.layers)
        with torch.inference_mode():
            ours_prefill = partial(ours, target, t, [prefix], cache=ours_cache, mode="prefill")
            ref_prefill = partial(reference, timestep=t, kv_cache=ref_cache, kv_cache_mode="extract", **kwargs)
            ours_cached = partial(ours, target, t, [prefix], cache=ours_cache, mode="cached")
            ref_cached = partial(reference, timestep=t, kv_cache=ref_cache, kv_cache_mode="cached", **kwargs)
            ours_uncached = partial(ours, target, t, [prefix])
            for warm in (ours_prefill, ref_prefill, ours_cached, ref_cached):
                warm()
            times = {name: [] for name in ("op", "rp", "oc", "rc", "ou")}
            for _ in range(args.repeats):  # interleaved, so drift hits both sides alike
                for name, fn in (("op", ours_prefill), ("rp", ref_prefill), ("oc", ours_cached),
                                 ("rc", ref_cached), ("ou", ours_uncached)):
                    times[name].append(timed(fn, 1))
            med = {name: statistics.median(values) for name, values in times.items()}
            predicted = flops(ours_uncached) / flops(ours_cached)
        ref_bytes = sum(c.k.numel() * c.k.element_size() * 2 for c in ref_cache.layer_caches)
        measured = med["ou"] / med["oc"]
        print(f"{references} | {prefix.layout.prefix_len} | {med['op'] / med['rp']:.3f} "
              f"({med['op'] * 1e3:.0f} vs {med['rp'] * 1e3:.0f} ms) | {med['oc'] / med['rc']:.3f} "
              f"({med['oc'] * 1e3:.0f} vs {med['rc'] * 1e3:.0f} ms) | {measured:.2f} | {predicted:.2f} | "
              f"{measured / predicted:.2f} | {ours_cache.nbytes / 2**20:.1f} | {ref_bytes / 2**20:.1f}")


# -- sampling ----------------------------------------------------------------------------------------------------------
SAMPLING_HELP = """\
Whole sampling loops: ours vs a diffusers loop (its transformer + scheduler) on the same weights, one run.

Same scaled shape as `dit` (heads of 128, width 1024, 75 text tokens, a 1024-token target, references
of 1024 tokens; only the layer count is cut). Prints ratios measured side by side:
- Base loop (`--steps`, default 40) with 0, 1 and 2 references, and the Turbo loop (8 steps);
- a second run with `keep_cache` (another seed): it skips the prefill;
- a batch of 4 seeds vs 4 single runs, and the prefix-cache memory of each implementation for that batch.

    python benchmarks/speed.py sampling [--layers 2] [--steps 40] [--batch-steps 8]
"""

LOOP_SIZE = (TARGET[1] * 16, TARGET[0] * 16)  # width, height in px


def loop_clock(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def run_sampling():
    from qi21.tests.oracle import BASE_SCHEDULER, TURBO_SCHEDULER, diffusers_loop, reference_cache_bytes

    parser = argparse.ArgumentParser(description=SAMPLING_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-steps", type=int, default=8)
    args = parser.parse_args()
    reference, ours, _ = build_models(args.layers)
    width, height = LOOP_SIZE
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 CPU, {args.layers} layers, width 1024, "
          f"heads 8x128, target {width}x{height} px ({TARGET[0] * TARGET[1]} tokens)")
    print("loop | ours s | diffusers s | ours/diffusers | max |ours - diffusers|")
    base_grid = [1.0 - i * (1.0 - 1.0 / args.steps) / max(args.steps - 1, 1) for i in range(args.steps)]
    with torch.inference_mode():
        for references in (0, 1, 2):
            cond = build_inputs(references)[3]
            noise = initial_noise(references, 1, height, width)
            sigmas = base_sigmas(args.steps, width, height)
            ours_s, mine = loop_clock(sample, ours, cond, sigmas=sigmas, width=width, height=height, noise=noise)
            mine = mine.latents
            ref_s, theirs = loop_clock(diffusers_loop, reference, cond, noise, base_grid, BASE_SCHEDULER)
            print(f"Base {args.steps} steps, {references} refs | {ours_s:.1f} | {ref_s:.1f} | {ours_s / ref_s:.3f} | "
                  f"{(mine - theirs).abs().max():.1e}")
        cond = build_inputs(2)[3]
        noise = initial_noise(0, 1, height, width)
        ours_s, mine = loop_clock(lambda: sample(ours, cond, sigmas=turbo_sigmas(), width=width, height=height,
                                            noise=noise).latents)
        ref_s, theirs = loop_clock(lambda: diffusers_loop(reference, cond, noise, list(TURBO_SIGMAS), TURBO_SCHEDULER))
        print(f"Turbo 8 steps, 2 refs | {ours_s:.1f} | {ref_s:.1f} | {ours_s / ref_s:.3f} | "
              f"{(mine - theirs).abs().max():.1e}")

        store = PrefixCacheStore()
        kwargs = dict(sigmas=turbo_sigmas(), width=width, height=height, keep_cache=True, store=store)
        first_s, first = loop_clock(lambda: sample(ours, cond, seed=1, **kwargs))
        second_s, second = loop_clock(lambda: sample(ours, cond, seed=2, **kwargs))
        # A hit replaces the prefill by one cached step, so the most a rerun can save is their difference.
        avoidable = first.report["prefill_seconds"] - first.report["step_seconds"]
        print(f"\nkept cache, Turbo 8 steps, 2 refs: first run {first_s:.2f} s ({first.report['cache']}, prefill "
              f"{first.report['prefill_seconds']:.2f} s vs {first.report['step_seconds']:.2f} s per cached step), "
              f"second run {second_s:.2f} s ({second.report['cache']}, no prefill): saved {first_s - second_s:.2f} s "
              f"= {(first_s - second_s) / avoidable:.2f}x what skipping the prefill can save; second/first "
              f"{second_s / first_s:.3f}")

        batch_sigmas = base_sigmas(args.batch_steps, width, height)
        noise4 = initial_noise(3, 4, height, width)
        batch_s, batch = loop_clock(sample, ours, cond, sigmas=batch_sigmas, width=width, height=height, noise=noise4)
        singles_s, _ = loop_clock(lambda: [sample(ours, cond, sigmas=batch_sigmas, width=width, height=height,
                                             noise=noise4[i : i + 1]) for i in range(4)])
        reference_caches = []
        ref_batch_s, _ = loop_clock(lambda: diffusers_loop(reference, cond, noise4, batch_sigmas[:-1].tolist(),
                                                      BASE_SCHEDULER, caches=reference_caches))
        ref_bytes = sum(reference_cache_bytes(cache) for cache in reference_caches)
        single_bytes = sample(ours, cond, sigmas=batch_sigmas[-2:], width=width, height=height,
                              noise=noise4[:1]).report["cache_bytes"]
        print(f"batch of 4, Base {args.batch_steps} steps, 2 refs: ours {batch_s:.1f} s vs 4 single runs "
              f"{singles_s:.1f} s ({batch_s / singles_s:.3f}); diffusers batch of 4 {ref_batch_s:.1f} s "
              f"(ours/diffusers {batch_s / ref_batch_s:.3f})")
        print(f"prefix cache for the batch of 4: ours {batch.report['cache_bytes'] / 2**20:.1f} MiB "
              f"({batch.report['cache_bytes'] / single_bytes:.1f}x one prompt), diffusers {ref_bytes / 2**20:.1f} MiB "
              f"({ref_bytes / single_bytes:.1f}x)")


# -- prefix-reuse ------------------------------------------------------------------------------------------------------
PREFIX_REUSE_HELP = """\
Partial prefix reuse benchmark: a new instruction after the same two references, in one run, ratios printed.

The scaled shape of `dit` (heads of 128, width 1024, SwiGLU x3, a 1024-token target; only the layer count
is cut), with 2 references of 1024 tokens and a ~75-token instruction after them. Interleaved medians of:
- the DiT's first step for the new instruction with the references' rows reused from the previous prompt's kept
  cache (a chunked prefill: the instruction rows and the target) against a full prefill, next to the ratio
  FlopCounterMode predicts for the two calls;
- the tiny text encoder (tests/te_fixtures.py) encoding the new instruction with its prompt cache holding the
  references against a full encode (the cache emptied before each one);
- the prefix cache's bytes under true CFG (a positive and a negative prompt after the same references) with the
  shared run held once against one copy per prompt (what the cache held before).

    python benchmarks/speed.py prefix-reuse [--layers 4] [--repeats 5] [--threads N]
"""

LEAD = 20  # template tokens before the first reference
REUSE_REFERENCE = (32, 32)  # latent tokens: a 512x512 reference, 1024 tokens
REUSE_TARGET = (32, 32)
INSTRUCTION = 75


def reuse_conditioning(instruction_seed: int, instruction: int = INSTRUCTION) -> Conditioning:
    """`[20 text | ref | 3 text | ref | 3 text | instruction]`; the leading rows are the same for every seed."""
    lead = torch.Generator().manual_seed(0)
    slots = [False] * LEAD + ([True] * (REUSE_REFERENCE[0] * REUSE_REFERENCE[1] // 4) + [False] * 3) * 2
    text = [torch.randn(len(slots), 1024, generator=lead),
            torch.randn(instruction, 1024, generator=torch.Generator().manual_seed(instruction_seed))]
    slots += [False] * instruction
    references = torch.randn(2 * REUSE_REFERENCE[0] * REUSE_REFERENCE[1], 64, generator=lead)
    return Conditioning(text=torch.cat(text), image_slots=torch.tensor(slots), references=references,
                        ref_shapes=(REUSE_REFERENCE, REUSE_REFERENCE))


def prefix_of(cond: Conditioning) -> PrefixInputs:
    return PrefixInputs(layout=cond.layout(REUSE_TARGET), text=cond.text, references=cond.references)


def medians(calls: dict, repeats: int) -> dict:
    times = {name: [] for name in calls}
    for fn in calls.values():
        fn()  # warm-up
    for _ in range(repeats):  # interleaved, so drift hits every side alike
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def dit_rows(layers: int, repeats: int) -> list[str]:
    _, model, _ = build_models(layers)
    old, new = prefix_of(reuse_conditioning(1)), prefix_of(reuse_conditioning(2))
    target = torch.randn(1, REUSE_TARGET[0] * REUSE_TARGET[1], 64)
    t = torch.tensor([0.8])
    kept = PrefixKVCache()
    with torch.inference_mode():
        model(target, t, [old], cache=kept, mode="prefill")
        old_runs, new_runs = (prefix_runs(p.layout, p.text, p.references) for p in (old, new))
        shared = new_runs.common_rows(old_runs)

        def reused():
            cache = PrefixKVCache()
            cache.plan([new.layout.prefix_len], [("parts", kept.parts[0], shared)])
            return model(target, t, [new], cache=cache, mode="prefill")

        def full():
            return model(target, t, [new], cache=PrefixKVCache(), mode="prefill")

        med = medians({"reused": reused, "full": full}, repeats)
        predicted = flops(reused) / flops(full)
        # CFG: the negative prompt (a 10-token instruction) after the same references
        negative = prefix_of(reuse_conditioning(3, instruction=10))
        runs = [new_runs, prefix_runs(negative.layout, negative.text, negative.references)]
        lens = [new.layout.prefix_len, negative.layout.prefix_len]
        shared_cfg, before = PrefixKVCache(), PrefixKVCache()
        shared_cfg.plan(lens, share_leading_runs(runs, [None, None]))
        both = torch.cat([target, target])
        model(both, t, [new, negative], [0, 1], cache=shared_cfg, mode="prefill")
        model(both, t, [new, negative], [0, 1], cache=before, mode="prefill")
    return [
        f"first step, new instruction, references reused ({shared:,} of {new.layout.prefix_len:,} prefix rows) vs "
        f"full prefill | {med['reused'] * 1e3:.0f} vs {med['full'] * 1e3:.0f} ms | {med['reused'] / med['full']:.3f}x "
        f"| FLOPs predict {predicted:.3f}x",
        f"prefix cache bytes, CFG, 2 references: shared run once vs one copy per prompt | "
        f"{shared_cfg.nbytes / 2**20:.1f} vs {before.nbytes / 2**20:.1f} MiB | "
        f"{shared_cfg.nbytes / before.nbytes:.3f}x | rows {sum(t.shape[2] for t in shared_cfg.kv):,} vs {sum(lens):,}",
    ]


def tiny_text_encoder(folder: Path):
    """The tests' tiny random Qwen3-VL (tests/te_fixtures.py) written as a ComfyUI single file and loaded."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from qi21.model.loaders.text_encoder import load_text_encoder
    from te_fixtures import tiny_reference_model, write_qwen2_tokenizer, write_single_file

    write_single_file(tiny_reference_model(), folder / "qwen3vl_tiny.safetensors", "comfyui")
    write_qwen2_tokenizer(folder / "qwen3vl_tiny_tokenizer")
    return load_text_encoder(folder / "qwen3vl_tiny.safetensors", dtype="fp32")


def text_encoder_rows(repeats: int) -> list[str]:
    with tempfile.TemporaryDirectory() as folder:
        return _text_encoder_rows(tiny_text_encoder(Path(folder)), repeats)


def _text_encoder_rows(encoder, repeats: int) -> list[str]:
    from qi21.model.encoders.references import prepare_reference

    generator = torch.Generator().manual_seed(0)
    references = [prepare_reference(torch.rand(1, 512, 512, 3, generator=generator), resolution=512)
                  for _ in range(2)]  # 256 VLM tokens each: the 1024 latent tokens of the DiT rows above
    lead = "Replace the sky in <image1> with the sky of <image2>, keep every building, "
    words = "and make the light warmer and softer near the horizon while the shadows stay long " * 2
    first, second = lead + words, lead + words.replace("warmer", "cooler")
    with torch.inference_mode():
        encoder.encode(first, references)  # the references are kept now

        def reused():
            return encoder.encode(second, references)

        def full():
            encoder.prompt_cache.clear()
            return encoder.encode(second, references)

        med = medians({"reused": reused, "full": full}, repeats)
        reused()
        reused_tokens, total = encoder.last_reused_tokens, len(encoder.encode(second, references).token_ids)
    return [f"text encoder, instruction changed vs full encode (tiny encoder, 2 references of 512x512 px, "
            f"{reused_tokens:,} of {total + encoder.drop_tokens:,} tokens reused) | {med['reused'] * 1e3:.1f} vs "
            f"{med['full'] * 1e3:.1f} ms | {med['reused'] / med['full']:.3f}x |"]


def run_prefix_reuse():
    args = cpu_bench_args(PREFIX_REUSE_HELP, layers=4, repeats=5)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 CPU, DiT {args.layers} layers, width "
          f"1024, heads 8x128, target 1024 tokens, 2 references of 1024 tokens, {INSTRUCTION}-token instruction, "
          f"median of {args.repeats}")
    print("measure | time or size | ratio | note")
    for row in dit_rows(args.layers, args.repeats) + text_encoder_rows(args.repeats):
        print(row)


# -- host-overhead -----------------------------------------------------------------------------------------------------
HOST_OVERHEAD_HELP = """\
What a cached step costs besides arithmetic: kernels launched and host time per step, ours vs diffusers.

On a GPU every kernel is a launch the host has to issue, and a step whose host work (Python, dispatch, launches)
approaches the device's 100-150 ms stalls it. That cost does not shrink with the width, so it is measured here at a
width where the arithmetic is negligible: all 32 blocks, heads of 128 (one head, so RoPE's 16/56/56 axes hold), a
16-token target and a 26-token prefix (10 text tokens, one 16-token reference), fp32 on the CPU, one thread.
Printed, for ours and diffusers' transformer on the same weights, interleaved, medians of `--repeats`:
- kernels per cached step: aten ops that launch a kernel (views, reshapes, other metadata-only ops and allocations
  left out), counted by a dispatch mode, and per block;
- host ms per cached step (the whole forward at this width is host work).

    python benchmarks/speed.py host-overhead [--repeats 30]
"""

OVERHEAD_LAYERS = 32
OVERHEAD_GRID = (4, 4)  # target and reference latent tokens
#: aten ops that launch no kernel on a GPU: new views of the same memory, and allocations (the caching allocator's)
NOT_KERNELS = {"view", "_unsafe_view", "reshape", "slice", "select", "unsqueeze", "squeeze", "transpose", "permute",
               "expand", "t", "alias", "as_strided", "unflatten", "flatten", "chunk", "split", "unbind", "view_as",
               "view_as_real", "view_as_complex", "detach", "narrow", "contiguous", "_reshape_alias", "to",
               "lift_fresh", "empty", "empty_like", "new_empty", "empty_strided"}


class KernelCount(TorchDispatchMode):
    """Counts the aten ops that launch a kernel (`NOT_KERNELS` left out; `to` only counts when it really converts,
    which the dispatcher shows as `_to_copy`)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NOT_KERNELS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def overhead_models(layers: int = OVERHEAD_LAYERS):
    """{"ours": cached step, "diffusers": cached step}, both caches filled, on the same random weights."""
    reference, ours, KVCache = build_models(layers, heads=1, context_in_dim=64)
    prefix, target, kwargs, _ = build_inputs(1, text_tokens=10, context_dim=64, grid=OVERHEAD_GRID, lead=5)
    t = torch.tensor([0.8])
    cache, ref_cache = PrefixKVCache(), KVCache(layers)
    with torch.inference_mode():
        ours(target, t, [prefix], cache=cache, mode="prefill")
        reference(timestep=t, kv_cache=ref_cache, kv_cache_mode="extract", **kwargs)
    return {"ours": lambda: ours(target, t, [prefix], cache=cache, mode="cached"),
            "diffusers": lambda: reference(timestep=t, kv_cache=ref_cache, kv_cache_mode="cached", **kwargs)}


def measure(steps: dict, repeats: int) -> dict:
    """{side: (kernels per step, Counter of them, host ms per step)}."""
    results, times = {}, collections.defaultdict(list)
    with torch.inference_mode():
        for side, step in steps.items():
            step()
            with KernelCount() as count:
                step()
            results[side] = [sum(count.ops.values()), count.ops]
        for _ in range(repeats):  # interleaved
            for side, step in steps.items():
                started = time.perf_counter()
                step()
                times[side].append(time.perf_counter() - started)
    for side in steps:
        results[side].append(statistics.median(times[side]) * 1e3)
    return results


def run_host_overhead(argv=None):
    parser = argparse.ArgumentParser(description=HOST_OVERHEAD_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = measure(overhead_models(), args.repeats)
    print(f"torch {torch.__version__}, 1 thread, {OVERHEAD_LAYERS} blocks, heads 1x128, target 16 + prefix 26 tokens, "
          f"cached step, median of {args.repeats}")
    print("side | kernels per step | per block | host ms per step")
    for side, (kernels, _, ms) in results.items():
        print(f"{side} | {kernels} | {kernels / OVERHEAD_LAYERS:.1f} | {ms:.1f}")
    ours, theirs = results["ours"], results["diffusers"]
    print(f"ours / diffusers | {ours[0] / theirs[0]:.3f} | | {ours[2] / theirs[2]:.3f}")
    print("ours, kernels by op:", ", ".join(f"{name} {n}" for name, n in ours[1].most_common()))
    return results


# -- gpu ---------------------------------------------------------------------------------------------------------------
GPU_HELP = """\
GPU benchmark at the released width: ours vs diffusers 0.42.1 on the same random weights, one run.

The full model's shape (width 4096, 32 heads of 128, SwiGLU 12288, text width 4096) with `--layers` blocks
(32 = the whole 7B model), bf16, a 1024x1024 target (4096 tokens), 75 text tokens and 0/1/2 references of
1024x1024 (4096 tokens each). Times are CUDA-event medians after warm-up, interleaved ours/diffusers. Also
prints the largest difference between the two outputs, cache sizes (batch 1 and 4), peak memory, and the
flex-attention prefill (compiled) against the SDPA one.

    python benchmarks/speed.py gpu [--layers 32] [--repeats 5] [--no-flex]
"""

GPU_TEXT, GPU_TARGET, GPU_REFERENCE = 75, (64, 64), (64, 64)


def cuda_time(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1000)
    return statistics.median(samples)


def gpu_models(layers: int, device, dtype):
    from diffusers import QwenImage21Transformer2DModel

    torch.manual_seed(0)
    with torch.device(device):
        reference = QwenImage21Transformer2DModel(num_layers=layers).to(dtype).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.ndim == 1:
                centre = 0.0 if "text_norm" in name else 1.0  # the zero-centred text norm stores scale - 1
                param.copy_(centre + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0, param.shape[1] ** -0.5)
    ours = QwenImage21DiT(DiTConfig(num_layers=layers), device=device, dtype=dtype)
    ours.load_state_dict(convert_state_dict(reference.state_dict()))
    ours.compute_dtype = dtype
    return reference, ours.eval()


def gpu_inputs(references: int, batch: int, device, dtype):
    slots = [False] * 20
    for _ in range(references):
        slots += [True] * (GPU_REFERENCE[0] * GPU_REFERENCE[1] // 4) + [False] * 3
    slots += [False] * (GPU_TEXT - slots.count(False))
    slot_mask = torch.tensor(slots)
    text = torch.randn(len(slots), 4096, device=device, dtype=dtype) * 10
    refs = torch.randn(references * GPU_REFERENCE[0] * GPU_REFERENCE[1], 64, device=device, dtype=dtype)
    target = torch.randn(batch, GPU_TARGET[0] * GPU_TARGET[1], 64, device=device, dtype=dtype)
    cond = Conditioning(text=text, image_slots=slot_mask, references=refs if references else None,
                        ref_shapes=(GPU_REFERENCE,) * references)
    prefix = PrefixInputs(layout=cond.layout(GPU_TARGET), text=text, references=cond.references)
    reference_kwargs = dict(
        hidden_states=torch.cat([refs[None].expand(batch, -1, -1), target], dim=1),
        encoder_hidden_states=text[None].expand(batch, -1, -1),
        img_shapes=[[(1, *GPU_REFERENCE)] * references + [(1, *GPU_TARGET)]] * batch,
        img_mask=torch.cat([slot_mask, torch.ones(GPU_TARGET[0] * GPU_TARGET[1] // 4, dtype=torch.bool)])[None]
        .expand(batch, -1).to(device),
    )
    return prefix, target, reference_kwargs


def profile_steps(ours, reference, layers, device, dtype, t):
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache
    from torch.profiler import ProfilerActivity, profile

    prefix, target, kwargs = gpu_inputs(2, 1, device, dtype)
    mine, theirs = PrefixKVCache(), QwenImage21KVCache(layers)
    ours(target, t, [prefix], cache=mine, mode="prefill")
    reference(timestep=t, kv_cache=theirs, kv_cache_mode="extract", **kwargs)
    for name, fn in (("ours", lambda: ours(target, t, [prefix], cache=mine, mode="cached")),
                     ("diffusers", lambda: reference(timestep=t, kv_cache=theirs, kv_cache_mode="cached", **kwargs))):
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        print(f"--- {name}: cached step, 2 references")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))


def run_gpu():
    parser = argparse.ArgumentParser(description=GPU_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one cached step each")
    args = parser.parse_args()
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    device, dtype = torch.device("cuda"), torch.bfloat16
    started = time.time()
    reference, ours = gpu_models(args.layers, device, dtype)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, {args.layers} layers at full width, "
          f"target 1024x1024, text {GPU_TEXT} tokens; built in {time.time() - started:.0f} s", flush=True)
    print("refs | prefix tokens | prefill ours/diffusers (ms) | cached step ours/diffusers (ms) | rel. diff cached "
          "| cache GiB ours / diffusers (batch 4) | extra GiB of a cached step ours / diffusers (batch 4)", flush=True)
    t = torch.tensor([0.8], device=device)
    with torch.inference_mode():
        for references in (0, 1, 2):
            prefix, target, kwargs = gpu_inputs(references, 1, device, dtype)
            mine, theirs = PrefixKVCache(), QwenImage21KVCache(args.layers)
            prefill_o = partial(ours, target, t, [prefix], cache=mine, mode="prefill")
            prefill_r = partial(reference, timestep=t, kv_cache=theirs, kv_cache_mode="extract", **kwargs)
            step_o = partial(ours, target, t, [prefix], cache=mine, mode="cached")
            step_r = partial(reference, timestep=t, kv_cache=theirs, kv_cache_mode="cached", **kwargs)
            for fn in (prefill_o, prefill_r, step_o, step_r):
                fn()
            times = {k: [] for k in ("po", "pr", "so", "sr")}
            for _ in range(args.repeats):
                for key, fn in (("po", prefill_o), ("pr", prefill_r), ("so", step_o), ("sr", step_r)):
                    times[key].append(cuda_time(fn, 1))
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            mine_v, theirs_v = step_o().float(), step_r()[0][:, -target.shape[1]:].float()
            diff = ((mine_v - theirs_v).norm() / theirs_v.norm()).item()  # relative, bf16 vs bf16
            # batch of 4 seeds sharing the prompt: cache size and peak memory of one cached step
            prefix4, target4, kwargs4 = gpu_inputs(references, 4, device, dtype)
            mine4, theirs4 = PrefixKVCache(), QwenImage21KVCache(args.layers)
            ours(target4, t.expand(4), [prefix4], cache=mine4, mode="prefill")
            reference(timestep=t.expand(4), kv_cache=theirs4, kv_cache_mode="extract", **kwargs4)
            theirs_bytes = sum(c.k.numel() * c.k.element_size() * 2 for c in theirs4.layer_caches)
            peaks = []  # what one cached step allocates beyond the weights and caches already held
            for fn in (partial(ours, target4, t.expand(4), [prefix4], cache=mine4, mode="cached"),
                       partial(reference, timestep=t.expand(4), kv_cache=theirs4, kv_cache_mode="cached", **kwargs4)):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                held = torch.cuda.memory_allocated()
                fn()
                torch.cuda.synchronize()
                peaks.append((torch.cuda.max_memory_allocated() - held) / 2**30)
            print(f"{references} | {prefix.layout.prefix_len} | {med['po'] / med['pr']:.3f} ({med['po']:.1f} / "
                  f"{med['pr']:.1f}) | {med['so'] / med['sr']:.3f} ({med['so']:.1f} / {med['sr']:.1f}) | {diff:.3g} | "
                  f"{mine4.nbytes / 2**30:.2f} / {theirs_bytes / 2**30:.2f} | {peaks[0]:.1f} / {peaks[1]:.1f}",
                  flush=True)
            del mine, theirs, mine4, theirs4
            torch.cuda.empty_cache()
        if args.profile:
            profile_steps(ours, reference, args.layers, device, dtype, t)
        if not args.no_flex:
            prefix, target, _ = gpu_inputs(2, 1, device, dtype)
            started = time.time()
            flex = ours(target, t, [prefix], attention="flex")
            torch.cuda.synchronize()
            compile_s = time.time() - started
            sdpa = ours(target, t, [prefix], attention="sdpa")
            flex_ms = cuda_time(lambda: ours(target, t, [prefix], attention="flex"), args.repeats) * 1e3
            sdpa_ms = cuda_time(lambda: ours(target, t, [prefix], attention="sdpa"), args.repeats) * 1e3
            print(f"flex prefill (2 refs, uncached forward): {flex_ms:.1f} ms vs sdpa {sdpa_ms:.1f} ms "
                  f"({flex_ms / sdpa_ms:.3f}); first call incl. compile {compile_s:.0f} s; max |flex - sdpa| "
                  f"{(flex.float() - sdpa.float()).abs().max().item():.3g}", flush=True)


# -- bf16-drift --------------------------------------------------------------------------------------------------------
BF16_DRIFT_HELP = """\
How far bf16 drifts from fp32 through 32 random blocks, for ours and for diffusers (CPU, one run).

Random weights make a deep network chaotic: bf16 rounding differences grow block after block, so a bf16
comparison of two implementations says little by itself. This measures both against the fp32 reference on
the same weights (width 512 = 4 heads of 128, 32 blocks, text width 4096, a 256-token target), so the GPU
benchmark's bf16 "relative difference" can be read against the reference's own bf16 drift.

    python benchmarks/speed.py bf16-drift
"""

def drift_relative(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_bf16_drift():
    parser = argparse.ArgumentParser(description=BF16_DRIFT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()  # no options, but --help prints what it measures instead of running it
    from diffusers import QwenImage21Transformer2DModel

    global GPU_TARGET, GPU_REFERENCE
    GPU_TARGET = GPU_REFERENCE = (16, 16)  # a 256-token target: the drift, not the size, is the question
    torch.manual_seed(0)
    fp32 = QwenImage21Transformer2DModel(num_layers=32, num_attention_heads=4, context_in_dim=4096).eval()
    with torch.no_grad():
        for name, param in fp32.named_parameters():
            if param.ndim == 1:
                param.copy_(0.1 * torch.randn_like(param) + (0.0 if "text_norm" in name else 1.0))
            else:
                param.normal_(0, param.shape[1] ** -0.5)
    theirs = copy.deepcopy(fp32).to(torch.bfloat16)
    ours = QwenImage21DiT(DiTConfig(num_layers=32, num_heads=4), dtype=torch.bfloat16)
    ours.load_state_dict(convert_state_dict(theirs.state_dict()))
    t = torch.tensor([0.8])
    print("refs | diffusers bf16 vs fp32 | ours bf16 vs fp32 | ours vs diffusers (both bf16)")
    with torch.inference_mode():
        for references in (0, 1):
            prefix, target, kwargs = gpu_inputs(references, 1, torch.device("cpu"), torch.bfloat16)
            kwargs32 = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kwargs.items()}
            tokens = target.shape[1]
            exact = fp32(timestep=t, **kwargs32)[0][:, -tokens:]
            reference = theirs(timestep=t, **kwargs)[0][:, -tokens:]
            mine = ours(target, t, [prefix])
            print(f"{references} | {drift_relative(reference, exact):.3f} | {drift_relative(mine, exact):.3f} | "
                  f"{drift_relative(mine, reference):.3f}")


QUESTIONS = {"dit": run_dit,
             "sampling": run_sampling,
             "prefix-reuse": run_prefix_reuse,
             "host-overhead": run_host_overhead,
             "gpu": run_gpu,
             "bf16-drift": run_bf16_drift,
             "cpu-dtype": cpu_dtype.run}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in QUESTIONS:
        raise SystemExit(f"usage: speed.py {{{','.join(QUESTIONS)}}} [options]\n\n{__doc__}")
    # each question reads its own options from sys.argv, as the script it was
    sys.argv = [f"speed.py {argv[0]}", *argv[1:]]
    QUESTIONS[argv[0]]()


if __name__ == "__main__":
    main()
