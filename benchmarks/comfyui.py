"""Whole prompts in a real ComfyUI server, in one run each: our nodes against diffusers' loop (`speed`), and the
Step Cache node over without (`step-cache`).

    QI21_COMFYUI=/path/to/ComfyUI python benchmarks/comfyui.py speed [--layers 3] [--repeats 3] [--profile FILE]
    QI21_COMFYUI=/path/to/ComfyUI python benchmarks/comfyui.py step-cache [--steps 40] [--repeats 8] [--threads 1]

Both start a server through the real-ComfyUI tests' harness (tests/comfyui/qi21_comfy_harness.py; `--comfyui`,
`--python` or the same two settings as the tests) and time prompts by the server's own `execution_start` ->
`execution_success` timestamps. `python benchmarks/comfyui.py QUESTION --help` says what each prints.
"""

import argparse
import collections
import dataclasses
import json
import os
import random
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
from speed import build_inputs, flops

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "comfyui"))
import qi21_comfy_harness as harness  # noqa: E402
from qi21.demo import tiny_checkpoints as tiny, toy_data  # noqa: E402
from qi21.demo.toy_model import TOY_DIR, TOY_DIT, TOY_SIZE, write_toy_checkpoints  # noqa: E402
from qi21.model.loaders.dit_keys import convert_state_dict  # noqa: E402
from qi21.model.sampling.step_cache import StepCacheOptions  # noqa: E402
from qi21.model.transformer.dit import DiTConfig, QwenImage21DiT  # noqa: E402

# -- speed: our nodes against diffusers' loop in the same server -----------------------------------------
SPEED_HELP = """The node path in a real ComfyUI server, timed against diffusers' loop on the same weights, in one run.

A ComfyUI server (tests/comfyui/qi21_comfy_harness.py: a temporary base directory, this repository as a custom
node) runs a scaled DiT (`--layers` blocks of width 1024, heads of 128, SwiGLU x3; the tiny text encoder and VAE),
one 512x512 reference and a 512x512 target (1,024 + 1,024 latent tokens), fp32 on the CPU. Each prompt changes
only the seed, so ComfyUI re-runs only the sampler (and the SaveLatent after it); its time is the server's own
`execution_start` -> `execution_success` timestamps. diffusers' loop on the same weights (`kv_cache_mode` extract then
cached, FlowMatchEulerDiscreteScheduler, as its pipeline runs them) runs as a benchmark-only node in the same server
(benchmarks/parts/comfyui_diffusers_loop.py, copied into its custom_nodes/), timed the same way, its prompts
interleaved with ours.

Printed (medians of `--repeats`):
- the cached step: (12-step prompt - 2-step prompt) / 10, ours over diffusers' loops of the same lengths;
- the 8-step loop: a Turbo-sampler prompt (its stored 8 sigmas) over diffusers' 8-step loop;
- our uncached over cached step (the sampler's `prefix_cache` off) next to the FLOP count's prediction.

`--profile FILE` also records the server with py-spy (`pip install py-spy`) over `--profile-prompts` prompts of
`--profile-steps` steps (default 3 of 12) after the timed ones (`--repeats 0`: the profile alone) and prints where
their time went: the DiT's blocks, the rest of the DiT call, the
sampling loop, the node, ComfyUI's executor, and the functions outside the blocks that took the most.

    QI21_COMFYUI=/path/to/ComfyUI python benchmarks/comfyui.py speed [--comfyui PATH] [--python PATH]
        [--layers 3] [--repeats 3] [--profile /tmp/qi21.txt]
"""
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
        shutil.copyfile(Path(__file__).parent / "parts" / "comfyui_diffusers_loop.py", node / "__init__.py")
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
    """Uncached over cached FLOPs of our DiT at these shapes (speed.flops: GEMMs and attention)."""
    from qi21.model.prefix_cache.layout import PrefixKVCache

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


def print_speed_table(times: dict, args, report: dict, predicted: float) -> None:
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


def server_args(doc: str, add, argv=None, prog: str = "comfyui.py") -> argparse.Namespace:
    """The command line of a benchmark that starts a ComfyUI: `--comfyui` (default $QI21_COMFYUI, checked) and
    `--python` (default $QI21_COMFYUI_PYTHON, else this interpreter), and what `add(parser)` adds."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--comfyui", default=os.environ.get(harness.ENV_COMFYUI, ""))
    parser.add_argument("--python", default=os.environ.get(harness.ENV_PYTHON, "") or sys.executable)
    add(parser)
    args = parser.parse_args(argv)
    if not (Path(args.comfyui) / "main.py").is_file():
        parser.error("--comfyui (or QI21_COMFYUI) must name a ComfyUI checkout (the folder with main.py)")
    return args


def run_speed(argv=None) -> None:
    def add(parser):
        parser.add_argument("--layers", type=int, default=3)
        parser.add_argument("--repeats", type=int, default=3)
        parser.add_argument("--profile", type=Path, default=None)
        parser.add_argument("--profile-prompts", type=int, default=3)
        parser.add_argument("--profile-steps", type=int, default=12)

    args = server_args(SPEED_HELP, add, argv, "comfyui.py speed")

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
                print_speed_table(times, args, report, flop_prediction(weights, config, report["prefix_tokens"]))
            if args.profile:
                profile(server, prompts, args.profile, args.profile_prompts, args.profile_steps)
        finally:
            server.stop()


# -- step-cache: the Step Cache node at its defaults over without ------------------------------------------------
STEP_CACHE_HELP = """The step cache end to end: whole prompts on the trained toy in a real ComfyUI server, with the
Step Cache node at its defaults over without, interleaved in one run, next to what the skipped share predicts.

A ComfyUI server (tests/comfyui/qi21_comfy_harness.py: a temporary base directory, this repository as a custom
node) gets the trained toy (demo/toy_model.py, every file layout, under the released file names) and a random Fun
ControlNet for the toy's config (`controlnet_state_dict`, 2 control blocks: one per 2 base blocks, as the released
16 per 32). Every prompt is a whole one in API form through /prompt: text encode -> Qwen-Image 2.1 Sampler
(`--steps` Base steps, 256x256, cfg 1) -> VAE decode -> SaveImage. Three pairs, each one side without the step cache
and one through a `QI21StepCache` node at its defaults (mode t8: T8's 0.08, 10% to 85%, 2 skips in a row):

    plain          a new caption from the toy's vocabulary (demo/toy_data.py) and a new seed per prompt pair
    Fun ControlNet the same through QI21ControlNetApply (strength 1, the whole schedule; a toy scene as the map)
    kept cache     keep_cache on and one caption throughout, a new seed each time: every timed prompt is a kept-
                   cache hit (no prefill; its first step is never skipped)

Within a pair both sides get the same caption and seed (the same trajectory to decide on), and each side has its own
text-encode node, so both re-encode a new caption; every prompt holds every node of the others (ComfyUI drops the
cached outputs of nodes a prompt lacks), so only what changed runs again. The pairs run interleaved, without/with
in turn (the order flips every repeat), after one untimed prompt of each kind. Time = the server's own
`execution_start` -> `execution_success` timestamps (`timed_prompt`, as `speed`'s); the skipped
steps come from the sampler's report (`qi21_report.step_cache`).

What the skipped share predicts. Only the sampling loop's steps change: a skipped step still runs everything before
block 0 (the timestep embedding, img_in), block 0 (with control block 0, injected right after it), the output layer
and the loop around the model (the Euler update, progress); it saves blocks 1..N-1 (and their control blocks). So

    predicted with / without = 1 - k * beta * c / T

with k the skipped steps per prompt (the mean over the timed prompts), c the cached step's seconds (the median of the
sampler's own `step_seconds` without the step cache), T the median prompt time without, and beta the share of a
cached full step spent in blocks 1..N-1 (with the control blocks injected after them). beta is clocked after the
server stopped, in this process, by a prompt through the same nodes whose interrupt check (which the loop calls after
every block and after every step) is a timestamp: beta = (after block N-1 - after block 0) / (the step's end - the
previous step's end), the median over the cached full steps. As a product: s * (n * c / T) * beta, with s = k / n
the skipped share and n * c / T about the loop's share of the prompt (the rest: the first step's prefill, text
encode, VAE decode, saving, ComfyUI). It leaves out the step cache's own cost (the sampled indicator, the residual's
copies), which the measured ratio includes.

`skipped / full step`: the same clock on a prompt with the step cache, a skipped step's seconds over a full one's
(without), next to the 1 - beta the model says; the line under the table also gives a full step with the step cache
(what its indicator and copies add). At 32 blocks: 1 - s * 31/32 (1 - s * 46/48 with the released
16-block control net: base block 0 and control block 0 still run), the same skipped share as if the DiT's blocks
were all of the prompt's time: the most it could save.

`--threads N` sets torch's threads in the server (OMP_NUM_THREADS) and here. On a 2-core machine, 1 leaves a core to
this client and ComfyUI's HTTP thread; with both cores in the server's pool some prompts took 10-20x their median.

    QI21_COMFYUI=/path/to/ComfyUI python benchmarks/comfyui.py step-cache [--comfyui PATH] [--python PATH]
        [--steps 40] [--repeats 8] [--weight-dtype default] [--toy DIR] [--threads N]
        [--json FILE]

Random weights would run it too, but only the trained toy has denoising dynamics for the indicator to read.
"""
CONTROLNET_FILE = "qi21_bench_toy_fun_controlnet.safetensors"
CONTROL_BLOCKS = TOY_DIT.num_layers // 2  # one per 2 base blocks, as the released 16 per 32
CONTROL_IMAGE = "qi21_bench_control.png"
RELEASED_BLOCKS, RELEASED_CONTROL_BLOCKS = 32, 16
KEPT_CAPTION = "a large red circle in the center, white background"
PAIRS = ("plain", "Fun ControlNet", "kept cache")
SAMPLER = "20"
#: The Step Cache node's widgets at their defaults (T8's; an API prompt names every widget).
STEP_CACHE_DEFAULTS = dataclasses.asdict(StepCacheOptions())


class ToyServer(harness.ComfyServer):
    """The test harness's server with the trained toy in place of the random tiny set, the toy-sized Fun ControlNet
    and a control map."""

    def __init__(self, comfyui: Path, python: str, base: Path, toy: Path):
        super().__init__(comfyui, python, base)
        self.toy = toy

    @property
    def models(self) -> Path:
        return self.base / "models"

    def write_models(self, models: Path) -> None:
        write_toy_checkpoints(models, self.toy)  # the released file names and layouts, as the tiny set's
        net = tiny.controlnet_state_dict(TOY_DIT, seed=5, blocks=CONTROL_BLOCKS)
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in net.items()},
                  str(models / "model_patches" / CONTROLNET_FILE))

    def prepare(self) -> None:
        super().prepare()
        control_image().save(self.base / "input" / CONTROL_IMAGE)


def control_image() -> Image.Image:
    """A toy scene as the control map (RGB)."""
    return toy_data.random_scene(random.Random(3), two_shapes=True).render().convert("RGB")


def step_cache_graph(pair: str, step_cache: bool, caption: str, seed: int, steps: int, weight_dtype: str) -> dict:
    """One whole prompt of `pair`; every prompt holds every node (see the module docstring)."""
    def node(class_type, **inputs):
        return {"class_type": class_type, "inputs": inputs}

    model = {("plain", False): "1", ("plain", True): "7", ("Fun ControlNet", False): "6",
             ("Fun ControlNet", True): "8", ("kept cache", False): "1", ("kept cache", True): "7"}[pair, step_cache]
    positive = "11" if pair == "kept cache" else ("10" if step_cache else "9")
    return {
        "1": node("QI21ModelLoader", model_name=tiny.DIT_FILE, weight_dtype=weight_dtype),
        "2": node("QI21TextEncoderLoader", text_encoder_name=tiny.TEXT_ENCODER_FILE, weight_dtype="default",
                  device="default"),
        "3": node("QI21VAELoader", vae_name=tiny.VAE_FILE, weight_dtype="default"),
        "4": node("LoadImage", image=CONTROL_IMAGE),
        "5": node("QI21ControlNetLoader", control_net_name=CONTROLNET_FILE, weight_dtype="default"),
        "6": node("QI21ControlNetApply", model=["1", 0], control_net=["5", 0], vae=["3", 0], strength=1.0,
                  start_percent=0.0, end_percent=1.0, control_image=["4", 0]),
        "7": node("QI21StepCache", model=["1", 0], **STEP_CACHE_DEFAULTS),
        "8": node("QI21StepCache", model=["6", 0], **STEP_CACHE_DEFAULTS),
        "9": node("QI21TextEncode", prompt=caption, text_encoder=["2", 0]),  # without
        "10": node("QI21TextEncode", prompt=caption, text_encoder=["2", 0]),  # with: its own encode of the caption
        "11": node("QI21TextEncode", prompt=KEPT_CAPTION, text_encoder=["2", 0]),
        SAMPLER: node("QI21Sampler", model=[model, 0], positive=[positive, 0], seed=seed, steps=steps, cfg=1.0,
                      width=TOY_SIZE, height=TOY_SIZE, batch_size=1, prefix_cache="on",
                      keep_cache=pair == "kept cache"),
        "21": node("QI21VAEDecode", vae=["3", 0], samples=[SAMPLER, 0]),
        "22": node("SaveImage", images=["21", 0], filename_prefix="qi21_step_cache_bench/image"),
    }


def run_pairs(server: ToyServer, args) -> dict:
    """{(pair, with step cache?): [(seconds, report)]} over `args.repeats` interleaved rounds."""
    rng = random.Random(0)
    results = collections.defaultdict(list)

    def prompt(pair, side, caption, seed):
        graph = step_cache_graph(pair, side, caption, seed, args.steps, args.weight_dtype)
        seconds, outputs = timed_prompt(server, graph)
        return seconds, outputs[SAMPLER]["qi21_report"][0]

    seed = 0
    for pair in PAIRS:  # loads everything, fills the kept cache; allocations settle
        for side in (False, True):
            seed += 1
            prompt(pair, side, toy_data.random_scene(rng).caption(), seed)
    for repeat in range(args.repeats):
        for pair in PAIRS:
            seed += 1
            caption = toy_data.random_scene(rng).caption()
            for side in ((False, True) if repeat % 2 == 0 else (True, False)):
                results[pair, side].append(prompt(pair, side, caption, seed))
    return results


# -- the steps clocked block by block in this process -----------------------------------------------------------
def clock_steps(models: Path, control: bool, steps: int, weight_dtype: str) -> dict:
    """A `steps`-step prompt without and one with the step cache (its defaults) through the pack's nodes, each after
    an untimed one, every block timestamped. Medians over the cached steps: `beta`, the share of a full step from
    block 0's end to block N-1's end (without); `full`, `full_with` and `skipped`, a full step's seconds without and
    with the step cache (its indicator and residual copies) and a skipped one's."""
    from qi21.nodes import bridge
    from qi21.nodes.conditioning import QI21TextEncode
    from qi21.nodes.controlnet import QI21ControlNetApply, QI21ControlNetLoader
    from qi21.nodes.loaders import QI21ModelLoader, QI21TextEncoderLoader, QI21VAELoader
    from qi21.nodes.samplers import QI21Sampler
    from qi21.nodes.step_cache import QI21StepCache

    bridge.set_models_root(models)
    model = QI21ModelLoader.execute(tiny.DIT_FILE, weight_dtype)[0]
    encoder = QI21TextEncoderLoader.execute(tiny.TEXT_ENCODER_FILE, "default")[0]
    if control:
        vae = QI21VAELoader.execute(tiny.VAE_FILE, "default")[0]
        net = QI21ControlNetLoader.execute(CONTROLNET_FILE, "default")[0]
        pixels = torch.frombuffer(bytearray(control_image().tobytes()), dtype=torch.uint8)
        image = pixels.view(1, TOY_SIZE, TOY_SIZE, 3).float() / 255.0
        model = QI21ControlNetApply.execute(model, net, vae, 1.0, 0.0, 1.0, control_image=image)[0]
    positive = QI21TextEncode.execute(encoder, KEPT_CAPTION, None)[0]
    stamps = []  # (time, "block" or "step"): the loop checks for an interrupt after every block and every step

    def clock():
        stamps.append((time.perf_counter(), "step" if sys._getframe(1).f_code.co_name == "on_step" else "block"))

    def clocked(which) -> list[tuple[list[float], float]]:
        """Per step after the first: (its blocks' end times, its seconds from the previous step's end)."""
        QI21Sampler.execute(which, positive, 0, steps, 1.0, TOY_SIZE, TOY_SIZE, 1)  # warm
        stamps.clear()
        QI21Sampler.execute(which, positive, 1, steps, 1.0, TOY_SIZE, TOY_SIZE, 1)
        out, blocks, previous_end = [], [], None
        for stamp, kind in stamps:
            if kind == "block":
                blocks.append(stamp)
                continue
            if previous_end is not None:
                out.append((blocks, stamp - previous_end))
            previous_end, blocks = stamp, []
        return out

    original, bridge.throw_if_interrupted = bridge.throw_if_interrupted, clock
    try:
        without = clocked(model)
        with_ = clocked(QI21StepCache.execute(model, **STEP_CACHE_DEFAULTS)[0])
    finally:
        bridge.throw_if_interrupted = original
    full = [(blocks, seconds) for blocks, seconds in without if len(blocks) == TOY_DIT.num_layers]
    skipped = [seconds for blocks, seconds in with_ if len(blocks) == 1]
    full_with = [seconds for blocks, seconds in with_ if len(blocks) == TOY_DIT.num_layers]
    return {"beta": statistics.median((blocks[-1] - blocks[0]) / seconds for blocks, seconds in full),
            "full": statistics.median(seconds for _, seconds in full), "full_with": statistics.median(full_with),
            "skipped": statistics.median(skipped) if skipped else float("nan"), "skips": len(skipped)}


# -- the table ---------------------------------------------------------------------------------------------------
def summary(results: dict, pair: str, clock: dict, steps: int) -> dict:
    without, with_ = results[pair, False], results[pair, True]
    t0, t1 = (statistics.median(s for s, _ in side) for side in (without, with_))
    c = statistics.median(r["step_seconds"] for _, r in without)  # the sampler's own mean of its cached steps
    loop = statistics.median((r["prefill_seconds"] or 0.0) + r["step_seconds"] * (steps - (r["prefill_seconds"]
                                                                                            is not None))
                             for _, r in without)
    k = statistics.mean(r["step_cache"]["skipped"] for _, r in with_)
    share = k / statistics.mean(r["step_cache"]["run"] + r["step_cache"]["skipped"] for _, r in with_)
    if pair == "Fun ControlNet":  # base block 0 and control block 0 still run
        saved_at_32 = (RELEASED_BLOCKS + RELEASED_CONTROL_BLOCKS - 2) / (RELEASED_BLOCKS + RELEASED_CONTROL_BLOCKS)
    else:
        saved_at_32 = (RELEASED_BLOCKS - 1) / RELEASED_BLOCKS
    return {"without": t0, "with": t1, "ratio": t1 / t0, "skipped": k, "share": share, "loop": loop / t0,
            "beta": clock["beta"], "predicted": 1 - k * clock["beta"] * c / t0,
            "skipped_step": clock["skipped"] / clock["full"], "predicted_32": 1 - share * saved_at_32,
            "caches": collections.Counter(str(r.get("cache")) for _, r in without + with_),
            "patterns": collections.Counter(r["step_cache"]["pattern"] for _, r in with_)}


def print_table(rows: dict, args, clocked: dict) -> None:
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads (this process), the trained toy "
          f"({TOY_DIT.num_layers} blocks of width {TOY_DIT.width}), {TOY_SIZE}x{TOY_SIZE}, {args.steps} Base steps, "
          f"weight_dtype {args.weight_dtype}, real ComfyUI, whole prompts (encode, sample, decode, save), "
          f"median of {args.repeats} per side, interleaved")
    print("| pair | without | with step cache (t8) | with / without | steps skipped | loop share of the prompt | "
          f"blocks 1..{TOY_DIT.num_layers - 1} share of a step | predicted | skipped / full step: clocked "
          "(predicted) | predicted at 32 blocks |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for pair, r in rows.items():
        print(f"| {pair} | {r['without']:.2f} s | {r['with']:.2f} s | {r['ratio']:.3f} | {r['skipped']:.1f} of "
              f"{args.steps} ({r['share']:.1%}) | {r['loop']:.1%} | {r['beta']:.1%} | {r['predicted']:.3f} | "
              f"{r['skipped_step']:.2f} ({1 - r['beta']:.2f}) | {r['predicted_32']:.3f} |")
    for pair, r in rows.items():
        print(f"{pair}: prefix cache {dict(r['caches'])}; patterns {dict(r['patterns'])}")
    for name, clock in clocked.items():
        print(f"clock ({name}, this process after the server stopped): a full cached step {clock['full'] * 1e3:.1f} "
              f"ms, blocks 1..N-1 {clock['beta']:.1%} of it; with the step cache a full step "
              f"{clock['full_with'] * 1e3:.1f} ms, a skipped one {clock['skipped'] * 1e3:.1f} ms (median of "
              f"{clock['skips']})")


def run_step_cache(argv=None) -> None:
    def add(parser):
        parser.add_argument("--steps", type=int, default=40)
        parser.add_argument("--repeats", type=int, default=8, help="timed prompts per side of each pair")
        parser.add_argument("--weight-dtype", default="default")
        parser.add_argument("--toy", type=Path, default=TOY_DIR, help="the trained toy's folder (demo/toy/)")
        parser.add_argument("--json", type=Path, default=None, help="also write every prompt's time and report here")
        parser.add_argument("--threads", type=int, default=None,
                            help="torch's threads in the server (OMP_NUM_THREADS) and in this process's clock")

    args = server_args(STEP_CACHE_HELP, add, argv, "comfyui.py step-cache")
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the server's environment is a copy of this one
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="qi21-step-cache-bench-") as base:
        server = ToyServer(Path(args.comfyui), args.python, Path(base), args.toy)
        server.start()
        try:
            results = run_pairs(server, args)
        finally:
            server.stop()
        clocked = {name: clock_steps(server.models, name == "Fun ControlNet", args.steps, args.weight_dtype)
                   for name in ("plain", "Fun ControlNet")}
    rows = {pair: summary(results, pair, clocked["Fun ControlNet" if pair == "Fun ControlNet" else "plain"],
                          args.steps) for pair in PAIRS}
    print_table(rows, args, clocked)
    if args.json:
        args.json.write_text(json.dumps({"clock": clocked, "prompts": {
            f"{pair} {'with' if side else 'without'}": [{"seconds": t, "report": r} for t, r in runs]
            for (pair, side), runs in results.items()}}, indent=1))


QUESTIONS = {"speed": run_speed, "step-cache": run_step_cache}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in QUESTIONS:
        raise SystemExit(f"usage: comfyui.py {{{','.join(QUESTIONS)}}} [options]\n\n{__doc__}")
    QUESTIONS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
