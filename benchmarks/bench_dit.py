"""DiT step benchmark: ours vs diffusers 0.42.1 on the same weights, in one run, ratios printed.

Scaled shape that keeps the released model's ratios: heads of 128, width 1024 (8 heads), SwiGLU x3, text
width = model width, ~75 text tokens, a 1024-token (512x512) target, and 0, 1 or 2 references of 1024
tokens. Only the layer count is cut (`--layers`), which scales every time alike.

For each reference count it times, interleaving ours and diffusers' calls and taking medians:
- prefill: the first step, which runs the whole sequence and fills the prefix cache;
- cached step: a later step that runs only the target rows against the cache;
- our uncached/cached time ratio next to the ratio FlopCounterMode predicts for our two forwards.

`--roofline` adds where our cached step's process CPU time goes (GEMMs, attention, norms, RoPE, modulation, copies,
the rest) and the fraction of this machine's GEMM roofline its GEMMs reach (dit_roofline.py); `--roofline-only` skips
the comparison.

    python benchmarks/bench_dit.py [--layers 4] [--repeats 5] [--threads N] [--roofline | --roofline-only]
"""

import argparse
import statistics
import time
from functools import partial

import torch
from torch.utils.flop_counter import FlopCounterMode

import bench_pack  # noqa: E402,F401  (registers the repository as package `qi21`)
from qi21.model.encoders.conditioning import Conditioning  # noqa: E402
from qi21.model.loaders.dit_keys import convert_state_dict  # noqa: E402
from qi21.model.transformer.dit import DiTConfig, PrefixInputs, QwenImage21DiT  # noqa: E402
from qi21.model.transformer.prefix_cache import PrefixKVCache  # noqa: E402

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


def main():
    def add(parser):
        parser.add_argument("--roofline", action="store_true", help="also the cached step's breakdown")
        parser.add_argument("--roofline-only", action="store_true", help="only the cached step's breakdown")

    args = cpu_bench_args(__doc__, layers=4, repeats=5, add=add)
    reference, ours, ReferenceCache = build_models(args.layers)
    if not args.roofline_only:
        compare(args, reference, ours, ReferenceCache)
    if args.roofline or args.roofline_only:
        roofline(args, reference, ours, ReferenceCache)


def roofline(args, reference, ours, ReferenceCache) -> None:
    import dit_roofline

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


if __name__ == "__main__":
    main()
