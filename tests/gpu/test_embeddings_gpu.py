"""Embedding requests on the GPU path: Triton attention, overlap, and CUDA graphs for the decode steps around
them (a step with an embedding request runs eagerly, also a one-token input among decodes). fp32 vectors equal
transformers'. Run: pytest tests/gpu -q"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.pooling import embedding_params, embedding_values
from tests.helpers import make_checkpoint, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("gpu-emb"), "qwen3", num_hidden_layers=4, hidden_size=256,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512)


@torch.inference_mode()
def hf_embedding(path, prompt: list[int], pooling: str) -> torch.Tensor:
    from transformers import AutoModel
    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    hidden = model(torch.tensor([prompt])).last_hidden_state[0]
    return F.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=-1)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_fp32_vectors_match_transformers_beside_graphed_decodes(path, pooling: str) -> None:
    llm = LLM(model=str(path), device="cuda", dtype="float32", block_size=16, max_num_seqs=16,
              max_num_batched_tokens=32, pooling_type=pooling, async_scheduling=True)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.use_graphs
    engine = llm.engine
    for i, prompt in enumerate(random_prompts(1000, [3, 5, 8], seed=31)):
        engine.add_request(f"gen-{i}", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    emb_prompts = random_prompts(1000, [1, 100, 7], seed=32)     # one token (a decode-shaped step), chunked
    vectors: dict[str, bytes] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.embedding is not None:
                vectors[delta.request_id] = delta.embedding
        steps += 1
        if steps in (5, 9, 13):          # added while the generating requests decode
            k = (5, 9, 13).index(steps)
            engine.add_request(f"emb-{k}", emb_prompts[k], embedding_params())
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    for k, prompt in enumerate(emb_prompts):
        got = torch.tensor(embedding_values(vectors[f"emb-{k}"]))
        assert (got - hf_embedding(path, prompt, pooling)).abs().max().item() < 1e-4
