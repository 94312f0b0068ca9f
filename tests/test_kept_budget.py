"""The kept prefix caches under a ceiling the user sets in ComfyUI's settings panel (web/qi21_settings.js; saved
in `user/default/comfy.settings.json`, read by nodes/bridge.py before each run): LRU eviction counted in the
store's `evictions`, said in the sampler's report, the setting's absence meaning no ceiling (as before), a broken
settings file never stopping a run."""

import json

import pytest
import torch

import graph_fixtures as gf
from qi21.model.prefix_cache.kept_entries import PrefixCacheStore
from qi21.model.prefix_cache.layout import PrefixKVCache
from qi21.model.prefix_cache.leading_runs import PrefixRuns
from qi21.nodes import bridge
from qi21.nodes.placement import KEPT_CACHES
from qi21.nodes.samplers import QI21Sampler


class _Model(torch.nn.Module):
    pass


def _cache(rows: int, seed: int) -> PrefixKVCache:
    """A filled one-layer cache of one prefix of `rows` text rows, its content digest told apart by `seed`."""
    cache = PrefixKVCache()
    cache.allocate([rows], 1, 1, 8, torch.float32, torch.device("cpu"))
    cache.runs = (PrefixRuns((rows,), (bytes([seed]) * 32,)),)
    return cache


def test_store_evicts_least_recently_used_and_counts_it():
    model = _Model()
    store = PrefixCacheStore(budget_bytes=None)
    key = store.key(model)
    caches = [_cache(16, seed) for seed in range(4)]
    size = caches[0].nbytes
    store.set_budget(3 * size)
    for cache in caches[:3]:
        assert store.put(key, cache, model)
    assert store.evictions == 0 and store.kept_bytes() == 3 * size == store.peak_bytes
    taken, _, _ = store.reuse(key, caches[0].runs, torch.device("cpu"))  # caches[0] is now the most recent
    store.give_back(key, taken, caches[0], model)
    assert store.put(key, caches[3], model)
    assert store.evictions == 1 and store.evicted_bytes == size
    assert caches[1] not in store.caches() and not caches[1].filled  # the least recently used went, freed
    assert [e["bytes"] for e in store.entries()] == [size] * 3 and store.entries()[0]["rows"] == 16
    store.set_budget(size)  # lowering the ceiling evicts at once, oldest first
    assert store.caches() == [caches[3]] and store.evictions == 3 and store.peak_bytes == 3 * size
    store.set_budget(None)
    assert store.limit_bytes == PrefixCacheStore(budget_bytes=None).limit_bytes  # no ceiling: as before


def _write_settings(root, values) -> None:
    folder = root / "default"
    folder.mkdir(parents=True, exist_ok=True)
    text = values if isinstance(values, str) else json.dumps(values)
    (folder / bridge.SETTINGS_FILE).write_text(text)


@pytest.fixture
def user_root(tmp_path):
    bridge.set_user_root(tmp_path)
    KEPT_CACHES.clear()
    yield tmp_path
    bridge.set_user_root(None)
    KEPT_CACHES.set_budget(None)
    KEPT_CACHES.clear()


@pytest.mark.parametrize("value, expected", [(None, None), (0, None), (1.5, int(1.5 * 2**30)), ("2", 2 * 2**30),
                                             (-1, None), ("lots", None), (True, None), (float("inf"), None),
                                             (1e308, 2**62), ([1], None), ({"a": 1}, None)])
def test_the_setting_in_gib_zero_or_unset_or_invalid_is_no_ceiling(user_root, value, expected, caplog):
    _write_settings(user_root, {} if value is None else {bridge.KEPT_CACHE_BUDGET_SETTING: value})
    assert bridge.kept_cache_budget_bytes() == expected
    if value in (-1, "lots", True, [1]):
        assert bridge.KEPT_CACHE_BUDGET_SETTING in caplog.text


@pytest.fixture(scope="module")
def graph(models_root):
    models = gf.load("model")
    # three prompts that share no leading row (random text states), so their kept caches share no tensor
    models["prompts"] = [gf.synthetic_conditioning(text_runs=[12], seed=seed) for seed in range(3)]
    return models


def _run(graph, i: int, keep: bool = True) -> dict:
    out = QI21Sampler.execute(graph["model"], graph["prompts"][i % 3], i, 2, 1.0, 64, 64, 1, keep_cache=keep)
    return out.ui["qi21_report"][0]


def test_the_ceiling_from_the_settings_file_bounds_the_samplers_store_and_the_report_says_so(graph, user_root):
    start = KEPT_CACHES.evictions  # a counter since start-up: earlier tests may have evicted
    first = _run(graph, 0)
    size = first["cache_bytes"]
    assert first["kept_bytes"] == size and "kept_evictions" not in first  # no ceiling yet
    _run(graph, 1)
    _run(graph, 2)
    assert len(KEPT_CACHES) == 3 and KEPT_CACHES.kept_bytes() == 3 * size
    ceiling = int(2.5 * size)  # two of the three: the least recently used (prompt 0) must go
    _write_settings(user_root, {bridge.KEPT_CACHE_BUDGET_SETTING: ceiling / 2**30, "Comfy.Other": 1})
    report = _run(graph, 2)  # the most recent prompt again: a hit, after the ceiling evicted the oldest
    assert report["cache"] == "hit" and report["kept_evictions"] == 1
    assert abs(report["kept_limit_bytes"] - ceiling) <= 1 and report["kept_bytes"] == 2 * size
    note = next(n for n in report["notes"] if "evicted" in n)
    assert "1 kept prefix cache evicted (least recently used)" in note and "your ceiling" in note
    assert bridge.KEPT_CACHE_BUDGET_SETTING in note
    again = _run(graph, 0)  # prompt 0 went; keeping it again evicts prompt 1, now the least recently used
    assert again["cache"] == "miss" and again["kept_evictions"] == 1 and _run(graph, 1)["cache"] == "miss"
    assert KEPT_CACHES.evictions - start == 3 and KEPT_CACHES.peak_bytes >= 3 * size  # a counter since start-up
    assert KEPT_CACHES.kept_bytes() <= ceiling
    plain = _run(graph, 2, keep=False)  # keep_cache off: no store keys, the store left alone
    assert "kept_bytes" not in plain and "kept_evictions" not in plain and KEPT_CACHES.evictions - start == 3
    _write_settings(user_root, {})  # the setting cleared: no ceiling again (the plan's free memory only)
    _run(graph, 2)  # holds 0, 1 and 2 again
    assert KEPT_CACHES.budget_bytes is None and len(KEPT_CACHES) == 3 and KEPT_CACHES.evictions - start == 3


def test_a_broken_settings_file_is_said_and_the_run_goes_on(graph, user_root, caplog):
    _write_settings(user_root, "{not json")
    report = _run(graph, 0)
    assert report["cache"] == "miss" and "could not read the user settings" in caplog.text
    _write_settings(user_root, {bridge.KEPT_CACHE_BUDGET_SETTING: 1})  # fixed: read again, applied
    _run(graph, 1)
    assert KEPT_CACHES.budget_bytes == 2**30
