"""The real default model behind the server with a LoRA adapter: `model: NAME` gives transformers + peft's
greedy output on the same GGUF file (fp32, dequantized at load: from the blocks gate/up's inputs are rounded to
int8 on VNNI CPUs, and adapters on blocks are compared with peft offline, tests/test_lora.py), and the base
model's name still gives the base model's."""
from __future__ import annotations

import httpx
import pytest

from tests.helpers import random_prompts
from tests.lora_adapters import make_adapter, peft_greedy
from tests.server.server_proc import ServerProcess

pytest.importorskip("peft", reason="peft is a test dependency: pip install -e '.[test]'")

MAX_TOKENS = 8


def test_smollm2_adapter_over_http_matches_peft(smollm2_file, tmp_path):
    from transformers import AutoTokenizer
    adapter = make_adapter(smollm2_file, tmp_path / "all",
                           ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                           rank=16, alpha=32, seed=41)
    prompts = random_prompts(49152, [14, 25], seed=42)
    server = ServerProcess("--model", str(smollm2_file), "--served-model-name", "base", "--device", "cpu",
                           "--dtype", "float32", "--quantization", "none", "--max-model-len", "128", "--enable-lora",
                           "--lora-modules", f"tuned={adapter}").wait_ready()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(smollm2_file.parent), gguf_file=smollm2_file.name)
        for model, path in (("tuned", adapter), ("base", None)):
            body = {"model": model, "prompt": prompts, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
            want = [tokenizer.decode(peft_greedy(smollm2_file, path, p, MAX_TOKENS)) for p in prompts]
            assert texts == want, model
    finally:
        server.stop()
