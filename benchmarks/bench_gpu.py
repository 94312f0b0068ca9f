"""GPU benchmark at the released width: ours vs diffusers 0.42.1 on the same random weights, one run.

The full model's shape (width 4096, 32 heads of 128, SwiGLU 12288, text width 4096) with `--layers` blocks
(32 = the whole 7B model), bf16, a 1024x1024 target (4096 tokens), 75 text tokens and 0/1/2 references of
1024x1024 (4096 tokens each). Times are CUDA-event medians after warm-up, interleaved ours/diffusers. Also
prints the largest difference between the two outputs, cache sizes (batch 1 and 4), peak memory, and the
flex-attention prefill (compiled) against the SDPA one.

    python benchmarks/bench_gpu.py [--layers 32] [--repeats 5] [--no-flex]
"""

import argparse
import statistics
import time
from functools import partial

import torch

import bench_pack  # noqa: E402,F401  (registers the repository as package `qi21`)
from qi21.model.encoders.conditioning import Conditioning  # noqa: E402
from qi21.model.loaders.dit_keys import convert_state_dict  # noqa: E402
from qi21.model.transformer.dit import DiTConfig, PrefixInputs, QwenImage21DiT  # noqa: E402
from qi21.model.transformer.prefix_cache import PrefixKVCache  # noqa: E402

TEXT, TARGET, REFERENCE = 75, (64, 64), (64, 64)


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


def build(layers: int, device, dtype):
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


def inputs(references: int, batch: int, device, dtype):
    slots = [False] * 20
    for _ in range(references):
        slots += [True] * (REFERENCE[0] * REFERENCE[1] // 4) + [False] * 3
    slots += [False] * (TEXT - slots.count(False))
    slot_mask = torch.tensor(slots)
    text = torch.randn(len(slots), 4096, device=device, dtype=dtype) * 10
    refs = torch.randn(references * REFERENCE[0] * REFERENCE[1], 64, device=device, dtype=dtype)
    target = torch.randn(batch, TARGET[0] * TARGET[1], 64, device=device, dtype=dtype)
    cond = Conditioning(text=text, image_slots=slot_mask, references=refs if references else None,
                        ref_shapes=(REFERENCE,) * references)
    prefix = PrefixInputs(layout=cond.layout(TARGET), text=text, references=cond.references)
    reference_kwargs = dict(
        hidden_states=torch.cat([refs[None].expand(batch, -1, -1), target], dim=1),
        encoder_hidden_states=text[None].expand(batch, -1, -1),
        img_shapes=[[(1, *REFERENCE)] * references + [(1, *TARGET)]] * batch,
        img_mask=torch.cat([slot_mask, torch.ones(TARGET[0] * TARGET[1] // 4, dtype=torch.bool)])[None]
        .expand(batch, -1).to(device),
    )
    return prefix, target, reference_kwargs


def profile_steps(ours, reference, layers, device, dtype, t):
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache
    from torch.profiler import ProfilerActivity, profile

    prefix, target, kwargs = inputs(2, 1, device, dtype)
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one cached step each")
    args = parser.parse_args()
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    device, dtype = torch.device("cuda"), torch.bfloat16
    started = time.time()
    reference, ours = build(args.layers, device, dtype)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, {args.layers} layers at full width, "
          f"target 1024x1024, text {TEXT} tokens; built in {time.time() - started:.0f} s", flush=True)
    print("refs | prefix tokens | prefill ours/diffusers (ms) | cached step ours/diffusers (ms) | rel. diff cached "
          "| cache GiB ours / diffusers (batch 4) | extra GiB of a cached step ours / diffusers (batch 4)", flush=True)
    t = torch.tensor([0.8], device=device)
    with torch.inference_mode():
        for references in (0, 1, 2):
            prefix, target, kwargs = inputs(references, 1, device, dtype)
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
            prefix4, target4, kwargs4 = inputs(references, 4, device, dtype)
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
            prefix, target, _ = inputs(2, 1, device, dtype)
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


if __name__ == "__main__":
    main()
