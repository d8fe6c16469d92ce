"""Prometheus metrics (prometheus-client), named `shadowradix:*`, labelled `model_name`.

Histogram buckets are vLLM's, so existing Grafana dashboards read them unchanged. Each
server has its own registry (several servers in one process, as in tests, never mix).
Engine-side figures are set from the engine's thread after each step; request latencies
are observed by the HTTP side when a request ends.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from shadowradix.engine.cache_control import TIERS

# vLLM's bucket lists (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """`num_draft_tokens`: speculative decoding's K (0: off, and no spec_decode series, as
    in vLLM, which registers them only when speculative decoding is on)."""

    def __init__(self, model_name: str, num_draft_tokens: int = 0) -> None:
        self.registry = CollectorRegistry()
        r, name = self.registry, ["model_name"]

        def counter(metric: str, doc: str, *labels: str) -> Any:
            return Counter(f"shadowradix:{metric}", doc, [*name, *labels], registry=r)

        def gauge(metric: str, doc: str, *labels: str) -> Any:
            return Gauge(f"shadowradix:{metric}", doc, [*name, *labels], registry=r)

        def histogram(metric: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"shadowradix:{metric}", doc, name, buckets=buckets, registry=r)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the cache, "
                                     "by the tier that held them.", "tier")
        self.requests = counter("requests", "Requests ended, by finish reason.",
                                "finished_reason")
        self.preemptions = counter("preemptions", "Running requests preempted for pages.")
        self.storage_errors = counter("storage_errors", "L3 faults (missing, corrupt, "
                                      "unreachable); each is a miss, never a wrong answer.")
        self.loaded_bytes = counter("load_back_bytes", "Bytes loaded back into the cache, by "
                                    "source tier.", "source")
        self.backup_bytes = counter("backup_bytes", "Bytes backed up from the device, by "
                                    "target tier.", "target")
        self.hisparse_lookups = counter("hisparse_lookups", "HiSparse: C4 entries decode "
                                        "steps read, by result (hit / miss in the hot "
                                        "buffer; fast_path: a layer-step whose history fits "
                                        "it).", "result")
        self.hisparse_bytes = counter("hisparse_bytes", "HiSparse: bytes copied host -> "
                                      "device into hot buffers (misses, fills, prefill "
                                      "staging).")
        self.hisparse_in_use = gauge("hisparse_buffers_in_use", "HiSparse: sets of hot "
                                     "buffers held by running requests.")
        self.running = gauge("num_requests_running", "Requests running on the engine.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for admission.")
        self.pages_used = gauge("pages_used", "Pages in use (cached or held by requests), by "
                                "tier and pool.", "tier", "pool")
        self.arena_bytes = gauge("arena_bytes", "With --device-bytes: bytes of the device "
                                 "arena's frames each pool holds (pool=\"free\": frames no "
                                 "pool holds).", "pool")
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Between consecutive deliveries "
                             "of tokens (one a step, several with speculative decoding).",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the end.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first admission.",
                               REQUEST_LATENCY_BUCKETS)
        self.model_name = model_name
        for metric in (self.prompt_tokens, self.generation_tokens, self.preemptions,
                       self.storage_errors, self.running, self.waiting, self.ttft, self.itl,
                       self.e2e, self.queue):
            metric.labels(model_name)
        for tier in TIERS:  # every series exists from the start, 0 included
            self.cached_tokens.labels(model_name, tier)
        for reason in FINISH_REASONS:
            self.requests.labels(model_name, reason)
        for tier in ("host", "storage"):
            self.loaded_bytes.labels(model_name, tier)
            self.backup_bytes.labels(model_name, tier)
        self._last: dict[str, float] = {}
        self.spec: SpecMetrics | None = None
        if num_draft_tokens:
            self.spec = SpecMetrics(counter, model_name, num_draft_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ----------------------------------------------------- engine thread
    def engine_status(self, status: Mapping[str, Any]) -> None:
        """Gauges from `Engine.status()`, and counters advanced by what it says changed."""
        m = self.model_name
        self.running.labels(m).set(status["running"])
        self.waiting.labels(m).set(status["waiting"])
        for tier, pools in status["pages_used"].items():
            for pool, used in pools.items():
                self.pages_used.labels(m, tier, pool).set(used)
        for pool, held in (status.get("arena_bytes") or {}).items():
            self.arena_bytes.labels(m, pool).set(held)
        self._advance(self.preemptions.labels(m), "preemptions", status["preemptions"])
        self._advance(self.storage_errors.labels(m), "storage_errors", status["storage_errors"])
        for tier, n in status["loaded_bytes"].items():
            self._advance(self.loaded_bytes.labels(m, tier), f"loaded:{tier}", n)
        for tier, n in status["backup_bytes"].items():
            self._advance(self.backup_bytes.labels(m, tier), f"backup:{tier}", n)
        hs = status.get("hisparse")
        if hs is not None:
            for result, key in (("hit", "hits"), ("miss", "misses"),
                                ("fast_path", "fast_path_lookups")):
                self._advance(self.hisparse_lookups.labels(m, result), f"hs:{key}", hs[key])
            self._advance(self.hisparse_bytes.labels(m), "hs:bytes", hs["bytes_moved"])
            self.hisparse_in_use.labels(m).set(hs["in_use"])
        spec = status.get("spec")
        if self.spec is not None and spec is not None:
            self.spec.advance(self._advance, spec)

    def _advance(self, counter: Any, key: str, total: float) -> None:
        delta = total - self._last.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last[key] = total

    def admitted(self, prompt_tokens: int, cached_by_tier: Mapping[str, int],
                 queue_seconds: float) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        for tier, n in cached_by_tier.items():
            self.cached_tokens.labels(m, tier).inc(n)
        self.queue.labels(m).observe(max(queue_seconds, 0.0))

    # ---------------------------------------------------------- HTTP side
    def generated(self, tokens: int) -> None:
        """Tokens handed to a client (counted where usage is, so the two always agree)."""
        self.generation_tokens.labels(self.model_name).inc(tokens)

    def request_ended(self, reason: str, e2e: float, ttft: float | None,
                      gaps: list[float]) -> None:
        m = self.model_name
        self.requests.labels(m, reason).inc()
        self.e2e.labels(m).observe(e2e)
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
        itl = self.itl.labels(m)
        for gap in gaps:
            itl.observe(gap)


class SpecMetrics:
    """Speculative decoding's counters, vLLM's (`vllm:spec_decode_*`) under our prefix, so
    its PromQL reads them: acceptance rate = rate(num_accepted_tokens) /
    rate(num_draft_tokens); mean accepted length = 1 + rate(num_accepted_tokens) /
    rate(num_drafts); per-position acceptance = num_accepted_tokens_per_pos / num_drafts.
    A draft is one verify step of one request that carried draft tokens; position i
    (0-based) counts the drafts whose (i+1)-th token was kept."""

    def __init__(self, counter: Any, model_name: str, num_draft_tokens: int) -> None:
        m = model_name
        self.drafts = counter("spec_decode_num_drafts", "Speculative decoding: drafts "
                              "verified (one per request and step that carried drafts).")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative decoding: "
                                    "draft tokens verified.")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Speculative decoding: "
                                "draft tokens accepted (kept in the output).")
        self.per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Speculative "
                               "decoding: accepted tokens per draft position (0-based).",
                               "position")
        self.model_name = m
        for metric in (self.drafts, self.draft_tokens, self.accepted):
            metric.labels(m)
        self.positions = [self.per_pos.labels(m, str(i)) for i in range(num_draft_tokens)]

    def advance(self, advance: Callable[[Any, str, float], None],
                spec: Mapping[str, Any]) -> None:
        """Move the counters by what the engine's cumulative totals in `spec` (its
        `stats()["spec"]` shape) say changed, through ServerMetrics._advance."""
        m = self.model_name
        advance(self.drafts.labels(m), "spec:drafts", spec["drafts"])
        advance(self.draft_tokens.labels(m), "spec:draft_tokens", spec["draft_tokens"])
        advance(self.accepted.labels(m), "spec:accepted_tokens", spec["accepted_tokens"])
        for i, (counter, n) in enumerate(zip(self.positions, spec["accepted_per_position"],
                                             strict=False)):
            advance(counter, f"spec:pos:{i}", n)
