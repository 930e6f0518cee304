"""Two `pagedserve serve` replicas behind vllm-router (the recipe of docs/replicas.md), as real processes:
requests spread over both, the vLLM metric names the router's ecosystem reads carry our values, and after
one replica is SIGKILLed the router keeps answering from the other."""
from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import yaml

from tests.replicas.cluster import RouterProcess, finished_requests, metric, router_installed, sigkill, start_replicas
from tests.server.prom import GUARD_S
from tests.server.server_proc import REPO_ROOT, ServerProcess

ROUTER = "vllm-router"
BODY = {"model": "tiny-random", "prompt": "Two replicas behind one router", "max_tokens": 4, "ignore_eos": True}

pytestmark = pytest.mark.skipif(not router_installed(ROUTER),
                                reason=f"{ROUTER} is not installed (`pip install {ROUTER}`; .ci/install does)")


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[ServerProcess]]:
    procs = start_replicas(2)
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def router(replicas: list[ServerProcess]) -> Iterator[RouterProcess]:
    proc = RouterProcess.start(ROUTER, [r.base_url for r in replicas], policy="round_robin").wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(router: RouterProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=router.base_url, timeout=60.0) as client:
        yield client


def test_requests_spread_over_both_replicas(replicas: list[ServerProcess], http: httpx.Client) -> None:
    count = 8
    before = [finished_requests(r.base_url) for r in replicas]
    responses = [http.post("/v1/completions", json=BODY) for _ in range(count)]
    assert [r.status_code for r in responses] == [200] * count
    assert all(r.json()["usage"]["completion_tokens"] == BODY["max_tokens"] for r in responses)
    grew = [finished_requests(r.base_url) - b for r, b in zip(replicas, before)]
    assert sum(grew) == count, grew              # every request ran on exactly one replica
    assert all(g > 0 for g in grew), grew        # and both replicas served some


def test_vllm_names_carry_our_values(replicas: list[ServerProcess], http: httpx.Client) -> None:
    assert http.post("/v1/completions", json=BODY).status_code == 200
    for replica in replicas:
        url = replica.base_url
        for ours, theirs in (("pagedserve_num_requests_running", "vllm:num_requests_running"),
                             ("pagedserve_num_requests_waiting", "vllm:num_requests_waiting"),
                             ("pagedserve_kv_cache_usage_perc", "vllm:kv_cache_usage_perc"),
                             ("pagedserve_prompt_tokens_total", "vllm:prompt_tokens_total"),
                             ("pagedserve_generation_tokens_total", "vllm:generation_tokens_total")):
            # Idle replicas: nothing moves between the two scrapes of one pair.
            assert metric(url, theirs, model_name="tiny-random") == metric(url, ours, model_name="tiny-random")
        assert metric(url, "vllm:generation_tokens_total") > 0


def test_router_answers_its_k8s_probes(http: httpx.Client) -> None:
    """docker/k8s/router.yaml probes the router on these paths: they must exist on the router we test."""
    docs = yaml.safe_load_all((REPO_ROOT / "docker" / "k8s" / "router.yaml").read_text())
    (router,) = [d for d in docs if d and d["kind"] == "Deployment"]
    (c,) = router["spec"]["template"]["spec"]["containers"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert http.get(c[probe]["httpGet"]["path"]).status_code == 200, probe


def _healthy(http: httpx.Client) -> dict[str, bool]:
    """The router's view of its workers (its /workers route), by URL."""
    return {w["url"]: w["is_healthy"] for w in http.get("/workers").json()["workers"]}


def test_router_keeps_serving_after_a_replica_is_killed(replicas: list[ServerProcess], http: httpx.Client) -> None:
    survivor, victim = replicas
    assert _healthy(http) == {survivor.base_url: True, victim.base_url: True}
    sigkill(victim)
    # Until the router's health check (every 1 s here) marks the replica down, a request may go to it; wait
    # for that state, then every request must succeed, all on the survivor.
    deadline = time.monotonic() + GUARD_S
    while _healthy(http)[victim.base_url]:
        assert time.monotonic() < deadline, "the router did not mark the killed replica down"
        time.sleep(0.1)
    assert _healthy(http) == {survivor.base_url: True, victim.base_url: False}
    before = finished_requests(survivor.base_url)
    count = 8
    statuses = [http.post("/v1/completions", json=BODY).status_code for _ in range(count)]
    assert statuses == [200] * count
    assert finished_requests(survivor.base_url) - before == count
    assert victim.proc.poll() is not None
