"""GET /tokenizer_info (vLLM's shape) describes the server's own tokenizer, and lm-eval's remote tokenizer works
from it: the same ids and text as the tokenizer itself."""
from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.server.conftest import MAX_MODEL_LEN


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(str(tiny_checkpoint))


def test_tokenizer_info_is_the_servers_tokenizer(http: httpx.Client, tokenizer) -> None:
    info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] and info["model_max_length"] == MAX_MODEL_LEN
    for name in ("eos_token", "bos_token", "pad_token", "unk_token", "chat_template"):
        assert info[name] == getattr(tokenizer, name), name
    assert info["eos_token"] is not None and "{%" in info["chat_template"]
    assert info["added_tokens"] == {str(i): t.content for i, t in tokenizer.added_tokens_decoder.items()}
    assert info["vocab_size"] >= len(tokenizer)


def test_lm_eval_remote_tokenizer_uses_it(server, tokenizer) -> None:
    utils = pytest.importorskip("lm_eval.utils", reason="lm-eval is a test dependency")
    assert utils.check_remote_tokenizer_support(server.base_url + "/v1/completions")
    remote = utils.RemoteTokenizer(server.base_url)
    text = "The quick brown fox, 12 times."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert remote.encode(text) == ids
    assert remote.decode(ids) == tokenizer.decode(ids)
    assert remote.eos_token == tokenizer.eos_token
