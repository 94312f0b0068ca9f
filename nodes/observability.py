"""What a worker of a farm tells its load balancer and its operator: the route key of a graph, the kept prefix
caches, and counters in Prometheus' text format (docs/many-workers.md).

    POST /qi21/route_key   {"prompt": <API graph>, "image_hashes": {name: sha256}} -> {"route_key", "parts", "nodes"}
    GET  /qi21/caches      the kept entries (prefix_key, rows, bytes, device, dtype, age, hits) and their total
    GET  /qi21/metrics     runs by cache outcome, prefix rows reused / computed, prefill seconds, kept bytes,
                           kept entries, evictions

All three are read-only and cheap, and safe during a run: the counters have their own lock, the kept store is read
through its locked `snapshot`. The text format is written here (a dozen lines) rather than with
`prometheus_client`: that package is no ComfyUI dependency, and a pack should not add one for this; the tests parse
the output with prometheus_client's own parser.
"""

import json
import threading

from . import bridge, placement
from .route_key import RouteKeyError, route_description

OUTCOMES = ("off", "miss", "partial", "hit")
MAX_ROUTE_BODY = 8 << 20  # a graph with its prompts; far above any real one
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class RunCounters:
    """Totals over the sampler runs of this process, from their reports (so they agree with them)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.runs = dict.fromkeys(OUTCOMES, 0)
            self.rows_reused = self.rows_computed = 0
            self.prefill_seconds = 0.0

    def record(self, report: dict) -> None:
        outcome = report.get("cache")
        with self._lock:
            self.runs[outcome if outcome in self.runs else "off"] += 1
            self.rows_reused += int(report.get("prefix_rows_reused") or 0)
            self.rows_computed += int(report.get("prefix_rows_computed") or 0)
            self.prefill_seconds += float(report.get("prefill_seconds") or 0.0)

    def totals(self) -> dict:
        with self._lock:
            return {"runs": dict(self.runs), "rows_reused": self.rows_reused, "rows_computed": self.rows_computed,
                    "prefill_seconds": self.prefill_seconds}


COUNTERS = RunCounters()


def record_run(report: dict) -> None:
    """A sampler finished with this `qi21_report`."""
    COUNTERS.record(report)


def caches_view(store=None) -> dict:
    return (placement.KEPT_CACHES if store is None else store).snapshot()


def _family(name: str, kind: str, help_text: str, samples) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        label_text = ",".join(f'{key}="{value}"' for key, value in labels.items())
        lines.append(f"{name}{{{label_text}}} {float(value)!r}" if label_text else f"{name} {float(value)!r}")
    return lines


def metrics_text(store=None, counters: RunCounters = COUNTERS) -> str:
    """The counters and the kept store in Prometheus' text exposition format (version 0.0.4)."""
    totals, kept = counters.totals(), caches_view(store)
    lines = [
        *_family("qi21_sampler_runs_total", "counter", "Sampler runs by prefix-cache outcome (the report's cache).",
                 [({"cache": outcome}, totals["runs"][outcome]) for outcome in OUTCOMES]),
        *_family("qi21_prefix_rows_reused_total", "counter", "Prefix rows taken from a kept cache or shared.",
                 [({}, totals["rows_reused"])]),
        *_family("qi21_prefix_rows_computed_total", "counter", "Prefix rows computed by a prefill.",
                 [({}, totals["rows_computed"])]),
        *_family("qi21_prefill_seconds_total", "counter", "Seconds spent in prefill steps.",
                 [({}, totals["prefill_seconds"])]),
        *_family("qi21_kept_cache_bytes", "gauge", "Bytes the kept prefix caches hold (each tensor once).",
                 [({}, kept["bytes"])]),
        *_family("qi21_kept_cache_limit_bytes", "gauge", "The kept store's bound in force.",
                 [({}, kept["limit_bytes"])]),
        *_family("qi21_kept_cache_entries", "gauge", "Kept prefix caches.", [({}, len(kept["entries"]))]),
        *_family("qi21_kept_cache_evictions_total", "counter", "Kept caches evicted to stay inside the bound.",
                 [({}, kept["evictions"])]),
    ]
    return "\n".join(lines) + "\n"


# -- routes ---------------------------------------------------------------------------------------------------------
def route_key_answer(body: bytes | None, input_dir=None) -> tuple[int, dict]:
    """POST /qi21/route_key: `{"prompt": graph, "image_hashes": {...}}` (a /prompt body works as it is) ->
    (200, the key, the samplers' parts and the hashed node descriptions they refer to), or (400, a clear error)."""
    try:
        try:
            request = json.loads(body or b"")
        except (ValueError, UnicodeDecodeError) as error:
            raise RouteKeyError(f"the body is not JSON ({error}).") from None
        if not isinstance(request, dict) or not isinstance(request.get("prompt"), dict):
            raise RouteKeyError("expected a JSON object with 'prompt' (the API graph, as sent to /prompt) and "
                                "optionally 'image_hashes' (LoadImage file name -> SHA-256 hex of its bytes).")
        folder = input_dir if input_dir is not None else bridge.input_directory()
        graph, hashes = request["prompt"], request.get("image_hashes")
        described = route_description(graph, folder, hashes)
        return 200, {"route_key": described["route_key"], "parts": described["samplers"], "nodes": described["nodes"]}
    except (RouteKeyError, RecursionError) as error:
        return 400, {"error": str(error)}


def register_routes() -> list[str]:
    """Serve the three routes on ComfyUI's server (nothing without it). Returns the paths now served."""
    served = []
    if bridge.add_route("POST", "/qi21/route_key", route_key_answer, max_body=MAX_ROUTE_BODY):
        served.append("/qi21/route_key")
    if bridge.add_route("GET", "/qi21/caches", lambda body: (200, caches_view())):
        served.append("/qi21/caches")
    if bridge.add_route("GET", "/qi21/metrics", lambda body: (200, (metrics_text(), PROMETHEUS_TYPE))):
        served.append("/qi21/metrics")
    return served
