"""GET /get_load: SGLang's load report (what vllm-router's and sglang-router's power_of_two read), from the
engine's latest step stats."""
from __future__ import annotations

import time

from engine.outputs import EngineStats
from tests.server.fakes import scripted_client
from tests.server.prom import GUARD_S


def test_get_load_follows_the_engine_stats() -> None:
    for client, [engine] in scripted_client():
        block_size = engine.info.block_size
        assert client.get("/get_load").json() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0,
                                                   "num_tokens": 0}]
        for running, waiting, blocks in ((3, 2, 5), (1, 0, 2)):
            engine.deliver([], EngineStats(num_running=running, num_waiting=waiting, kv_blocks_used=blocks))
            expected = [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
                         "num_tokens": blocks * block_size}]
            deadline = time.monotonic() + GUARD_S     # delivered on the event loop: poll until it landed
            while (got := client.get("/get_load").json()) != expected:
                assert time.monotonic() < deadline, got
                time.sleep(0.01)
        # The same numbers /metrics serves.
        metrics = client.get("/metrics").text
        assert 'pagedserve_num_requests_running{model_name="scripted"} 1.0' in metrics


def test_get_load_needs_the_api_key() -> None:
    for client, _ in scripted_client(api_key="k"):
        assert client.get("/get_load").status_code == 401
        assert client.get("/get_load", headers={"Authorization": "Bearer k"}).status_code == 200
