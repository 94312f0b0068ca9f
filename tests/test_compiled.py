"""Compiled blocks (model/transformer/compiled.py) on the sampler's real path: how many graphs, no graph breaks, no
recompiles over prompts of other lengths, reference counts and sizes, and the same numbers as eager.

Graphs, breaks and recompiles are counted with torch.compile's "eager" backend: dynamo traces exactly the graphs and
guards inductor would get and then runs them without generating code, in a fraction of inductor's time on this CPU.
One test compiles with inductor to check the generated code against eager (fp32).
"""

import threading

import pytest
import torch
from safetensors.torch import save_file
from torch._dynamo.utils import counters

import controlnet_fixtures as cf
from dit_fixtures import Case, reference_velocity
from qi21.model.encoders.conditioning import Conditioning
from qi21.model.features.compile import compile_model
from qi21.model.features.control import apply_controlnet
from qi21.model.features.lora import apply_lora
from qi21.model.loaders.controlnet import load_controlnet
from qi21.model.loaders.dit import load_dit
from qi21.model.loaders.lora import clone_tree
from qi21.model.memory.streaming import StreamedRun
from qi21.model.options import options_of
from qi21.model.prefix_cache.host_moves import HostPrefixKVCache
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.sampling.loop import initial_noise, sample
from qi21.model.sampling.schedule import base_sigmas
from qi21.model.transformer.compiled import COMPILE_MODES

TOL = 2e-5  # DESIGN.md: ours against diffusers, fp32


@pytest.fixture
def dynamo():
    """Fresh dynamo caches and counters, dropped again afterwards (the trampolines' caches are global)."""
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


def compiled_copy(model, mode="blocks", backend="eager"):
    """A copy of `model` sharing its weights, with compiled blocks (the fixture's model stays eager)."""
    copy = clone_tree(model)
    compile_model(copy, mode, backend)
    return copy


def conditioning(text_runs, ref_shapes, seed=3):
    """A prompt of `text_runs[i]` text tokens before reference i (and after the last) and those references."""
    generator = torch.Generator().manual_seed(seed)
    slots = []
    for run, shape in zip(text_runs, list(ref_shapes) + [None]):
        slots += [False] * run
        if shape:
            slots += [True] * (shape[0] * shape[1] // 4)
    refs = sum(h * w for h, w in ref_shapes)
    return Conditioning(text=torch.randn(len(slots), 48, generator=generator), image_slots=torch.tensor(slots),
                        references=torch.randn(refs, 64, generator=generator) if refs else None,
                        ref_shapes=tuple(ref_shapes))


def lora_file(model, path) -> str:
    """A LoRA on every block's q and output projections (diffusers' key names), random but clearly non-zero."""
    generator = torch.Generator().manual_seed(5)
    width, tensors = model.config.width, {}
    for i in range(model.config.num_layers):
        for module in ("attn.to_q", "attn.to_out.0"):
            stem = f"transformer.transformer_blocks.{i}.{module}"
            tensors[stem + ".lora_A.weight"] = torch.randn(4, width, generator=generator) / width ** 0.5
            tensors[stem + ".lora_B.weight"] = 0.5 * torch.randn(width, 4, generator=generator)
    save_file(tensors, str(path))
    return str(path)


#: 3 prompt lengths x 1 or 2 references x 2 target sizes: none of them may recompile a graph
PROMPTS = [(runs, refs, size) for runs in ((5, 7), (9, 12), (20, 3)) for refs in (((4, 4),), ((4, 4), (8, 4)))
           for size in ((128, 128), (128, 192))]


def test_the_sampler_path_traces_three_graphs_with_no_break_and_no_recompile(dit_pair, tmp_path, dynamo):
    """A run with a LoRA, the int8 prefix cache, an interrupt check that takes an RLock (as ComfyUI's does) after
    every block and a progress callback after every step: three graphs for all blocks (the prefill's, its last
    block's, the cached steps'), no break, and twelve more prompts recompile nothing."""
    _, base = dit_pair
    model = compiled_copy(apply_lora(base, lora_file(base, tmp_path / "lora.safetensors"), 0.8))
    lock, steps_seen, checks = threading.RLock(), [], []

    def check_interrupt():
        with lock:
            checks.append(1)

    def run(index):
        runs, refs, (width, height) = PROMPTS[index]
        return sample(model, conditioning(runs if len(refs) == 1 else (runs[0], 2, runs[1]), refs),
                      sigmas=base_sigmas(3, width, height), width=width, height=height, seed=index,
                      cache_dtype="int8", check_interrupt=check_interrupt,
                      callback=lambda info: steps_seen.append(info.step))

    first = run(0)  # each block's first call runs eagerly (compiled.py): the prefill's graphs come with run 2
    run(1)
    assert dynamo["stats"]["unique_graphs"] == 3 and not dynamo["graph_break"]
    with torch._dynamo.config.patch(error_on_recompile=True):  # any recompile now fails the run
        for index in range(2, len(PROMPTS)):
            run(index)
    assert dynamo["stats"]["unique_graphs"] == 3 and not dynamo["graph_break"]
    assert len(checks) == len(PROMPTS) * 3 * base.config.num_layers and steps_seen[:3] == [0, 1, 2]

    eager = sample(apply_lora(base, str(tmp_path / "lora.safetensors"), 0.8),
                   conditioning(PROMPTS[0][0], PROMPTS[0][1]), sigmas=base_sigmas(3, 128, 128), width=128,
                   height=128, seed=0, cache_dtype="int8")
    assert first.report["cache_dtype"] == "int8"
    torch.testing.assert_close(first.latents, eager.latents, rtol=0, atol=1e-5)


DIT_CASES = [
    pytest.param(Case(refs=((4, 4), (2, 6)), target=(6, 4), runs=(5, 3, 6)), id="two_references"),
    pytest.param(Case(refs=((4, 4),), target=(4, 6), runs=(5, 9), batch=2, pad=(0, 4)), id="batch2_right_padded"),
]


@pytest.mark.parametrize("case", DIT_CASES)
def test_compiled_forward_prefill_and_cached_step_match_diffusers(dit_pair, case, dynamo):
    """The DiT tests that matter, with compiled blocks: uncached, prefill and a cached step at another timestep."""
    reference, base = dit_pair
    model = compiled_copy(base)
    kwargs, prefixes, target = case.make()
    t = torch.linspace(0.9, 0.4, case.batch)
    with torch.no_grad():
        expected = reference_velocity(reference, kwargs, t)
        later = reference_velocity(reference, kwargs, t / 2)
        model(target, t, prefixes, cache=PrefixKVCache(), mode="prefill")  # each block's first call runs eagerly
        cache = PrefixKVCache()
        torch.testing.assert_close(model(target, t, prefixes), expected, rtol=0, atol=TOL)
        torch.testing.assert_close(model(target, t, prefixes, cache=cache, mode="prefill"), expected, rtol=0, atol=TOL)
        torch.testing.assert_close(model(target, t / 2, prefixes, cache=cache, mode="cached"), later, rtol=0, atol=TOL)
    assert not dynamo["graph_break"]
    assert dynamo["stats"]["unique_graphs"] == 5  # uncached and prefill, each with its last block; cached


def test_inductor_cached_step_equals_eager_in_fp32(dit_pair, dynamo):
    """The generated code (inductor, the option's backend) against eager: the cached step, the one that repeats."""
    _, base = dit_pair
    model = compiled_copy(base, backend="inductor")
    kwargs, prefixes, target = Case(refs=((4, 4),), target=(4, 6), runs=(5, 7)).make()
    t = torch.tensor([0.7])
    with torch.no_grad():
        eager_cache, compiled_cache = PrefixKVCache(), PrefixKVCache()
        base(target, t, prefixes, cache=eager_cache, mode="prefill")
        model(target, t, prefixes, cache=compiled_cache, mode="prefill")  # each block's first call: eager
        expected = base(target, t / 2, prefixes, cache=eager_cache, mode="cached")
        got = model(target, t / 2, prefixes, cache=compiled_cache, mode="cached")
    assert dynamo["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_a_host_cache_and_the_flex_prefill_run_eagerly_and_off_is_the_default(dit_pair, dynamo):
    _, base = dit_pair
    assert options_of(base).compile == "off" and all(block.compiled is None for block in base.blocks)
    assert COMPILE_MODES[0] == "off"
    model = compiled_copy(base)
    kwargs, prefixes, target = Case(refs=((4, 4),), target=(4, 6), runs=(5, 7)).make()
    t = torch.tensor([0.7])
    with torch.no_grad():
        expected = base(target, t, prefixes)
        later = base(target, t / 2, prefixes)
        for _ in range(2):  # the second call would be compiled if the compiled block took it
            torch.testing.assert_close(model(target, t, prefixes, attention="flex"), expected, rtol=0, atol=TOL)
            cache = HostPrefixKVCache("cpu")
            torch.testing.assert_close(model(target, t, prefixes, cache=cache, mode="prefill"), expected, rtol=0,
                                       atol=TOL)
            torch.testing.assert_close(model(target, t / 2, prefixes, cache=cache, mode="cached"), later, rtol=0,
                                       atol=TOL)
    assert model.blocks[0].compiled._compiled == {}  # no compiled forward was even made


def test_a_controlnet_on_a_compiled_model_runs_its_blocks_compiled(tmp_path, dynamo):
    _, base = cf.tiny_pair4()
    net = load_controlnet(cf.write(tmp_path / "fun.safetensors", cf.alibaba_state()))
    hint = torch.randn(8 * 8, 129, generator=torch.Generator().manual_seed(2))
    model = compiled_copy(base)
    controlled = apply_controlnet(model, net, lambda grid: hint, strength=0.7)
    assert all(block.compiled is model.blocks[0].compiled for block in controlled.control_net.blocks)
    assert all(block.compiled is None for block in net.blocks)  # the loaded net itself stays as it was
    cond = conditioning((5, 7), ((4, 4),))
    noise = initial_noise(1, 1, 128, 128)
    with torch.no_grad():
        for _ in range(2):  # the second run's prefill is compiled too (a block's first call runs eagerly)
            got = sample(controlled, cond, sigmas=base_sigmas(2, 128, 128), width=128, height=128, noise=noise)
        eager = sample(apply_controlnet(base, net, lambda grid: hint, strength=0.7), cond,
                       sigmas=base_sigmas(2, 128, 128), width=128, height=128, noise=noise)
    torch.testing.assert_close(got.latents, eager.latents, rtol=0, atol=1e-5)
    assert not dynamo["graph_break"]
    assert dynamo["stats"]["unique_graphs"] == 5  # the DiT's three, the control blocks' prefill and cached step


def test_streamed_blocks_run_compiled_bit_for_bit_and_without_recompiles(dit_pair, dynamo):
    """Weight streaming's hooks swap a block's weights around `Block.__call__`, outside the compiled forward: a
    streamed run traces no graph of its own and gives what the compiled resident run gives."""
    _, base = dit_pair
    model = compiled_copy(base)
    cond, noise = conditioning((5, 7), ((4, 4),)), initial_noise(1, 1, 128, 128)
    latents = []
    for streamed in ((), (), (0, 2)):  # the second resident run has the prefill's graphs; streaming adds none
        with torch.no_grad(), StreamedRun(model, streamed, "device") as run:
            latents.append(sample(model, cond, sigmas=base_sigmas(3, 128, 128), width=128, height=128, noise=noise,
                                  new_cache=run.new_cache).latents)
    assert torch.equal(latents[2], latents[1])
    assert dynamo["stats"]["unique_graphs"] == 3 and not dynamo["graph_break"]


@pytest.mark.parametrize("kind", ["int8_convrot", "w4a8"])  # fp8, NVFP4, GGUF: traced clean too (docs/measurements.md)
def test_quantized_weight_formats_run_inside_the_compiled_block(tmp_path, kind, dynamo):
    """On a CPU these layers dequantize right before their GEMMs (test_quantized.py); that runs inside the graph, with
    no break, and gives eager's numbers. (On a GPU their comfy-kitchen kernels are not measured: no device here.)"""
    from test_quantized import write_dit  # noqa: PLC0415 (the quantized files of that suite, written the same way)

    path, _, _ = write_dit(tmp_path, f"qwen_image_2.1_{kind}.safetensors", kind)
    eager, model = load_dit(path, weight_dtype="fp32"), load_dit(path, weight_dtype="fp32")
    compile_model(model, "blocks", "eager")
    _, prefixes, target = Case(refs=((4, 4),), target=(4, 6), runs=(5, 7)).make(context_dim=model.config.context_in_dim)
    t = torch.tensor([0.7])
    with torch.no_grad():
        velocities = []
        for dit in (eager, model):
            cache = PrefixKVCache()
            dit(target, t, prefixes, cache=cache, mode="prefill")  # the compiled model's blocks: eagerly, once
            velocities.append(dit(target, t / 2, prefixes, cache=cache, mode="cached"))
    assert dynamo["stats"]["unique_graphs"] == 1 and not dynamo["graph_break"]
    torch.testing.assert_close(velocities[1], velocities[0], rtol=0, atol=1e-5)
