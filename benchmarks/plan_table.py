"""The memory planner's choices for the released model on common GPUs, as Markdown tables (for docs/measurements.md).

No GPU or weights needed: the planner works from sizes (model/memory/planner.py). For each card, each workload at
1024x1024 (text-to-image, a one-reference edit, a three-reference edit of 1024x1024 references, a 75-token prompt,
batch 1, cfg 1) and each DiT weight format (bf16; int8: one byte per block linear weight plus a per-row fp32
scale), it prints the plan of every phase, the predicted device peak and the host's peak over the whole pipeline
(model/memory/host.py: the DiT deferred, the text encoder offloaded to host memory after encoding).

Assumptions (flags change them): a card of N GiB gives a run N GiB minus 600 MiB (CUDA context, other processes)
minus ComfyUI's 400 MiB reserve; 64 GiB of host RAM; the bf16 Qwen3-VL 8B text encoder; the released VAE in bf16.

    python benchmarks/plan_table.py [--cards 8 12 16 24 48 80] [--host-gib 64] [--format bf16 int8]
"""

import argparse

import bench_pack  # noqa: E402,F401  (registers the repository as package `qi21`)
from qi21.model.memory.estimate import (
    GIB,  # noqa: E402
    EncoderDims,
    VAEShape,
    encode_transient,
    synthetic_encoder_weights,
)
from qi21.model.memory.host import plan_host
from qi21.model.memory.planner import Budget, PlanError, RunShape, plan_layers, plan_run
from qi21.model.memory.weights import synthetic_dit_weights
from qi21.model.transformer.dit import DiTConfig  # noqa: E402

WORKLOADS = (("t2i", 0), ("edit, 1 ref", 1), ("edit, 3 refs", 3))
TEXT_TOKENS, TEMPLATE_TOKENS = 75, 64


def rows(cards, host_gib: float, formats, size: int = 1024):
    config, itemsize = DiTConfig(), 2
    encoder = synthetic_encoder_weights()
    vae = VAEShape.released(itemsize)
    for fmt in formats:
        weights = synthetic_dit_weights(config, fmt)
        for card in cards:
            budget = Budget.gpu(int(card * GIB), host_bytes=int(host_gib * GIB))
            for name, refs in WORKLOADS:
                run = RunShape.released(size, refs, TEXT_TOKENS)
                tokens = TEXT_TOKENS + TEMPLATE_TOKENS + refs * (size // 32) ** 2
                transient = encode_transient(EncoderDims(), tokens, refs * (size // 16) ** 2, itemsize)
                try:
                    te = plan_layers(encoder, transient, budget)
                    te_label, te_peak = te.label, te.peak
                except PlanError:
                    te, te_label, te_peak = None, "does not fit", None
                try:
                    plan = plan_run(weights, config, run, budget, itemsize, vae=vae)
                except PlanError:
                    yield (fmt, card, name, te_label, "does not fit", "", "", None, te_peak, None, None, None)
                    continue
                phases = plan.phases
                sampling = max(phases.get("prefill", 0), phases.get("cached", 0))
                host = None if te is None else plan_host(encoder, te, weights, plan, vae.weight_bytes).peak
                yield (fmt, card, name, te_label, plan.weights_label, plan.cache, plan.decode, sampling, te_peak,
                       phases["decode"], plan.copied_per_step, host)


def gib(value) -> str:
    return "-" if value is None else f"{value / GIB:.1f}"


def markdown(cards, host_gib, formats) -> str:
    lines = []
    current = None
    for row in rows(cards, host_gib, formats):
        fmt = row[0]
        if fmt != current:
            current = fmt
            lines += ["", f"**DiT weights {fmt}** ({synthetic_dit_weights(DiTConfig(), fmt).total / GIB:.1f} GiB)",
                      "",
                      "| GPU | workload | text encoder | DiT weights | prefix cache | decode | peak GiB: encode / "
                      "sample / decode | copied per step | host peak GiB |",
                      "|---|---|---|---|---|---|---|---|---|"]
        _, card, name, te, weights, cache, decode, sampling, te_peak, dec, copied, host = row
        moved = "-" if copied is None else ("0" if copied == 0 else f"{copied / GIB:.1f} GiB")
        lines.append(f"| {card} GB | {name} | {te} | {weights} | {cache} | {decode} | {gib(te_peak)} / "
                     f"{gib(sampling)} / {gib(dec)} | {moved} | {gib(host)} |")
    return "\n".join(lines).lstrip()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cards", type=float, nargs="+", default=[8, 12, 16, 24, 48, 80], help="GPU sizes in GiB")
    parser.add_argument("--host-gib", type=float, default=64, help="host RAM available for pinned weights")
    parser.add_argument("--format", nargs="+", default=["bf16", "int8"], choices=["bf16", "fp16", "fp8", "int8"])
    args = parser.parse_args(argv)
    cards = [int(c) if c == int(c) else c for c in args.cards]
    print(markdown(cards, args.host_gib, args.format))


if __name__ == "__main__":
    main()
