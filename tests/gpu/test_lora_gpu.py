"""LoRA on the GPU path: the Triton shrink/expand kernels (kernels/lora.py) inside the engine, with Triton
attention, overlap and CUDA graphs (captured with the LoRA kernels: decode steps with adapters replay too). A batch mixing two adapters and the base gives
fp32 greedy tokens equal to transformers + peft. Run: pytest tests/gpu -q"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from tests.helpers import make_checkpoint, random_prompts
from tests.lora_adapters import make_adapter, peft_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("peft", reason="peft is a test dependency: pip install -e '.[test]'")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_mixed_adapters_on_cuda_match_peft(tmp_path):
    base = make_checkpoint(tmp_path, "qwen3", num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, intermediate_size=512)
    adapters = {"all": make_adapter(base, tmp_path / "all", ALL, rank=16, alpha=32, seed=1),
                "qv": make_adapter(base, tmp_path / "qv", ["q_proj", "v_proj"], rank=8, alpha=32, seed=2)}
    prompts = random_prompts(1000, [5, 40, 17, 9, 33, 2], seed=3)
    loras = [LoRARequest("all", 1, str(adapters["all"])), LoRARequest("qv", 2, str(adapters["qv"])), None] * 2
    llm = LLM(model=str(base), device="cuda", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    graphs, run = llm.engine.runner.graphs, llm.engine.runner.graphs.run
    replayed: list[bool] = []

    def watched(input_ids, positions, meta, lora_slots=None):
        replayed.append(lora_slots is not None and graphs.bucket_for(input_ids.shape[0]) in graphs.graphs)
        return run(input_ids, positions, meta, lora_slots)

    graphs.run = watched
    outs = llm.generate(prompts, params, lora_request=loras)
    assert llm.engine.info.cuda_graphs and any(replayed)    # decode steps with adapters replay graphs
    for prompt, request, out in zip(prompts, loras, outs):
        adapter = None if request is None else adapters[request.lora_name]
        assert out.outputs[0].token_ids == peft_greedy(base, adapter, prompt, 12)
