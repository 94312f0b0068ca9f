"""Partial prefix reuse benchmark: a new instruction after the same two references, in one run, ratios printed.

The scaled shape of `bench_dit.py` (heads of 128, width 1024, SwiGLU x3, a 1024-token target; only the layer count
is cut), with 2 references of 1024 tokens and a ~75-token instruction after them. Interleaved medians of:
- the DiT's first step for the new instruction with the references' rows reused from the previous prompt's kept
  cache (a chunked prefill: the instruction rows and the target) against a full prefill, next to the ratio
  FlopCounterMode predicts for the two calls;
- the tiny text encoder (tests/te_fixtures.py) encoding the new instruction with its prompt cache holding the
  references against a full encode (the cache emptied before each one);
- the prefix cache's bytes under true CFG (a positive and a negative prompt after the same references) with the
  shared run held once against one copy per prompt (what the cache held before).

    python benchmarks/bench_prefix_reuse.py [--layers 4] [--repeats 5] [--threads N]
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
from bench_dit import build_models, cpu_bench_args, flops
from qi21.model.encoders.conditioning import Conditioning
from qi21.model.sampling.run_caches import share_leading_runs
from qi21.model.transformer.dit import PrefixInputs
from qi21.model.transformer.prefix_cache import PrefixKVCache
from qi21.model.transformer.prefix_runs import prefix_runs

LEAD = 20  # template tokens before the first reference
REFERENCE = (32, 32)  # latent tokens: a 512x512 reference, 1024 tokens
TARGET = (32, 32)
INSTRUCTION = 75


def conditioning(instruction_seed: int, instruction: int = INSTRUCTION) -> Conditioning:
    """`[20 text | ref | 3 text | ref | 3 text | instruction]`; the leading rows are the same for every seed."""
    lead = torch.Generator().manual_seed(0)
    slots = [False] * LEAD + ([True] * (REFERENCE[0] * REFERENCE[1] // 4) + [False] * 3) * 2
    text = [torch.randn(len(slots), 1024, generator=lead),
            torch.randn(instruction, 1024, generator=torch.Generator().manual_seed(instruction_seed))]
    slots += [False] * instruction
    references = torch.randn(2 * REFERENCE[0] * REFERENCE[1], 64, generator=lead)
    return Conditioning(text=torch.cat(text), image_slots=torch.tensor(slots), references=references,
                        ref_shapes=(REFERENCE, REFERENCE))


def prefix_of(cond: Conditioning) -> PrefixInputs:
    return PrefixInputs(layout=cond.layout(TARGET), text=cond.text, references=cond.references)


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
    old, new = prefix_of(conditioning(1)), prefix_of(conditioning(2))
    target = torch.randn(1, TARGET[0] * TARGET[1], 64)
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
        negative = prefix_of(conditioning(3, instruction=10))
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


def main():
    args = cpu_bench_args(__doc__, layers=4, repeats=5)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 CPU, DiT {args.layers} layers, width "
          f"1024, heads 8x128, target 1024 tokens, 2 references of 1024 tokens, {INSTRUCTION}-token instruction, "
          f"median of {args.repeats}")
    print("measure | time or size | ratio | note")
    for row in dit_rows(args.layers, args.repeats) + text_encoder_rows(args.repeats):
        print(row)


if __name__ == "__main__":
    main()
