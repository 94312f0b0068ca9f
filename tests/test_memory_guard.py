"""A request within the widgets' limits that cannot fit in memory is refused before anything is allocated
(`width 4096, height 4096, batch_size 64` used to grow the process until the kernel killed the server)."""

import re

import pytest

import graph_fixtures as gf
from qi21.model.memory.estimate import GIB, estimate_run
from qi21.model.sampling import loop
from qi21.model.transformer.dit import DiTConfig
from qi21.nodes import bridge
from qi21.nodes.samplers import QI21Sampler, QI21TurboSampler


@pytest.fixture(scope="module")
def turbo(models_root):
    return gf.load("turbo")["turbo"]


@pytest.fixture
def no_noise(monkeypatch):
    """Fail the test if the sampler gets as far as drawing noise."""
    def refuse(*args, **kwargs):
        raise AssertionError("noise was drawn: the run was not refused before allocating")

    monkeypatch.setattr(loop, "initial_noise", refuse)  # the run draws it (loop.run)


def test_a_run_that_cannot_fit_is_refused_before_any_allocation(turbo, monkeypatch, no_noise):
    monkeypatch.setattr(bridge, "memory_limit", lambda device: 256 * 1024**2)  # a small machine, scaled down
    with pytest.raises(MemoryError, match=r"only 0\.2 GiB is free on cpu\. Lower batch_size, width/height"):
        QI21TurboSampler.execute(turbo, gf.synthetic_conditioning(), 0, 4096, 4096, 64)


def test_the_refusal_names_the_numbers_and_cfg_counts_twice(turbo, monkeypatch, no_noise):
    monkeypatch.setattr(bridge, "memory_limit", lambda device: 64 * 1024**2)
    positive, negative = gf.synthetic_conditioning(), gf.synthetic_conditioning(seed=1)

    def refusal(**extra):
        with pytest.raises(MemoryError, match=r"rows per step") as error:
            QI21Sampler.execute(turbo, positive, 0, 4, 3.0, 2048, 2048, 8, **extra)
        return str(error.value)

    def rows(message):
        return int(re.search(r"([\d,]+) rows per step", message).group(1).replace(",", ""))

    alone, with_cfg = rows(refusal()), rows(refusal(negative=negative))
    target_rows = 8 * (2048 // 16) ** 2
    assert with_cfg - alone == target_rows + negative.layout((128, 128)).prefix_len  # twice the samples


def test_a_run_that_fits_is_not_refused(turbo, monkeypatch):
    monkeypatch.setattr(bridge, "memory_limit", lambda device: 8 * GIB)
    out = QI21TurboSampler.execute(turbo, gf.synthetic_conditioning(), 0, 64, 64, 1)
    assert out[0]["samples"].shape == (1, 64, 4, 4)


def test_estimate_grows_with_what_the_run_holds():
    config = DiTConfig()
    one = estimate_run(config, [4171], 4096, 1, False, 2)
    assert one.cache == 2 * 32 * 32 * 128 * 4171 * 2  # the prefix cache's exact payload (bf16)
    assert estimate_run(config, [4171], 4096, 4, False, 2).step > one.step  # more samples, more rows
    assert estimate_run(config, [4171, 4171], 4096, 1, True, 2).cache == 2 * one.cache  # CFG: two prefixes
    assert estimate_run(config, [4171], 4096, 1, False, 2, prefix_cache=False).cache == 0
    huge = estimate_run(config, [100], 256 * 256, 64, False, 2)
    assert huge.total > 128 * GIB  # 4096 x 4096 x 64 on the real model: far beyond any single machine
