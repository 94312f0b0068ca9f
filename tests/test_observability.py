"""/qi21/metrics and /qi21/caches (nodes/observability.py) over real sampler runs through the nodes: the metrics
text parses with Prometheus' own parser, its counters agree with the runs' reports, the caches view with the kept
store, and both can be read while a run samples."""

import threading
from collections import Counter

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import graph_fixtures as gf
from qi21.model.prefix_cache.kept_entries import PrefixCacheStore
from qi21.nodes import observability
from qi21.nodes.conditioning import QI21Reference, QI21TextEncode
from qi21.nodes.placement import KEPT_CACHES
from qi21.nodes.samplers import QI21Sampler


@pytest.fixture(scope="module")
def graph(models_root):
    models = gf.load("model", "text_encoder", "vae")
    image = torch.rand(1, 256, 288, 3, generator=torch.Generator().manual_seed(0))
    models["references"] = QI21Reference.execute(models["vae"], image, 0)[0]
    return models


@pytest.fixture
def fresh():
    KEPT_CACHES.clear()
    observability.COUNTERS.reset()
    yield
    KEPT_CACHES.clear()
    observability.COUNTERS.reset()


def run(graph, words: str, references=True, **options) -> dict:
    positive = QI21TextEncode.execute(graph["text_encoder"], words, graph["references"] if references else None)[0]
    out = QI21Sampler.execute(graph["model"], positive, 0, 2, 1.0, 256, 256, 1, **options)
    return out.ui["qi21_report"][0]


def samples(text: str) -> dict:
    """{(sample name, labels): value} of a Prometheus text page (parsed by prometheus_client, which rejects a
    malformed page)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_parse_and_agree_with_the_reports(graph, fresh):
    reports = [
        run(graph, "<image1> at dusk", keep_cache=True),  # miss, kept
        run(graph, "<image1> in the snow", keep_cache=True),  # the reference's rows reused: partial
        run(graph, "<image1> at dusk", keep_cache=True),  # hit
        run(graph, "a dog on a hill", references=False),  # miss, not kept
        run(graph, "a dog on a hill", references=False, prefix_cache="off"),  # off
    ]
    assert [r["cache"] for r in reports] == ["miss", "partial", "hit", "miss", "off"]
    page = samples(observability.metrics_text())
    outcomes = Counter(r["cache"] for r in reports)
    for outcome in observability.OUTCOMES:
        assert page[("qi21_sampler_runs_total", (("cache", outcome),))] == outcomes[outcome]
    assert page[("qi21_prefix_rows_reused_total", ())] == sum(r["prefix_rows_reused"] for r in reports) > 0
    assert page[("qi21_prefix_rows_computed_total", ())] == sum(r["prefix_rows_computed"] for r in reports) > 0
    prefill = sum(r["prefill_seconds"] or 0.0 for r in reports)
    assert page[("qi21_prefill_seconds_total", ())] == pytest.approx(prefill, rel=1e-9) and prefill > 0
    assert page[("qi21_kept_cache_bytes", ())] == KEPT_CACHES.nbytes > 0
    assert page[("qi21_kept_cache_entries", ())] == len(KEPT_CACHES)
    assert page[("qi21_kept_cache_evictions_total", ())] == getattr(KEPT_CACHES, "evictions", 0)

    view = observability.caches_view()
    assert len(view["entries"]) == len(KEPT_CACHES) and view["bytes"] == KEPT_CACHES.nbytes
    keys = {r["prefix_key"] for r in reports[:3]}
    assert len(keys) == 1 and None not in keys  # the words after the reference are not in the report's key
    for entry in view["entries"]:
        assert entry["prefix_key"] in keys and entry["device"] == "cpu" and entry["dtype"] == "float32"
        assert entry["rows"] > 0 and entry["bytes"] > 0 and entry["age_seconds"] >= 0
        assert entry["loras"] == [] and entry["controlled"] is False
    # the two kept prompts: the dusk one was read by the snow run and by the hit; the snow one by nobody (the hit
    # reads the entry that holds most of its rows)
    assert sorted(e["hits"] for e in view["entries"]) == [0, 2]
    assert sorted(e["rows"] for e in view["entries"]) == sorted(
        r["prefix_tokens"] for r in reports[:2])


def test_the_metrics_report_the_store_s_eviction_counter():
    """The store counts its evictions (tests/test_kept_budget.py evicts for real); the page shows that counter."""
    store = PrefixCacheStore(budget_bytes=None)
    store.evictions = 3
    page = samples(observability.metrics_text(store, observability.RunCounters()))
    assert page[("qi21_kept_cache_evictions_total", ())] == 3
    assert page[("qi21_kept_cache_entries", ())] == 0


def test_both_can_be_read_while_a_run_samples(graph, fresh):
    errors, pages = [], []
    stop = threading.Event()

    def scrape():
        while not stop.is_set():
            try:
                pages.append(samples(observability.metrics_text()))
                observability.caches_view()
            except Exception as error:  # noqa: BLE001  (any failure of a scrape fails the test below)
                errors.append(error)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        for words in ("<image1> at dusk", "<image1> at noon", "<image1> at dusk"):
            run(graph, words, keep_cache=True)
    finally:
        stop.set()
        scraper.join()
    assert errors == [] and len(pages) > 1
    runs = [sum(v for (name, _), v in page.items() if name == "qi21_sampler_runs_total") for page in pages]
    assert runs == sorted(runs) and runs[-1] <= 3  # counters only grow


def test_no_route_is_served_without_comfyui():
    assert observability.register_routes() == []
