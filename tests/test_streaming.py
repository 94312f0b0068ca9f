"""Weight streaming and the host-side prefix cache (model/memory/) on the CPU, where the device is the host and
the same code path runs synchronously: a streamed run must give bit-identical latents to a resident one."""

import copy

import pytest
import torch

from dit_fixtures import tiny_pair
from qi21.model.encoders.conditioning import Conditioning
from qi21.model.loaders.lora import clone_tree
from qi21.model.memory.streaming import LayerStreamer, StreamedRun, place_layers, resident_part
from qi21.model.memory.weights import dit_weights
from qi21.model.prefix_cache.host_moves import HostPrefixKVCache
from qi21.model.prefix_cache.kept_entries import PrefixCacheStore
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.sampling.loop import initial_noise, sample
from qi21.model.sampling.schedule import turbo_sigmas

WIDTH, HEIGHT = 128, 96


@pytest.fixture(scope="module")
def model():
    return tiny_pair(seed=5)[1]


def conditioning(seed=3, refs=((4, 4), (2, 6))):
    generator = torch.Generator().manual_seed(seed)
    slots = [False] * 5 + [True] * 4 + [False] * 2 + [True] * 3 + [False] * 4
    return Conditioning(text=torch.randn(len(slots), 48, generator=generator), image_slots=torch.tensor(slots),
                        references=torch.randn(sum(h * w for h, w in refs), 64, generator=generator), ref_shapes=refs)


def run(model, streamed=(), cache="device", cfg=1.0, batch=1, **kwargs):
    noise = initial_noise(7, batch, HEIGHT, WIDTH)
    negative = conditioning(seed=9) if cfg > 1 else None
    with torch.no_grad(), StreamedRun(model, streamed, cache) as streamed_run:
        result = sample(model, conditioning(), sigmas=turbo_sigmas(), width=WIDTH, height=HEIGHT, noise=noise,
                        negative=negative, cfg=cfg, new_cache=streamed_run.new_cache, **kwargs)
    return result, streamed_run


@pytest.mark.parametrize("streamed", [(0, 1, 2), (1,), (0, 2)])
@pytest.mark.parametrize("cache", ["device", "host"])
def test_streamed_runs_are_bit_identical_to_resident(model, streamed, cache):
    expected, _ = run(model)
    got, streamed_run = run(model, streamed, cache)
    assert torch.equal(got.latents, expected.latents)
    assert got.report["cache"] == "miss"
    if cache == "host":
        assert got.report["cache_device"] == "cpu"
    if len(streamed) == 3:  # more streamed blocks than slots: each is copied in every step, and block 0 once more
        assert streamed_run.streamer.copies == 3 * 8 + 1  # (fetched for a next step while the last block ran)
    else:  # the streamed blocks fit the two slots: copied once, then they stay
        assert streamed_run.streamer.copies == len(streamed)


def test_cfg_batch_and_uncached_streamed_are_bit_identical(model):
    for kwargs in (dict(cfg=3.0, batch=2), dict(prefix_cache=False)):
        expected, _ = run(model, **kwargs)
        got, _ = run(model, (0, 1, 2), "host" if kwargs.get("prefix_cache", True) else "device", **kwargs)
        assert torch.equal(got.latents, expected.latents)


def test_the_model_is_left_as_it_was(model):
    before = {name: (id(t), t.data_ptr()) for name, t in model.named_parameters()}
    snapshot = {name: t.clone() for name, t in model.state_dict().items()}
    run(model, (0, 1, 2), "host")
    assert {name: (id(t), t.data_ptr()) for name, t in model.named_parameters()} == before
    assert all(torch.equal(snapshot[k], v) for k, v in model.state_dict().items())
    assert all(not block._forward_pre_hooks and not block._forward_hooks for block in model.blocks)


def test_an_interrupt_mid_step_restores_every_block(model):
    calls = []

    def interrupt():
        calls.append(1)
        if len(calls) == 5:  # the second step, after its second block
            raise InterruptedError("cancel")

    before = {name: id(t) for name, t in model.named_parameters()}
    with pytest.raises(InterruptedError):
        run(model, (0, 1, 2), "host", check_interrupt=interrupt)
    assert {name: id(t) for name, t in model.named_parameters()} == before
    expected, _ = run(model)
    again, _ = run(model, (0, 1, 2), "host")
    assert torch.equal(again.latents, expected.latents)


def test_a_kept_host_cache_is_reused_and_stays_on_the_host(model):
    store = PrefixCacheStore(budget_bytes=2**30)
    first, _ = run(model, (0, 2), "host", keep_cache=True, store=store)
    second, _ = run(model, (0, 2), "host", keep_cache=True, store=store)
    assert first.report["cache"] == "miss" and second.report["cache"] == "hit"
    assert first.report["prefix_rows_computed"] == first.report["prefix_tokens"] == second.report["prefix_rows_reused"]
    assert second.report["prefix_rows_computed"] == 0
    assert torch.equal(first.latents, second.latents)
    (kept,) = store.caches()
    assert isinstance(kept, HostPrefixKVCache) and kept.device.type == "cpu" and kept._slots is None
    store.clear()


def test_host_cache_prefetches_one_layer_ahead(model):
    layers = model.config.num_layers
    cache = HostPrefixKVCache("cpu")
    cache.allocate([5], layers, 2, 32, torch.float32, "cpu")
    for layer in range(layers):
        cache.layer_kv(layer).store(0, torch.full((5, 2, 32), float(layer)), torch.full((5, 2, 32), -float(layer)))
    for _ in range(2):  # two cached steps
        for layer in range(layers):
            k, v = cache.layer_kv(layer).read(0)
            assert torch.equal(k, torch.full((5, 2, 32), float(layer))) and torch.equal(v, -k)
    assert cache.copies == 2 * layers + 1  # one copy per layer per step (and layer 0 fetched ahead), no refetch
    cache.free()
    assert cache._slots is None and not cache.filled


def test_streamer_on_a_plain_layer_stack_and_a_lora_style_copy():
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)) for _ in range(4))
    layers[1].register_buffer("offset", torch.randn(8))
    x = torch.randn(3, 8)

    def forward(stack):
        h = x
        for layer in stack:
            h = layer(h) + getattr(layer, "offset", 0)
        return h

    expected = forward(layers)
    clone = clone_tree(layers)  # new module objects holding the same Parameters, as a LoRA copy does
    with LayerStreamer(layers, (0, 1, 3), "cpu") as streamer:
        assert torch.equal(forward(layers), expected) and torch.equal(forward(layers), expected)
        assert torch.equal(forward(clone), expected)  # streaming the original leaves the copy's weights intact
        assert streamer.copies == 2 * 3 + 1  # each pass copies each streamed layer once; 0 is fetched ahead again
    assert torch.equal(forward(clone), expected) and torch.equal(forward(layers), expected)


def test_place_layers_and_the_resident_part(model):
    clone = copy.deepcopy(model)
    place_layers(clone, clone.blocks, (1,), "cpu", pin=False)
    part = resident_part(clone, clone.blocks, (1,))
    held = {id(p) for p in part.parameters()}
    assert all(id(p) not in held for p in clone.blocks[1].parameters())
    assert all(id(p) in held for p in clone.blocks[0].parameters()) and id(clone.modulation.weight) in held
    def nbytes(module):
        return sum(p.numel() * p.element_size() for p in module.parameters())

    assert nbytes(part) == nbytes(clone) - nbytes(clone.blocks[1])
    weights = dit_weights(clone)  # a layer counts as the slot it needs: its bytes, each tensor aligned to 512
    assert weights.other == nbytes(clone) - sum(nbytes(b) for b in clone.blocks)
    assert nbytes(clone.blocks[1]) <= weights.layers[1] < nbytes(clone.blocks[1]) + 512 * 8


def test_new_cache_follows_the_plan(model):
    assert type(StreamedRun(model, (), "device").new_cache()) is PrefixKVCache
    assert type(StreamedRun(model, (), "host").new_cache()) is HostPrefixKVCache


def test_gguf_weights_stream_as_stored_and_run_bit_identically(tmp_path):
    from qi21.model.loaders.dit import load_dit
    from test_gguf import comfy_tensors, k_m_mix, random_model, velocity, write_gguf

    path = write_gguf(tmp_path / "qwen_image_2.1-Q4_K_M.gguf", comfy_tensors(random_model()), k_m_mix, seed=3)
    model = load_dit(path, "fp32")
    weights = dit_weights(model)
    assert weights.label == "gguf Q4_K/Q6_K"
    stored = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())  # uint8 blocks, as in the file
    assert stored <= weights.layers[0] < stored + 512 * 16
    expected = (velocity(model), velocity(model, "cached"))
    with LayerStreamer(model.blocks, (0, 1), "cpu") as streamer:
        got = (velocity(model), velocity(model, "cached"))
    assert streamer.copies == 2
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
