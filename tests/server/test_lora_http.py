"""LoRA adapters through the server: `model: NAME` picks an adapter (--lora-modules at startup, or loaded at
runtime with --allow-runtime-lora-updating) and gets exactly the offline engine's tokens with that adapter;
/v1/models lists adapters; unknown names and broken adapter directories are 404 / 400 in the OpenAI
envelope and the server stays healthy; lora_requests_info names the adapters."""
from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import make_adapter
from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, start_server
from tests.server.server_proc import ServerProcess

pytest.importorskip("peft", reason="peft is a test dependency: pip install -e '.[test]'")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 230, 41, 9], [300, 12, 7, 88, 61, 23, 19, 4]]


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("http-lora")
    return {"sql": make_adapter(tiny_checkpoint, root / "sql", ALL, rank=8, alpha=16, seed=31),
            "chat": make_adapter(tiny_checkpoint, root / "chat", ["q_proj", "v_proj"], rank=4, alpha=16, seed=32),
            "wide": make_adapter(tiny_checkpoint, root / "wide", ALL, rank=32, alpha=32, seed=33)}


@pytest.fixture(scope="module")
def lora_server(tiny_checkpoint, adapters):
    proc = start_server(tiny_checkpoint, "--enable-lora", "--lora-modules", f"sql={adapters['sql']}",
                        "--max-loras", "2", "--max-lora-rank", "16", "--allow-runtime-lora-updating",
                        "--vllm-metric-names")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def offline(tiny_checkpoint, adapters):
    """The offline engine's greedy texts per adapter name (None: the base model), for PROMPTS."""
    llm = LLM(model=str(tiny_checkpoint), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN,
              enable_lora=True, max_loras=2, max_lora_rank=16)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    result = {}
    for i, name in enumerate((None, "sql", "chat")):
        lora = None if name is None else LoRARequest(name, i, str(adapters[name]))
        result[name] = [o.outputs[0].text for o in llm.generate(PROMPTS, params, lora_request=lora)]
    assert result["sql"] != result[None] and result["chat"] != result[None]
    return result


def completion_texts(server: ServerProcess, model: str) -> list[str]:
    body = {"model": model, "prompt": PROMPTS, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["model"] == model
    return [c["text"] for c in sorted(data["choices"], key=lambda c: c["index"])]


def test_models_lists_the_adapters(lora_server, adapters):
    models = openai.OpenAI(base_url=f"{lora_server.base_url}/v1", api_key="x").models.list().data
    cards = {m.id: m for m in models}
    assert set(cards) == {MODEL_NAME, "sql"}
    assert cards["sql"].parent == MODEL_NAME and cards["sql"].root == str(adapters["sql"])
    assert httpx.get(f"{lora_server.base_url}/v1/models/sql").json()["parent"] == MODEL_NAME


def test_an_adapter_by_name_gets_the_offline_output(lora_server, offline):
    assert completion_texts(lora_server, "sql") == offline["sql"]
    assert completion_texts(lora_server, MODEL_NAME) == offline[None]


def test_chat_stream_carries_the_adapter_name(lora_server):
    client = openai.OpenAI(base_url=f"{lora_server.base_url}/v1", api_key="x")
    chunks = list(client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, stream=True))
    assert chunks and all(c.model == "sql" for c in chunks)


def test_unknown_model_is_404(lora_server):
    r = httpx.post(f"{lora_server.base_url}/v1/completions", json={"model": "nope", "prompt": "a", "max_tokens": 1})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_load_use_unload_at_runtime(lora_server, adapters, offline):
    url = lora_server.base_url
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(adapters["chat"])})
    assert r.status_code == 200 and "added successfully" in r.text
    assert completion_texts(lora_server, "chat") == offline["chat"]
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(adapters["chat"])})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert r.status_code == 200 and "removed successfully" in r.text
    gone = httpx.post(f"{url}/v1/completions", json={"model": "chat", "prompt": "a", "max_tokens": 1})
    assert gone.status_code == 404
    assert {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]} == {MODEL_NAME, "sql"}


@pytest.mark.parametrize("body,status,message", [
    ({"lora_name": "x", "lora_path": "/nowhere/at/all"}, 400, "does not exist"),
    ({"lora_name": "w", "lora_path": "WIDE"}, 400, "above --max-lora-rank 16"),
    ({"lora_name": "x"}, 400, "lora_path"),
    ({"lora_name": "", "lora_path": "/tmp"}, 400, "must be provided"),
    ({"lora_name": MODEL_NAME, "lora_path": "/tmp"}, 400, "already been loaded"),
])
def test_bad_loads_are_400(lora_server, adapters, body, status, message):
    body = {k: str(adapters["wide"]) if v == "WIDE" else v for k, v in body.items()}
    r = httpx.post(f"{lora_server.base_url}/v1/load_lora_adapter", json=body)
    assert r.status_code == status and message in r.json()["error"]["message"], r.text
    assert httpx.get(f"{lora_server.base_url}/health").status_code == 200


def test_unload_unknown_is_404(lora_server):
    r = httpx.post(f"{lora_server.base_url}/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_lora_requests_info(lora_server):
    completion_texts(lora_server, "sql")
    text = httpx.get(f"{lora_server.base_url}/metrics").text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    for name in ("pagedserve_lora_requests_info", "vllm:lora_requests_info"):
        [sample] = [s for s in samples if s.name == name]
        assert sample.labels["max_lora"] == "2" and sample.value > 1.7e9


def test_runtime_updates_are_404_without_the_flag(server):
    r = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
    assert r.status_code == 404


def test_a_broken_startup_adapter_stops_the_server(tiny_checkpoint, tmp_path):
    proc = ServerProcess("--model", str(tiny_checkpoint), "--device", "cpu", "--max-model-len", "64",
                         "--enable-lora", "--lora-modules", f"bad={tmp_path / 'missing'}")
    with pytest.raises(RuntimeError, match="does not exist"):
        proc.wait_ready()
    proc.stop()
