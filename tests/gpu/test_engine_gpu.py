"""The engine's GPU fast path: CUDA-graph replay equals eager, overlap changes nothing, KV sized from
memory, and the output still matches transformers in fp32. Run: pytest tests/gpu -q"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from tests.helpers import hf_greedy, make_checkpoint, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    # head_dim 64: the Triton kernels' sizes; 4 layers to make graphs matter
    return make_checkpoint(tmp_path_factory.mktemp("gpu"), "qwen3", num_hidden_layers=4, hidden_size=256,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512)


def greedy_tokens(path, prompts, **kw) -> list[list[int]]:
    llm = LLM(model=str(path), device="cuda", block_size=16, max_num_seqs=32, **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_graphs_overlap_and_eager_agree_in_bf16(path):
    prompts = random_prompts(1000, [1, 5, 17, 33, 64, 100, 3], seed=21)
    eager = greedy_tokens(path, prompts, dtype="bfloat16", enforce_eager=True, async_scheduling=False)
    graphs = greedy_tokens(path, prompts, dtype="bfloat16", async_scheduling=False)
    overlapped = greedy_tokens(path, prompts, dtype="bfloat16", async_scheduling=True)
    assert graphs == eager
    assert overlapped == graphs


def test_fp32_triton_engine_matches_transformers(path):
    prompts = random_prompts(1000, [4, 19, 40], seed=22)
    ours = greedy_tokens(path, prompts, dtype="float32", attention_backend="triton")
    for prompt, tokens in zip(prompts, ours):
        ref, _ = hf_greedy(path, prompt, 24)
        assert tokens == ref


def test_replay_is_bitwise_eager_on_the_padded_bucket(path):
    eng = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="bfloat16", block_size=16,
                                 max_num_seqs=16, async_scheduling=False))
    graphs = eng.runner.graphs
    assert graphs.use_graphs and set(graphs.graphs) == set(graphs.buckets)
    for i, p in enumerate(random_prompts(1000, [7, 30, 12], seed=23)):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    eng.step()                                    # prefill: all three sample their first token
    sched = eng.scheduler.schedule()
    assert sched.is_decode_only and len(sched.scheduled) == 3
    inputs = eng.runner.prepare(sched)
    replayed = graphs.run(inputs.input_ids, inputs.positions, inputs.meta).clone()
    eager = graphs._forward(graphs.bucket_for(3))[:3]   # same static buffers, eager kernels
    assert torch.equal(replayed, eager)


def test_kv_cache_is_sized_from_free_memory(path):
    eng = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5,
                                 max_num_seqs=8))
    free, total = torch.cuda.mem_get_info()
    used = total - free
    assert eng.num_kv_blocks > 1000
    assert used <= 0.55 * total   # the cache fills up to about the requested fraction, not beyond


def test_gguf_file_is_dequantized_into_the_dtype_on_cuda(tmp_path):
    """On CUDA a .gguf file is dequantized at load (--quantization auto -> none): the same greedy tokens as the
    file dequantized on CPU in fp32, no blocks kept, and --quantization gguf is refused there."""
    from engine.tiny_model import build_checkpoint
    from tests.gguf_files import write_gguf

    ckpt = build_checkpoint(tmp_path / "hf", "llama", seed=1, hidden_size=256, head_dim=64, intermediate_size=512)
    path = write_gguf(ckpt, tmp_path / "m-Q8_0.gguf", "llama", "Q8_0")
    prompts = random_prompts(1000, [5, 40], seed=23)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    gpu = LLM(model=str(path), device="cuda", dtype="float32", attention_backend="triton")
    assert gpu.engine.info.weight_format == "float32"
    cpu = LLM(model=str(path), device="cpu", dtype="float32", quantization="none")
    got = [o.outputs[0].token_ids for o in gpu.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in cpu.generate(prompts, params)]
    with pytest.raises(ValueError, match="CPU only"):
        LLM(model=str(path), device="cuda", quantization="gguf")
