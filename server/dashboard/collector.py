"""StatsCollector: what GET /v1/stats answers, built from the step messages and the server's metrics.

The AsyncEngine calls on_submit / on_step / on_release on the event loop (server/async_engine.py); per step
that is one pass over the step's requests (timelines) and a few additions. The Prometheus registry is read
at most once per second (and once per /v1/stats request) into a ring of per-second rows, from which the
rates and the windowed latency quantiles are differences.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.messages import StepOutput
from engine.model_info import ModelInfo
from server.dashboard.quantiles import Buckets, read_registry, summary
from server.dashboard.series import SecondRing, rates
from server.dashboard.timelines import RequestTimelines
from server.metrics import FINISH_REASONS, ServerMetrics

HISTORY_S = 300                 # the charts' span
LATENCY_WINDOW_S = 60           # "recent" quantiles
EFFICIENCY_WINDOW_S = 10        # decode steps the efficiency gauge averages over
_TTFT, _ITL = "pagedserve_time_to_first_token_seconds", "pagedserve_inter_token_latency_seconds"
_COUNTERS = {"prompt_tokens": "pagedserve_prompt_tokens_total",
             "generation_tokens": "pagedserve_generation_tokens_total",
             "preemptions": "pagedserve_num_preemptions_total",
             "prefix_queries": "pagedserve_prefix_cache_queries_total",
             "prefix_hits": "pagedserve_prefix_cache_hits_total",
             "rejected": "pagedserve_num_requests_rejected_total",
             **{f"finished_{r}": f"pagedserve_request_success_total{{{r}}}" for r in FINISH_REASONS}}


@dataclass
class DashboardOptions:
    enabled: bool = True
    show_prompts: bool = False       # prompts and outputs in the request timelines
    max_requests: int = 32           # timelines kept


class DecodeWindow:
    """Bytes and seconds of the decode-only steps, summed per second over the last few seconds."""

    def __init__(self, window_s: int) -> None:
        self.window_s = window_s
        self._per_second: deque[list[float]] = deque()       # [second, bytes, seconds]

    def add(self, now: float, nbytes: float, seconds: float) -> None:
        second = int(now)
        if self._per_second and self._per_second[-1][0] == second:
            entry = self._per_second[-1]
            entry[1] += nbytes
            entry[2] += seconds
        else:
            self._per_second.append([second, nbytes, seconds])
        while self._per_second and self._per_second[0][0] <= second - self.window_s:
            self._per_second.popleft()

    def bytes_per_second(self, now: float) -> float | None:
        """Achieved bytes/s of the recent decode steps; None when none ran in the window."""
        since = int(now) - self.window_s
        nbytes = sum(e[1] for e in self._per_second if e[0] > since)
        seconds = sum(e[2] for e in self._per_second if e[0] > since)
        return nbytes / seconds if seconds > 0 else None


class StatsCollector:
    def __init__(self, info: ModelInfo, metrics: ServerMetrics, served_model_name: str, version: str,
                 options: DashboardOptions, decode_text: Callable[[list[int]], str] | None = None,
                 started: float | None = None) -> None:
        self.info, self.metrics, self.options = info, metrics, options
        self.served_model_name, self.version = served_model_name, version
        self.started = time.monotonic() if started is None else started
        self.ring = SecondRing(HISTORY_S + 1)
        self.timelines = RequestTimelines(options.max_requests, keep_tokens=options.show_prompts)
        self.decode = DecodeWindow(EFFICIENCY_WINDOW_S)
        self._decode_text = decode_text if options.show_prompts else None
        self._gauges = {"running": 0, "waiting": 0, "kv_used": 0, "kv_cached": 0}
        self._loras: tuple[list[str], list[str]] = ([], [])     # adapters running, and only waiting
        self._spec = (0, 0, 0)      # speculative decoding totals: drafts, draft tokens, accepted tokens
        self._last_tick = -1
        self.tick(self.started - 1.0)     # the baseline: the first second's rates need a row before it
        metrics.registry.register(_EfficiencyCollector(self))

    # --- hooks (event loop) ----------------------------------------------------------------------------
    def on_submit(self, request_id: str, prompt_token_ids: list[int], arrival: float) -> None:
        self.timelines.on_submit(request_id, prompt_token_ids, arrival)

    def on_step(self, output: StepOutput, now: float) -> None:
        stats = output.stats
        g = self._gauges
        g["running"], g["waiting"] = stats.num_running, stats.num_waiting
        g["kv_used"], g["kv_cached"] = stats.kv_blocks_used, stats.kv_blocks_cached
        self._loras = (stats.running_loras, stats.waiting_loras)
        self._spec = (stats.spec_num_drafts_total, stats.spec_num_draft_tokens_total,
                      stats.spec_num_accepted_tokens_total)
        step = stats.step
        if step is not None and step.num_decode_seqs and not step.num_prefill_tokens:
            info = self.info
            self.decode.add(now, info.weight_bytes + step.num_context_tokens * info.kv_bytes_per_token,
                            step.seconds)
        self.timelines.on_step(output, now)
        if int(now) != self._last_tick:
            self.tick(now)

    def on_release(self, request_id: str, now: float, finish_reason: str | None) -> None:
        self.timelines.on_release(request_id, now, finish_reason)

    def tick(self, now: float) -> None:
        """Samples the metrics into this second's row."""
        values, hists = read_registry(self.metrics.registry)
        row: dict[str, Any] = {key: values.get(name, 0.0) for key, name in _COUNTERS.items()}
        row.update(self._gauges)
        row["ttft"], row["itl"] = hists.get(_TTFT), hists.get(_ITL)
        self._last_tick = int(now)
        self.ring.record(int(now), row)

    # --- GET /v1/stats ---------------------------------------------------------------------------------
    def efficiency(self, now: float) -> dict[str, Any]:
        achieved = self.decode.bytes_per_second(now)
        bandwidth = self.info.memory_bandwidth
        return {"decode_bytes_per_s": achieved, "memory_bandwidth": bandwidth,
                "utilization": achieved / bandwidth if achieved is not None and bandwidth else None,
                "window_s": EFFICIENCY_WINDOW_S,
                "note": None if bandwidth else "n/a: the device's memory bandwidth is unknown (CPU)"}

    def _speculative(self) -> dict[str, Any] | None:
        """Speculative decoding since startup (None: off): acceptance rate = accepted / draft tokens, and
        the mean tokens a verifying sequence gains per step (1 + accepted / drafts)."""
        info = self.info
        if not info.num_speculative_tokens:
            return None
        drafts, draft_tokens, accepted = self._spec
        return {"method": info.speculative_method, "num_speculative_tokens": info.num_speculative_tokens,
                "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
                "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
                "mean_accepted_length": 1 + accepted / drafts if drafts else None}

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        self.tick(now)
        seconds, rows = self.ring.rows(HISTORY_S)
        last = rows[-1]
        _, recent = self.ring.rows(LATENCY_WINDOW_S)
        info = self.info
        usable = info.num_kv_blocks - 1
        finished = {r: last[f"finished_{r}"] for r in FINISH_REASONS}
        return {
            "server": self._server(now),
            "now": {"running": last["running"], "waiting": last["waiting"],
                    "kv_blocks": {"used": last["kv_used"], "cached": last["kv_cached"],
                                  "free": usable - last["kv_used"] - last["kv_cached"], "total": usable},
                    # LoRA adapters with running requests, and those with waiting ones only (None: LoRA off)
                    "lora": {"max_loras": info.max_loras, "running": self._loras[0], "waiting": self._loras[1]}
                    if info.max_loras else None,
                    "speculative": self._speculative()},
            "totals": {"prompt_tokens": last["prompt_tokens"], "generation_tokens": last["generation_tokens"],
                       "requests": sum(finished.values()), "finished": finished, "errors": finished["error"],
                       "rejected": last["rejected"], "preemptions": last["preemptions"],
                       "prefix_cache_queries": last["prefix_queries"], "prefix_cache_hits": last["prefix_hits"],
                       "prefix_cache_hit_rate": (last["prefix_hits"] / last["prefix_queries"]
                                                 if last["prefix_queries"] else None)},
            "latency": {name: self._latency(recent, name) for name in ("ttft", "itl")},
            "series": self._series(seconds, rows),
            "efficiency": self.efficiency(now),
            "requests": [t.to_json(now, self._decode_text) for t in self.timelines.latest()],
        }

    def _server(self, now: float) -> dict[str, Any]:
        info = self.info
        return {"model": info.model_name, "served_model_name": self.served_model_name, "device": info.device,
                "device_name": info.device_name, "dtype": info.dtype,
                "weight_format": info.weight_format, "model_weight_bytes": info.model_weight_bytes, "attention_backend": info.attention_backend,
                "cuda_graphs": info.cuda_graphs, "version": self.version, "uptime_s": round(now - self.started, 1),
                "max_model_len": info.max_model_len, "block_size": info.block_size,
                "max_num_seqs": info.max_num_seqs, "show_prompts": self.options.show_prompts,
                "history_s": HISTORY_S, "latency_window_s": LATENCY_WINDOW_S}

    @staticmethod
    def _latency(recent: list[dict[str, Any]], name: str) -> dict[str, Any]:
        latest: Buckets | None = recent[-1][name]
        if latest is None:
            return {"all": None, "window": None}
        first: Buckets | None = recent[0][name]
        window = latest.minus(first) if first is not None and len(recent) > 1 else latest
        return {"all": summary(latest), "window": summary(window)}

    @staticmethod
    def _series(seconds: list[int], rows: list[dict[str, Any]]) -> dict[str, list[float]]:
        end = seconds[-1]
        return {"seconds_ago": [s - end for s in seconds[1:]],
                "prompt_tok_s": rates(rows, "prompt_tokens"), "generation_tok_s": rates(rows, "generation_tokens"),
                "errors": rates(rows, "finished_error"), "rejected": rates(rows, "rejected"),
                "preemptions": rates(rows, "preemptions"),
                **{key: [r[key] for r in rows[1:]] for key in ("running", "waiting", "kv_used", "kv_cached")}}


class _EfficiencyCollector(Collector):
    """Prometheus gauges computed at scrape time from the recent decode steps (never stale)."""

    def __init__(self, stats: StatsCollector) -> None:
        self.stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        eff = self.stats.efficiency(time.monotonic())
        name = self.stats.metrics.model_name
        achieved = GaugeMetricFamily("pagedserve_decode_bytes_per_second", "Bytes of weights and KV read per "
                                     "second by the decode-only steps of the last 10 s.", labels=["model_name"])
        achieved.add_metric([name], eff["decode_bytes_per_s"] or 0.0)
        yield achieved
        if eff["memory_bandwidth"]:
            util = GaugeMetricFamily("pagedserve_decode_bandwidth_utilization", "Achieved decode bytes/s over the "
                                     "device's memory bandwidth (0..1), over the last 10 s.", labels=["model_name"])
            util.add_metric([name], eff["utilization"] or 0.0)
            yield util
