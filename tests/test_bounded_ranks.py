"""A `devices` rank list is checked whole when the prompt is validated, before any worker process starts (issue 58,
item 1): the text's length, the count (at most `MAX_RANKS`), each device, the mode's count and the heads rule.

Found as a hostile API client in a real ComfyUI server: `devices` listing 2,500 CPU ranks with `parallel: ulysses`
started one worker process per listed rank (at least 9 were running when the server was stopped from outside); the
heads-divide-by-ranks rule ran only inside each started worker. A 10,000-character text-encoder `device` was refused
with a message that repeated the whole value."""

import multiprocessing
import time

import pytest
import torch

import graph_fixtures as gf
from qi21.model.parallel import pool as pools
from qi21.model.parallel.ranks import MAX_DEVICES_TEXT, MAX_RANKS, file_heads, parse_devices
from qi21.model.parallel.split import SplitModel
from qi21.nodes import bridge
from qi21.nodes.loaders import QI21ModelLoader, QI21TextEncoderLoader, QI21VAELoader

TINY_HEADS = 2  # tests/dit_fixtures.py: 2 heads of 32


@pytest.fixture
def no_spawn(monkeypatch):
    """Any worker process started fails the test: every refusal below comes before the pool."""
    def refuse(*args, **kwargs):
        raise AssertionError("a worker pool was started for a rank list that validation should have refused")

    monkeypatch.setattr(pools, "WorkerPool", refuse)
    before = set(multiprocessing.active_children())
    yield
    assert set(multiprocessing.active_children()) <= before


def refused(devices: str, parallel: str = "ulysses", model=None) -> str:
    """The message of validation and of the loader (the same), each within a second."""
    model = model or gf.SINGLE["turbo"]
    start = time.monotonic()
    message = QI21ModelLoader.validate_inputs(model, weight_dtype="default", devices=devices, parallel=parallel)
    assert isinstance(message, str), message
    with pytest.raises(ValueError) as raised:
        QI21ModelLoader.execute(model, "default", devices=devices, parallel=parallel)
    assert str(raised.value) == message
    assert time.monotonic() - start < 1.0
    assert len(message) < 400, message[:500]
    return message


def test_the_tiny_files_heads_are_read_from_their_headers(models_root):
    assert file_heads(bridge.model_path("diffusion_models", gf.SINGLE["turbo"])) == TINY_HEADS


def test_2500_cpu_ranks_are_refused_at_validation_and_no_worker_starts(models_root, no_spawn):
    message = refused(",".join(["cpu"] * 2500))
    assert f"longer than {MAX_DEVICES_TEXT} characters" in message and f"at most {MAX_RANKS} devices" in message
    message = refused(",".join(["cpu"] * (MAX_RANKS + 1)))
    assert f"names {MAX_RANKS + 1} devices; at most {MAX_RANKS}" in message


def test_a_count_that_does_not_divide_the_heads_is_refused_before_a_worker_starts(models_root, no_spawn):
    for count in (3, 4):
        message = refused(",".join(["cpu"] * count))
        assert f"over {count} devices needs the number of devices to divide the model's {TINY_HEADS}" in message


def test_each_gpu_must_be_on_this_machine(models_root, no_spawn, monkeypatch):
    monkeypatch.setattr(bridge, "gpu_count", lambda: 2)
    assert "this machine has no GPU cuda:2 (torch sees 2 GPUs)" in refused("cuda:0,cuda:2")
    monkeypatch.setattr(bridge, "gpu_count", lambda: 0)
    assert "this machine has no GPU cuda (torch sees no GPU)" in refused("cuda", "off")


@pytest.mark.parametrize("devices, parallel, message", [
    ("cpu," + "x" * 3000, "ulysses", "'xxxx"),
    ("x" * 3000, "ulysses", "is not a device"),
    ("cuda:" + "9" * 3000, "ulysses", "is not a device"),
    ("cuda:²,cuda:1", "ulysses", "is not a device"),
    ("cpu,cpu,cpu", "cfg", "names 3"),
    ("cpu", "ulysses", "needs at least two devices"),
])
def test_a_bad_rank_list_is_named_with_a_short_quote(models_root, no_spawn, devices, parallel, message):
    assert message in refused(devices, parallel)


def test_a_valid_rank_list_passes_validation_and_a_linked_one_waits_for_the_run(models_root, no_spawn):
    assert QI21ModelLoader.validate_inputs(gf.SINGLE["turbo"], weight_dtype="default", devices="cpu, cpu",
                                           parallel="ulysses") is True
    assert QI21ModelLoader.validate_inputs(gf.SINGLE["turbo"], weight_dtype="default", devices=None,
                                           parallel="ulysses") is True
    split = QI21ModelLoader.execute(gf.SINGLE["turbo"], "default", devices="cpu,cpu", parallel="ulysses")[0]
    assert isinstance(split, SplitModel) and split.devices == ("cpu", "cpu")  # a recipe: nothing started yet


def test_the_pool_itself_refuses_more_than_max_ranks():
    with pytest.raises(ValueError, match=f"1 to {MAX_RANKS} devices; got 2500"):
        pools.WorkerPool(("cpu",) * 2500)


def test_parse_devices_keeps_its_rules():
    assert parse_devices(" cuda:0, cuda:1 ") == ("cuda:0", "cuda:1")
    with pytest.raises(ValueError, match="names a GPU twice"):
        parse_devices("cuda,cuda:0")


@pytest.mark.parametrize("loader", [QI21TextEncoderLoader, QI21VAELoader])
def test_an_oversized_component_device_is_quoted_short(models_root, loader):
    name = gf.SINGLE["text_encoder" if loader is QI21TextEncoderLoader else "vae"]
    message = loader.validate_inputs(name, weight_dtype="fp32", device="cuda" + "x" * 10_000)
    assert isinstance(message, str) and "10,004 characters" in message and len(message) < 300, message[:400]
    with pytest.raises(ValueError) as raised:
        loader.execute(name, "fp32", device="z" * 10_000)
    assert len(str(raised.value)) < 300
    loaded = loader.execute(name, "fp32", device="cpu")[0]  # the next load as a clean one
    assert loaded is not None


def test_an_oversized_combo_value_is_quoted_short(models_root):
    message = QI21ModelLoader.validate_inputs(gf.SINGLE["turbo"], weight_dtype="q" * 10_000)
    assert "weight_dtype = 'qqq" in message and "10,000 characters" in message and len(message) < 300
    assert torch.is_tensor(torch.zeros(1))


def test_a_file_gone_since_listing_leaves_the_heads_to_the_run(models_root, monkeypatch, no_spawn):
    def gone(kind, name):
        raise FileNotFoundError(name)

    monkeypatch.setattr(bridge, "model_path", gone)
    assert QI21ModelLoader.validate_inputs(gf.SINGLE["turbo"], weight_dtype="default", devices="cpu,cpu,cpu",
                                           parallel="ulysses") is True  # heads unknown here; the count is fine
    assert "at most 16" in QI21ModelLoader.validate_inputs(gf.SINGLE["turbo"], weight_dtype="default",
                                                           devices="cpu," * 17, parallel="ulysses")
