"""The node path in a real ComfyUI server, timed against diffusers' loop on the same weights, in one run.

A ComfyUI server (tests/comfyui/qi21_comfy_harness.py: a temporary base directory, this repository as a custom
node) runs a scaled DiT (`--layers` blocks of width 1024, heads of 128, SwiGLU x3; the tiny text encoder and VAE),
one 512x512 reference and a 512x512 target (1,024 + 1,024 latent tokens), fp32 on the CPU. Each prompt changes
only the seed, so ComfyUI re-runs only the sampler (and the SaveLatent after it); its time is the server's own
`execution_start` -> `execution_success` timestamps. diffusers' loop on the same weights (`kv_cache_mode` extract then
cached, FlowMatchEulerDiscreteScheduler, as its pipeline runs them) runs as a benchmark-only node in the same server
(benchmarks/comfyui_diffusers_loop.py, copied into its custom_nodes/), timed the same way, its prompts interleaved
with ours.

Printed (medians of `--repeats`):
- the cached step: (12-step prompt - 2-step prompt) / 10, ours over diffusers' loops of the same lengths;
- the 8-step loop: a Turbo-sampler prompt (its stored 8 sigmas) over diffusers' 8-step loop;
- our uncached over cached step (the sampler's `prefix_cache` off) next to the FLOP count's prediction.

`--profile FILE` also records the server with py-spy (`pip install py-spy`) over `--profile-prompts` prompts of
`--profile-steps` steps (default 3 of 12) after the timed ones (`--repeats 0`: the profile alone) and prints where
their time went: the DiT's blocks, the rest of the DiT call, the
sampling loop, the node, ComfyUI's executor, and the functions outside the blocks that took the most.

    QI21_COMFYUI=/path/to/ComfyUI python benchmarks/bench_comfyui.py [--comfyui PATH] [--python PATH]
        [--layers 3] [--repeats 3] [--profile /tmp/qi21.txt]
"""

import argparse
import collections
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

import bench_pack  # noqa: F401  (registers the repository as package `qi21`)
from bench_dit import build_inputs, flops

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "comfyui"))
import qi21_comfy_harness as harness  # noqa: E402
from qi21.demo import tiny_checkpoints as tiny  # noqa: E402
from qi21.model.loaders.dit_keys import convert_state_dict  # noqa: E402
from qi21.model.transformer.dit import DiTConfig, QwenImage21DiT  # noqa: E402

SIDE = 512  # target and reference, px: 32 x 32 = 1,024 latent tokens each
GRID = SIDE // 16
DIT_FILE = "qi21_bench_dit.safetensors"  # no variant in the name: both samplers take it without a note
DIFFUSERS_WEIGHTS = "diffusers_dit.safetensors"  # in the base directory, diffusers' layout, fp32
REFERENCE_IMAGE = "qi21_bench_reference.png"
PROMPT = "Turn the sky in <image1> into a warm sunset with pink clouds; keep everything else unchanged."


def bench_config(layers: int) -> DiTConfig:
    # the tiny text encoder's width as the context (its projection is noise next to the blocks)
    return DiTConfig(num_layers=layers, num_heads=8, head_dim=128, context_in_dim=tiny.TINY_DIT.context_in_dim,
                     mlp_ratio=3)


class BenchServer(harness.ComfyServer):
    """The test harness's server, plus the scaled DiT (ours in ComfyUI's layout, diffusers' copy beside it), the
    reference image and the diffusers-loop node."""

    def __init__(self, comfyui: Path, python: str, base: Path, weights: dict, config: DiTConfig):
        super().__init__(comfyui, python, base)
        self.weights, self.config = weights, config

    @property
    def diffusers_weights(self) -> str:
        return str(self.base / DIFFUSERS_WEIGHTS)

    def prepare(self) -> None:
        super().prepare()
        comfy = {k: v.to(torch.bfloat16) for k, v in tiny.comfy_dit_state_dict(self.weights).items()}
        save_file(comfy, str(self.base / "models" / "diffusion_models" / DIT_FILE))
        save_file(self.weights, self.diffusers_weights)  # the same (bf16-exact) values, read as fp32 by both
        config = self.config
        Path(self.diffusers_weights + ".json").write_text(json.dumps({
            "num_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "attention_head_dim": config.head_dim, "context_in_dim": config.context_in_dim,
            "mlp_ratio": config.mlp_ratio}))
        node = self.base / "custom_nodes" / "qi21_bench_diffusers"
        node.mkdir()
        shutil.copyfile(Path(__file__).with_name("comfyui_diffusers_loop.py"), node / "__init__.py")
        y, x = np.mgrid[0:SIDE, 0:SIDE] / SIDE
        pixels = np.stack([x, y, 0.5 + 0.5 * np.sin(7 * (x + y))], -1)
        Image.fromarray((pixels * 255).astype(np.uint8), "RGB").save(self.base / "input" / REFERENCE_IMAGE)


def graph(steps: int, seed: int, turbo: bool = False, cache: str = "on") -> dict:
    sampler = {"seed": seed, "width": SIDE, "height": SIDE, "batch_size": 1, "prefix_cache": cache,
               "keep_cache": False, "model": ["1", 0], "positive": ["6", 0]}
    if not turbo:
        sampler.update(steps=steps, cfg=1.0)
    return {
        "1": {"class_type": "QI21ModelLoader", "inputs": {"model_name": DIT_FILE,
                                                         "weight_dtype": "fp32", "attention": "auto", "plan": "auto"}},
        "2": {"class_type": "QI21TextEncoderLoader", "inputs": {"text_encoder_name": tiny.TEXT_ENCODER_FILE,
                                                               "weight_dtype": "default", "device": "default"}},
        "3": {"class_type": "QI21VAELoader", "inputs": {"vae_name": tiny.VAE_FILE, "weight_dtype": "default"}},
        "4": {"class_type": "LoadImage", "inputs": {"image": REFERENCE_IMAGE}},
        "5": {"class_type": "QI21Reference", "inputs": {"resolution": SIDE, "vae": ["3", 0], "image": ["4", 0],
                                                        "mask": ["4", 1]}},
        "6": {"class_type": "QI21TextEncode", "inputs": {"prompt": PROMPT, "text_encoder": ["2", 0],
                                                         "references": ["5", 0]}},
        "7": {"class_type": "QI21TurboSampler" if turbo else "QI21Sampler", "inputs": sampler},
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": "bench/latent"}},
    }


def diffusers_graph(server: BenchServer, steps: int, seed: int, prefix_tokens: int) -> dict:
    """diffusers' loop, plus our graph's upstream nodes unconnected: ComfyUI drops the cached outputs of nodes a prompt
    lacks, so without them our next prompt would reload and re-encode everything."""
    ours = {key: node for key, node in graph(2, 0).items() if node["class_type"] not in ("QI21Sampler", "SaveLatent")}
    return ours | {
        "101": {"class_type": "QI21BenchDiffusersLoop", "inputs": {"weights": server.diffusers_weights, "steps": steps,
                                                                "prefix_tokens": prefix_tokens, "grid": GRID,
                                                                "seed": seed}},
        "102": {"class_type": "SaveLatent", "inputs": {"samples": ["101", 0], "filename_prefix": "bench/diffusers"}},
    }


def timed_prompt(server: harness.ComfyServer, prompt: dict) -> tuple[float, dict]:
    """Run an API-format prompt; (its execution seconds from the server's own `execution_start` ->
    `execution_success` timestamps, its history outputs)."""
    entry = server.run_prompt(prompt)
    status = entry["status"]
    if status["status_str"] != "success":
        raise RuntimeError(f"the prompt failed: {status}\n{server.log_tail()}")
    stamps = {event: data["timestamp"] for event, data in status["messages"] if "timestamp" in data}
    return (stamps["execution_success"] - stamps["execution_start"]) / 1000, entry["outputs"]


class Prompts:
    """Queues prompts on the server; each one's execution time from the server's own timestamps."""

    def __init__(self, server: BenchServer):
        self.server, self.seed, self.prefix_tokens = server, 0, None

    def _timed(self, prompt: dict) -> tuple[float, dict]:
        return timed_prompt(self.server, prompt)

    def ours(self, steps: int, turbo: bool = False, cache: str = "on") -> tuple[float, dict]:
        self.seed += 1
        seconds, outputs = self._timed(graph(steps, self.seed, turbo, cache))
        report = outputs["7"]["qi21_report"][0]
        self.prefix_tokens = report["prefix_tokens"]
        return seconds, report

    def diffusers(self, steps: int) -> float:
        self.seed += 1
        return self._timed(diffusers_graph(self.server, steps, self.seed, self.prefix_tokens))[0]


def flop_prediction(weights: dict, config: DiTConfig, prefix_tokens: int) -> float:
    """Uncached over cached FLOPs of our DiT at these shapes (bench_dit.flops: GEMMs and attention)."""
    from qi21.model.transformer.prefix_cache import PrefixKVCache

    model = QwenImage21DiT(config).eval()
    model.load_state_dict(convert_state_dict(weights))
    prefix, target, _, _ = build_inputs(1, text_tokens=prefix_tokens - GRID * GRID,
                                        context_dim=config.context_in_dim, grid=(GRID, GRID))
    t, cache = torch.tensor([0.5]), PrefixKVCache()
    with torch.inference_mode():
        model(target, t, [prefix], cache=cache, mode="prefill")
        return flops(lambda: model(target, t, [prefix])) / flops(lambda: model(target, t, [prefix], cache=cache,
                                                                                    mode="cached"))


# -- profile ------------------------------------------------------------------------------------------------------
#: (label, marker): a sample belongs to the first label one of whose markers is among its frames.
PROFILE_GROUPS = (
    ("DiT blocks (arithmetic)", ("model/transformer/block.py",)),
    ("DiT call outside the blocks", ("model/transformer/dit.py",)),
    ("sampling loop (model/sampling)", ("model/sampling/",)),
    ("sampler node outside the loop (nodes/)", (f"{harness.pack_dir_name()}/nodes/", f"{REPO.name}/nodes/")),
    ("ComfyUI executor and other nodes", ("execution.py",)),
)


def profile(server: BenchServer, prompts: Prompts, out: Path, count: int, steps: int) -> None:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    recorder = subprocess.Popen([py_spy, "record", "--pid", str(server.proc.pid),
                                 "--format", "raw", "--rate", "200", "--output", str(out), "--nonblocking", "--idle"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(2)
    seconds = sum(prompts.ours(steps)[0] for _ in range(count))
    recorder.send_signal(signal.SIGINT)  # py-spy writes its file when interrupted
    recorder.wait(timeout=60)
    stacks = collections.Counter()
    for line in out.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            stacks[stack] += int(n)
    # the prompt worker's stacks while it executes (waiting in PromptQueue.get is its idle time between prompts)
    executing = {s: n for s, n in stacks.items() if "execution.py" in s and "PromptQueue.get" not in s}
    total = sum(executing.values()) or 1
    groups, outside = collections.Counter(), collections.Counter()
    for stack, n in executing.items():
        label = next(label for label, markers in PROFILE_GROUPS if any(m in stack for m in markers))
        groups[label] += n
        if label != PROFILE_GROUPS[0][0]:
            outside[stack.split(";")[-1]] += n
    per_prompt = seconds / count * 1e3
    print(f"\nprofile: py-spy over {count} prompts of {steps} steps ({per_prompt:.0f} ms each), {total} samples "
          f"while ComfyUI executed; raw stacks in {out}")
    print("where | share | ms per prompt")
    for label, _ in PROFILE_GROUPS:
        print(f"{label} | {groups[label] / total:.1%} | {groups[label] / total * per_prompt:.1f}")
    print("top functions outside the DiT's blocks | share | ms per prompt")
    for frame, n in outside.most_common(12):
        print(f"{frame} | {n / total:.2%} | {n / total * per_prompt:.1f}")


def print_table(times: dict, args, report: dict, predicted: float) -> None:
    med = {name: statistics.median(values) for name, values in times.items()}
    step = {side: (med[f"{side} 12"] - med[f"{side} 2"]) / 10 for side in ("ours", "diffusers", "uncached")}
    print(f"torch {torch.__version__} (this process), fp32 CPU, {args.layers} blocks of width 1024, "
          f"{report['prefix_tokens']} prefix + {report['target_tokens']} target tokens, real ComfyUI, "
          f"median of {args.repeats}")
    print("measure | ours | diffusers | ours/diffusers")
    print(f"cached step (12-step - 2-step prompt) / 10 | {step['ours'] * 1e3:.0f} ms | "
          f"{step['diffusers'] * 1e3:.0f} ms | {step['ours'] / step['diffusers']:.3f}")
    print(f"8-step loop (Turbo sampler prompt) | {med['ours turbo'] * 1e3:.0f} ms | "
          f"{med['diffusers 8'] * 1e3:.0f} ms | {med['ours turbo'] / med['diffusers 8']:.3f}")
    print(f"2-step prompt | {med['ours 2'] * 1e3:.0f} ms | {med['diffusers 2'] * 1e3:.0f} ms | "
          f"{med['ours 2'] / med['diffusers 2']:.3f}")
    measured = step["uncached"] / step["ours"]
    print(f"uncached / cached step: {measured:.2f} (FLOPs predict {predicted:.2f}; "
          f"{measured / predicted:.2f}x the prediction)")
    print(f"the sampler's own report, first prompt: prefill {report['prefill_seconds']} s, "
          f"step {report['step_seconds']} s")


def server_args(doc: str, add) -> argparse.Namespace:
    """The command line of a benchmark that starts a ComfyUI: `--comfyui` (default $QI21_COMFYUI, checked) and
    `--python` (default $QI21_COMFYUI_PYTHON, else this interpreter), and what `add(parser)` adds."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--comfyui", default=os.environ.get(harness.ENV_COMFYUI, ""))
    parser.add_argument("--python", default=os.environ.get(harness.ENV_PYTHON, "") or sys.executable)
    add(parser)
    args = parser.parse_args()
    if not (Path(args.comfyui) / "main.py").is_file():
        parser.error("--comfyui (or QI21_COMFYUI) must name a ComfyUI checkout (the folder with main.py)")
    return args


def main():
    def add(parser):
        parser.add_argument("--layers", type=int, default=3)
        parser.add_argument("--repeats", type=int, default=3)
        parser.add_argument("--profile", type=Path, default=None)
        parser.add_argument("--profile-prompts", type=int, default=3)
        parser.add_argument("--profile-steps", type=int, default=12)

    args = server_args(__doc__, add)

    config = bench_config(args.layers)
    weights = tiny.dit_state_dict(config, seed=7)
    with tempfile.TemporaryDirectory(prefix="qi21-bench-") as base:
        server = BenchServer(Path(args.comfyui), args.python, Path(base), weights, config)
        server.start()
        try:
            prompts = Prompts(server)
            _, report = prompts.ours(2)  # loads everything; the upstream nodes stay cached from here on
            for warm in (lambda: prompts.diffusers(2), lambda: prompts.ours(8, turbo=True),
                         lambda: prompts.ours(2, cache="off")):
                warm()
            times = collections.defaultdict(list)
            for _ in range(args.repeats):  # interleaved, so the machine's drift hits both sides alike
                for steps in (2, 12):
                    times[f"ours {steps}"].append(prompts.ours(steps)[0])
                    times[f"diffusers {steps}"].append(prompts.diffusers(steps))
                    times[f"uncached {steps}"].append(prompts.ours(steps, cache="off")[0])
                times["ours turbo"].append(prompts.ours(8, turbo=True)[0])
                times["diffusers 8"].append(prompts.diffusers(8))
            if args.repeats > 0:  # 0: the profile alone
                print_table(times, args, report, flop_prediction(weights, config, report["prefix_tokens"]))
            if args.profile:
                profile(server, prompts, args.profile, args.profile_prompts, args.profile_steps)
        finally:
            server.stop()

if __name__ == "__main__":
    main()
