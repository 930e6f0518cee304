"""--vllm-metric-names: every aliased metric carries exactly our values under vLLM's name and labels."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.outputs import EngineStats, RequestTimings
from server.metrics import RequestRecorder, ServerMetrics
from server.vllm_metrics import OUR_PREFIX, VLLM_ALIASES, VLLM_PREFIX

MODEL = "org/model-x"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def busy_metrics(vllm_metric_names: bool) -> ServerMetrics:
    """A known workload: two steps of stats, three requests (two finished by length, one aborted)."""
    m = ServerMetrics(MODEL, max_model_len=128, vllm_metric_names=vllm_metric_names, max_loras=2,
                      num_speculative_tokens=3)
    m.observe_stats(EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.375, num_preemptions_total=1,
                                prefix_cache_queries_total=48, prefix_cache_hits_total=16,
                                spec_num_drafts_total=2, spec_num_draft_tokens_total=5,
                                spec_num_accepted_tokens_total=3, spec_accepted_per_pos_total=[2, 1, 0]))
    m.observe_stats(EngineStats(num_running=2, num_waiting=5, kv_cache_usage=0.625, num_preemptions_total=4,
                                prefix_cache_queries_total=80, prefix_cache_hits_total=32,
                                running_loras=["sql", "chat"], waiting_loras=["math"],
                                spec_num_drafts_total=5, spec_num_draft_tokens_total=12,
                                spec_num_accepted_tokens_total=7, spec_accepted_per_pos_total=[4, 2, 1]))
    for i, reason in enumerate(("length", "length", "abort")):
        rec = RequestRecorder(m)
        timings = RequestTimings(10.0 * i, 10.0 * i + 0.5, 10.0 * i + 0.75, 10.0 * i + 2.0)
        rec.on_delta(timings, num_prompt_tokens=7 + i, num_tokens=1, now=10.0 * i + 0.75)
        rec.on_delta(timings, num_prompt_tokens=7 + i, num_tokens=3, now=10.0 * i + 1.25)
        rec.on_finish(reason, timings, num_prompt_tokens=7 + i, now=10.0 * i + 2.0)
    return m


def _of(sample: str, family: str) -> bool:
    """Whether a sample belongs to the family (not to a longer family name that starts with it)."""
    return sample == family or sample[len(family):] in ("_total", "_bucket", "_count", "_sum") and \
        sample.startswith(family)


def test_off_by_default() -> None:
    text = busy_metrics(False).render().decode()
    assert "vllm:" not in text and "pagedserve_num_requests_waiting" in text


def test_every_alias_equals_ours() -> None:
    got = samples(busy_metrics(True).render().decode())
    ours = {k: v for k, v in got.items() if k[0].startswith(OUR_PREFIX)}
    compared = 0
    for family, aliases in VLLM_ALIASES.items():
        own = {k: v for k, v in ours.items() if _of(k[0], family)}
        assert own, family
        for alias in aliases:
            theirs = {k: v for k, v in got.items() if _of(k[0], alias)}
            renamed = {(alias + name[len(family):], labels): v for (name, labels), v in own.items()}
            assert theirs == renamed, alias       # same samples, labels (model_name, le, ...) and values
            compared += len(theirs)
    vllm_samples = [k for k in got if k[0].startswith(VLLM_PREFIX)]
    assert compared == len(vllm_samples)      # nothing served as vllm:* that is not an alias of ours


def test_lora_requests_info_names_the_adapters_of_the_last_step() -> None:
    got = samples(busy_metrics(True).render().decode())
    for name in ("pagedserve_lora_requests_info", "vllm:lora_requests_info"):
        series = [(labels, value) for (metric, labels), value in got.items() if metric == name]
        [(labels, value)] = series           # only the current label set is kept
        assert dict(labels) == {"max_lora": "2", "running_lora_adapters": "sql,chat", "waiting_lora_adapters": "math"}
        assert value > 1.7e9                 # set to the time of the change


def test_no_lora_info_without_lora() -> None:
    text = ServerMetrics(MODEL, 128, vllm_metric_names=True).render().decode()
    assert "lora_requests_info" not in text


def test_the_values_routers_read() -> None:
    got = samples(busy_metrics(True).render().decode())
    label = (("model_name", MODEL),)
    assert got[("vllm:num_requests_running", label)] == 2
    assert got[("vllm:num_requests_waiting", label)] == 5
    assert got[("vllm:kv_cache_usage_perc", label)] == 0.625
    assert got[("vllm:gpu_cache_usage_perc", label)] == 0.625
    assert got[("vllm:num_preemptions_total", label)] == 4
    assert got[("vllm:prefix_cache_hits_total", label)] == 32
    assert got[("vllm:prompt_tokens_total", label)] == 7 + 8 + 9
    assert got[("vllm:generation_tokens_total", label)] == 3 * 4
    assert got[("vllm:request_success_total", (("finished_reason", "length"), *label))] == 2
    assert got[("vllm:request_success_total", (("finished_reason", "abort"), *label))] == 1
    assert got[("vllm:time_to_first_token_seconds_count", label)] == 3
    assert got[("vllm:time_to_first_token_seconds_sum", label)] == 3 * 0.75
    assert got[("vllm:e2e_request_latency_seconds_count", label)] == 2      # aborted requests are not timed


def test_spec_decode_counters_are_the_engines_totals() -> None:
    got = samples(busy_metrics(True).render().decode())
    for name, value in (("num_drafts", 5), ("num_draft_tokens", 12), ("num_accepted_tokens", 7)):
        for prefix in (OUR_PREFIX, VLLM_PREFIX):
            assert got[(f"{prefix}spec_decode_{name}_total", (("model_name", MODEL),))] == value
    per_pos = {dict(labels)["position"]: v for (name, labels), v in got.items()
               if name == "pagedserve_spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {"0": 4, "1": 2, "2": 1}
