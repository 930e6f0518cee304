"""Prometheus metrics (names pagedserve_*, label model_name) in a registry owned by one app.

Gauges and the engine-side counters (preemptions, prefix cache) come from EngineStats after each step;
per-request counters and histograms are fed by the front end as it consumes each request's deltas, so
they count exactly what clients received.

The two per-token series (generated tokens, inter-token latency) are tallied as the deltas are consumed
and added to their metrics once per engine step (`flush`), not with two locked updates per token; every
read of the registry flushes first, so a scrape sees exactly what it would have seen otherwise.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST as _CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.outputs import EngineStats, RequestTimings
from server.spec_metrics import SpecDecodeMetrics
from server.vllm_metrics import VllmAliasCollector

CONTENT_TYPE = _CONTENT_TYPE
# No `*_created` series: they double the series count of every counter and histogram for a timestamp that
# nothing here needs (vLLM turns them off too). A process-wide switch of prometheus-client.
disable_created_metrics()
FINISH_REASONS = ("stop", "length", "abort", "error")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


# The HTTP route a generation came in on (set by EndpointLabel for each request): labels its requests and
# tokens in the per-endpoint counters. Only routes that generate reach them, so the label set stays small.
current_endpoint: ContextVar[str] = ContextVar("current_endpoint", default="offline")


class EndpointLabel:
    """ASGI middleware: records each HTTP request's path in `current_endpoint`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = current_endpoint.set(scope["path"])
        try:
            await self.app(scope, receive, send)
        finally:
            current_endpoint.reset(token)


def token_buckets(max_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_len (and max_len itself)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_len:
                return tuple(buckets + [float(max_len)])
            buckets.append(float(m * scale))
        scale *= 10


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int, vllm_metric_names: bool = False,
                 max_loras: int = 0, num_speculative_tokens: int = 0) -> None:
        """vllm_metric_names: also serve the metrics vLLM has under its names (vllm:*), same values;
        max_loras: LoRA adapters per step (0: LoRA off, no lora_requests_info); num_speculative_tokens: draft
        tokens per step (0: no speculative decoding, no spec_decode_* counters)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self._pending_tokens = 0                  # generated tokens not yet added to generation_tokens
        self._pending_itl: list[float] = []       # inter-token latencies not yet observed, in order
        self.registry.register(_FlushFirst(self))     # registered first: collected (flushed) first
        r, label = self.registry, ["model_name"]
        families = {}       # family name -> metric object, for the vLLM aliases

        def gauge(name: str, doc: str) -> Gauge:
            families[name] = Gauge(name, doc, label, registry=r)
            return families[name].labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            families[name] = Counter(name, doc, label, registry=r)
            return families[name].labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            families[name] = Histogram(name, doc, label, buckets=buckets, registry=r)
            return families[name].labels(model_name)

        self.num_running = gauge("pagedserve_num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("pagedserve_num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("pagedserve_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).")
        self.prompt_tokens = counter("pagedserve_prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = counter("pagedserve_generation_tokens", "Generated tokens returned to clients.")
        self.preemptions = counter("pagedserve_num_preemptions", "Requests preempted for lack of KV blocks.")
        self.prefix_queries = counter("pagedserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("pagedserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        success = Counter("pagedserve_request_success", "Finished requests by finish reason.",
                          ["model_name", "finished_reason"], registry=r)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        families["pagedserve_request_success"] = success
        self.ttft = histogram("pagedserve_time_to_first_token_seconds", "Arrival to first token.", _TTFT_BUCKETS)
        self.itl = histogram("pagedserve_inter_token_latency_seconds", "Time between a request's steps.", _ITL_BUCKETS)
        self.e2e = histogram("pagedserve_e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.queue_time = histogram("pagedserve_request_queue_time_seconds", "Arrival to first schedule.",
                                    _REQUEST_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("pagedserve_request_prompt_tokens", "Prompt length per request.", tokens)
        self.request_generation_tokens = histogram("pagedserve_request_generation_tokens",
                                                   "Generated tokens per request.", tokens)
        self.grammar_compile = histogram("pagedserve_structured_output_compile_seconds",
                                         "Time to compile one structured-output grammar (cache misses only).",
                                         _COMPILE_BUCKETS)
        self.constrained_requests = counter("pagedserve_structured_output_requests",
                                            "Requests constrained by a JSON schema, regex, choice, grammar or tool call.")
        self.rejected = counter("pagedserve_num_requests_rejected", "Requests refused with HTTP 429 (queue full).")
        self.model_weight_bytes = gauge("pagedserve_model_weight_bytes",
                                        "Bytes of model weights the engine holds (all ranks summed; quantized "
                                        "blocks at their size).")
        by_endpoint = ["model_name", "endpoint"]
        self._endpoint_requests = Counter("pagedserve_endpoint_requests", "Requests that started generating, by "
                                          "HTTP route.", by_endpoint, registry=r)
        self._endpoint_prompt_tokens = Counter("pagedserve_endpoint_prompt_tokens", "Prompt tokens of finished "
                                               "requests, by HTTP route.", by_endpoint, registry=r)
        self._endpoint_generation_tokens = Counter("pagedserve_endpoint_generation_tokens", "Generated tokens of "
                                                   "finished requests, by HTTP route.", by_endpoint, registry=r)
        self.max_loras = max_loras
        self._lora_info: Gauge | None = None
        self._lora_labels: tuple[str, str] | None = None
        if max_loras:
            # vLLM's: one series whose labels name the adapters running and waiting; its value is when they
            # last changed (a Unix time). Only the current label set is kept.
            families["pagedserve_lora_requests_info"] = self._lora_info = Gauge(
                "pagedserve_lora_requests_info", "LoRA adapters with running and with waiting requests (labels); "
                "the value is the Unix time of the last change.",
                ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
            self._observe_loras([], [])
        self.spec = SpecDecodeMetrics(r, families, model_name, num_speculative_tokens) \
            if num_speculative_tokens else None
        self._seen = EngineStats()
        if vllm_metric_names:
            r.register(VllmAliasCollector(families))

    def observe_stats(self, stats: EngineStats) -> None:
        """Called once per engine step (on the event loop)."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        # The engine reports running totals; Prometheus counters only move forward by increments.
        seen = self._seen
        for counter, increment in (
                (self.preemptions, stats.num_preemptions_total - seen.num_preemptions_total),
                (self.prefix_queries, stats.prefix_cache_queries_total - seen.prefix_cache_queries_total),
                (self.prefix_hits, stats.prefix_cache_hits_total - seen.prefix_cache_hits_total)):
            if increment > 0:
                counter.inc(increment)
        for seconds in stats.grammar_compile_seconds:
            self.grammar_compile.observe(seconds)
        if self._lora_info is not None:
            self._observe_loras(stats.running_loras, stats.waiting_loras)
        if self.spec is not None:
            self.spec.observe(stats)
        self._seen = stats

    def _observe_loras(self, running: list[str], waiting: list[str]) -> None:
        labels = (",".join(running), ",".join(waiting))
        if labels != self._lora_labels:
            self._lora_info.clear()
            self._lora_info.labels(str(self.max_loras), *labels).set_to_current_time()
            self._lora_labels = labels

    def count_tokens(self, num_tokens: int, itl: float | None) -> None:
        """`num_tokens` more were generated, `itl` seconds after the request's previous ones (None: its
        first). Tallied until the next flush."""
        self._pending_tokens += num_tokens
        if itl is not None:
            self._pending_itl.append(itl)

    def flush(self) -> None:
        """Adds the tallied tokens and latencies to their metrics (once per engine step, and before any
        read of the registry)."""
        tokens, self._pending_tokens = self._pending_tokens, 0      # taken first, then applied
        if tokens:
            self.generation_tokens.inc(tokens)
        if self._pending_itl:
            itl, self._pending_itl = self._pending_itl, []
            observe_all(self.itl, itl)

    def count_endpoint_request(self, endpoint: str) -> None:
        self._endpoint_requests.labels(self.model_name, endpoint).inc()

    def count_endpoint_tokens(self, endpoint: str, num_prompt_tokens: int, num_generated: int) -> None:
        self._endpoint_prompt_tokens.labels(self.model_name, endpoint).inc(num_prompt_tokens)
        self._endpoint_generation_tokens.labels(self.model_name, endpoint).inc(num_generated)

    @property
    def last_stats(self) -> EngineStats:
        """The engine's stats after its latest step (all zero before the first)."""
        return self._seen

    def render(self) -> bytes:
        return generate_latest(self.registry)


def observe_all(histogram: Histogram, values: list[float]) -> None:
    """The same as `histogram.observe(v)` for each value in order (same bucket counts, bit-identical sum),
    with one update per bucket instead of a locked update per value. Relies on prometheus-client's
    Histogram keeping `_upper_bounds`, `_buckets` and `_sum` (tests/server/test_metrics.py checks it)."""
    bounds = histogram._upper_bounds
    counts = [0] * len(bounds)
    total = histogram._sum.get()
    for value in values:
        total += value                          # in order, as one observe() after another would add
        counts[bisect_left(bounds, value)] += 1     # the first bucket with value <= bound (+Inf last)
    histogram._sum.set(total)
    for bucket, count in zip(histogram._buckets, counts):
        if count:
            bucket.inc(count)


class _FlushFirst(Collector):
    """Collects nothing; being the registry's first collector, it flushes the tallies before the metrics
    are read, whoever reads them (/metrics, the dashboard)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        self._metrics.flush()
        return iter(())


@dataclass
class RequestRecorder:
    """Per engine request: turns its deltas into TTFT / ITL / e2e observations, once each."""
    metrics: ServerMetrics
    endpoint: str = "offline"           # the HTTP route it came in on
    num_generated: int = 0
    last_token_time: float | None = None
    started: bool = False
    done: bool = False

    def on_delta(self, timings: RequestTimings, num_prompt_tokens: int, num_tokens: int, now: float) -> None:
        m = self.metrics
        if not self.started:
            self.started = True
            m.prompt_tokens.inc(num_prompt_tokens)
            if timings.first_scheduled_time is not None:
                m.queue_time.observe(max(0.0, timings.first_scheduled_time - timings.arrival_time))
        if num_tokens == 0:
            return
        if self.last_token_time is None:
            first = timings.first_token_time if timings.first_token_time is not None else now
            m.ttft.observe(max(0.0, first - timings.arrival_time))
            m.count_tokens(num_tokens, None)
        else:
            m.count_tokens(num_tokens, max(0.0, now - self.last_token_time))
        self.last_token_time = now
        self.num_generated += num_tokens

    def on_finish(self, reason: str, timings: RequestTimings | None, num_prompt_tokens: int, now: float) -> None:
        if self.done:
            return
        self.done = True
        m = self.metrics
        m.success[reason if reason in m.success else "error"].inc()
        m.count_endpoint_tokens(self.endpoint, num_prompt_tokens if self.started else 0, self.num_generated)
        if reason == "abort" or timings is None:
            return
        end = timings.finished_time if timings.finished_time is not None else now
        m.e2e.observe(max(0.0, end - timings.arrival_time))
        m.request_prompt_tokens.observe(num_prompt_tokens)
        m.request_generation_tokens.observe(self.num_generated)
