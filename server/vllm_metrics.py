"""vLLM's metric names (`vllm:*`) next to ours, for the routers, autoscalers and dashboards of the vLLM
ecosystem (vllm-router, llm-d's endpoint picker, KEDA / prometheus-adapter rules, Grafana boards), which
read `vllm:num_requests_waiting`, `vllm:num_requests_running` and `vllm:kv_cache_usage_perc` with the label
`model_name`.

The aliases are computed at scrape time from our own metric objects, so both names always carry exactly the
same values: there is one set of counters, read twice.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

OUR_PREFIX, VLLM_PREFIX = "pagedserve_", "vllm:"
# Our family name (no _total suffix) -> the vLLM V1 names it is also served as. Only metrics whose meaning
# is the same in vLLM; ours that vLLM lacks (structured outputs, 429s) stay ours only.
VLLM_ALIASES: dict[str, tuple[str, ...]] = {
    "pagedserve_num_requests_running": ("vllm:num_requests_running",),
    "pagedserve_num_requests_waiting": ("vllm:num_requests_waiting",),
    # vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc (0.10); older routers and boards read the old.
    "pagedserve_kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "pagedserve_prompt_tokens": ("vllm:prompt_tokens",),
    "pagedserve_generation_tokens": ("vllm:generation_tokens",),
    "pagedserve_request_success": ("vllm:request_success",),
    "pagedserve_num_preemptions": ("vllm:num_preemptions",),
    "pagedserve_prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "pagedserve_prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "pagedserve_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "pagedserve_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",),
    "pagedserve_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "pagedserve_request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "pagedserve_request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "pagedserve_request_generation_tokens": ("vllm:request_generation_tokens",),
    "pagedserve_lora_requests_info": ("vllm:lora_requests_info",),
    "pagedserve_spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "pagedserve_spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "pagedserve_spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "pagedserve_spec_decode_num_accepted_tokens_per_pos": ("vllm:spec_decode_num_accepted_tokens_per_pos",),
}
# Families that exist only in some configurations (LoRA off: no lora_requests_info; no speculative decoding).
OPTIONAL = frozenset({"pagedserve_lora_requests_info", "pagedserve_spec_decode_num_drafts",
                      "pagedserve_spec_decode_num_draft_tokens", "pagedserve_spec_decode_num_accepted_tokens",
                      "pagedserve_spec_decode_num_accepted_tokens_per_pos"})


def _renamed(family: Metric, old: str, new: str) -> Metric:
    copy = Metric(new, family.documentation, family.type, family.unit)
    copy.samples = [sample._replace(name=new + sample.name[len(old):]) for sample in family.samples]
    return copy


class VllmAliasCollector(Collector):
    """Serves each metric of `families` (ours, by family name) again under its vLLM names."""

    def __init__(self, families: Mapping[str, MetricWrapperBase]) -> None:
        missing = set(VLLM_ALIASES) - set(families) - OPTIONAL
        if missing:
            raise ValueError(f"no metric to alias for {sorted(missing)}")
        self._families = {name: families[name] for name in VLLM_ALIASES if name in families}

    def collect(self) -> Iterator[Metric]:
        for name, metric in self._families.items():
            for family in metric.collect():
                for alias in VLLM_ALIASES[name]:
                    yield _renamed(family, name, alias)
