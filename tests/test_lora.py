"""LoRA adapters, offline: greedy tokens equal transformers + peft (not merged), alone and in batches mixing
adapters and the base; the prefix cache never serves one adapter's KV to another; more adapters than
--max-loras wait for a slot and finish; bad adapter directories are refused with a message."""
from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from tests.helpers import int16_inputs_only, make_checkpoint, random_prompts
from tests.lora_adapters import make_adapter, peft_greedy

pytest.importorskip("peft", reason="peft is a test dependency: pip install -e '.[test]'")

MAX_TOKENS = 10
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    llama, qwen3 = make_checkpoint(root, "llama"), make_checkpoint(root, "qwen3")
    mistral, qwen2 = make_checkpoint(root, "mistral"), make_checkpoint(root, "qwen2")
    return {
        "llama": llama, "qwen3": qwen3, "mistral": mistral, "qwen2": qwen2,
        "mistral-all": make_adapter(mistral, root / "mistral-all", ALL, rank=8, alpha=16, seed=6),
        "qwen2-qkvo": make_adapter(qwen2, root / "qwen2-qkvo", ["q_proj", "k_proj", "v_proj", "o_proj"], rank=8,
                                   alpha=16, seed=7),   # qwen2's q/k/v have biases: the adapter adds after them
        "llama-all": make_adapter(llama, root / "llama-all", ALL, rank=8, alpha=16, seed=1),
        "llama-qv": make_adapter(llama, root / "llama-qv", ["q_proj", "v_proj"], rank=4, alpha=8, seed=2),
        "llama-rslora": make_adapter(llama, root / "llama-rslora", ["o_proj", "down_proj", "k_proj"], rank=16,
                                     alpha=4, rslora=True, seed=3),
        "qwen3-all": make_adapter(qwen3, root / "qwen3-all", ALL, rank=8, alpha=32, seed=4),
        "qwen3-qv": make_adapter(qwen3, root / "qwen3-qv", ["q_proj", "v_proj"], rank=2, alpha=16, seed=5),
    }


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def lora(models, name: str, int_id: int) -> LoRARequest:
    return LoRARequest(name, int_id, str(models[name]))


def engine(path, **kw) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", block_size=4, enable_lora=True, max_lora_rank=16, **kw)


@pytest.mark.parametrize("adapter", ["llama-all", "llama-qv", "llama-rslora", "qwen3-all", "qwen3-qv", "mistral-all",
                                     "qwen2-qkvo"])
def test_adapter_matches_peft(models, adapter):
    base = models[adapter.split("-")[0]]
    prompts = random_prompts(1000, [5, 23], seed=len(adapter))
    llm = engine(base)
    outs = llm.generate(prompts, greedy(), lora_request=lora(models, adapter, 1))
    changed = 0
    for prompt, out in zip(prompts, outs):
        want = peft_greedy(base, models[adapter], prompt, MAX_TOKENS)
        assert out.outputs[0].token_ids == want
        changed += want != peft_greedy(base, None, prompt, MAX_TOKENS)
    assert changed     # the adapter does change the output


def test_mixed_batch_gives_each_request_its_own_tokens(models):
    """Two adapters and the base in the same steps (max_loras 2), with chunked prefill: each request's tokens
    are those it gets alone, and the base's are the base model's."""
    base = models["llama"]
    prompts = random_prompts(1000, [3, 17, 9, 30, 12, 6], seed=7)
    loras = [lora(models, "llama-all", 1), None, lora(models, "llama-qv", 2)] * 2
    llm = engine(base, max_loras=2, max_num_batched_tokens=24)
    graphs, run = llm.engine.runner.graphs, llm.engine.runner.graphs.run
    graphed: list[bool] = []      # decode steps through the graph runner's static buffers, with adapters or not

    def watched(input_ids, positions, meta, lora_slots=None):
        graphed.append(lora_slots is not None)
        return run(input_ids, positions, meta, lora_slots)

    graphs.run = watched
    outs = llm.generate(prompts, greedy(), lora_request=loras)
    assert any(graphed)       # adapters do not force eager decode steps
    for prompt, request, out in zip(prompts, loras, outs):
        adapter = None if request is None else models[request.lora_name]
        assert out.outputs[0].token_ids == peft_greedy(base, adapter, prompt, MAX_TOKENS)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_prefix_cache_is_keyed_by_adapter(models):
    """The same long prompt for the base, then an adapter, then the same adapter again: the adapter's first
    request finds none of the base's blocks and gets its true output; its second reuses its own blocks."""
    base = models["qwen3"]
    [prompt] = random_prompts(1000, [41], seed=11)
    llm = engine(base)
    bm = llm.engine.block_manager
    [first] = llm.generate([prompt], greedy())
    assert first.outputs[0].token_ids == peft_greedy(base, None, prompt, MAX_TOKENS)
    hits = bm.prefix_hits
    adapter = lora(models, "qwen3-all", 7)
    [second] = llm.generate([prompt], greedy(), lora_request=adapter)
    assert bm.prefix_hits == hits
    assert second.outputs[0].token_ids == peft_greedy(base, models["qwen3-all"], prompt, MAX_TOKENS)
    [third] = llm.generate([prompt], greedy(), lora_request=adapter)
    assert bm.prefix_hits > hits and third.outputs[0].token_ids == second.outputs[0].token_ids


def test_more_adapters_than_slots_wait_and_finish(models):
    """Three adapters, one slot: never two adapters in a step, and every request gets its adapter's tokens."""
    base = models["llama"]
    names = ["llama-all", "llama-qv", "llama-rslora"]
    prompts = random_prompts(1000, [8, 14, 5, 11, 20, 7], seed=13)
    loras = [lora(models, names[i % 3], i % 3 + 1) for i in range(len(prompts))]
    llm = engine(base, max_loras=1, max_cpu_loras=2)
    scheduler, schedule = llm.engine.scheduler, llm.engine.scheduler.schedule
    seen: list[set[int]] = []

    def watched():
        out = schedule()
        seen.append({s.seq.request.lora_id for s in out.scheduled})
        return out

    scheduler.schedule = watched
    outs = llm.generate(prompts, greedy(), lora_request=loras)
    assert all(len(ids) <= 1 for ids in seen) and len({i for ids in seen for i in ids}) == 3
    for prompt, request, out in zip(prompts, loras, outs):
        assert out.outputs[0].token_ids == peft_greedy(base, models[request.lora_name], prompt, MAX_TOKENS)
    assert len(llm.engine.lora.loaded) <= 2


def test_smollm2_adapters_match_peft(smollm2_file, tmp_path):
    """The real default model (its Q4_1 blocks computed as they are) with two adapters and the base in one
    batch, every input rounded to int16 (tests.helpers.int16_inputs_only): each request's tokens equal
    transformers + peft on the same file."""
    adapters = {"all": make_adapter(smollm2_file, tmp_path / "all", ALL, rank=16, alpha=32, seed=21),
                "qv": make_adapter(smollm2_file, tmp_path / "qv", ["q_proj", "v_proj"], rank=8, alpha=16, seed=22)}
    prompts = random_prompts(49152, [12, 30, 21], seed=23)
    loras = [LoRARequest("all", 1, str(adapters["all"])), LoRARequest("qv", 2, str(adapters["qv"])), None]
    llm = LLM(model=str(smollm2_file), device="cpu", dtype="float32", max_model_len=128, enable_lora=True,
              max_loras=2, max_lora_rank=16)
    int16_inputs_only(llm)
    outs = llm.generate(prompts, greedy(), lora_request=loras)
    for prompt, request, out in zip(prompts, loras, outs):
        adapter = None if request is None else adapters[request.lora_name]
        assert out.outputs[0].token_ids == peft_greedy(smollm2_file, adapter, prompt, MAX_TOKENS)


def test_lora_needs_enable_lora(models):
    llm = LLM(model=str(models["llama"]), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="--enable-lora"):
        llm.generate([[5, 6, 7]], greedy(), lora_request=lora(models, "llama-all", 1))


def _broken(tmp_path, models, name: str) -> str:
    """A copy of llama-all broken in one way."""
    import shutil
    src, dst = models["llama-all"], tmp_path / name
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    if name == "no-config":
        (dst / "adapter_config.json").unlink()
    elif name == "no-weights":
        (dst / "adapter_model.safetensors").unlink()
    elif name == "corrupt":
        data = (dst / "adapter_model.safetensors").read_bytes()
        (dst / "adapter_model.safetensors").write_bytes(data[:len(data) // 2])
    elif name == "dora":
        (dst / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    elif name == "wide":
        from safetensors.torch import load_file, save_file
        tensors = load_file(dst / "adapter_model.safetensors")
        key = next(k for k in tensors if "q_proj.lora_A" in k)
        tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 16)
        save_file(tensors, dst / "adapter_model.safetensors")
    elif name == "bad-json":
        (dst / "adapter_config.json").write_text("{not json")
    return str(dst)


@pytest.mark.parametrize("name,message", [
    ("missing", "does not exist"), ("no-config", "adapter_config.json is missing"),
    ("no-weights", "no adapter_model.safetensors"), ("corrupt", "cannot be read"), ("dora", "use_dora"),
    ("bad-json", "not valid JSON")])
def test_bad_adapter_directories_are_refused(models, tmp_path, name, message):
    llm = engine(models["llama"])
    path = str(tmp_path / "nowhere") if name == "missing" else _broken(tmp_path, models, name)
    with pytest.raises(ValueError, match=message):
        llm.generate([[5, 6, 7]], greedy(), lora_request=LoRARequest(name, 1, path))
    assert not llm.engine.has_unfinished_requests()
    [out] = llm.generate([[5, 6, 7]], greedy())      # the engine goes on
    assert len(out.outputs[0].token_ids) == MAX_TOKENS


def test_rank_above_max_and_foreign_modules_are_refused(models, tmp_path):
    llm = LLM(model=str(models["llama"]), device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="above --max-lora-rank 8"):
        llm.generate([[5, 6]], greedy(), lora_request=lora(models, "llama-rslora", 1))
    lm_head = make_adapter(models["llama"], tmp_path / "lm-head", ["lm_head"], rank=4)
    with pytest.raises(ValueError, match="lm_head.*are supported"):
        llm.generate([[5, 6]], greedy(), lora_request=LoRARequest("head", 2, str(lm_head)))
    wide = _broken(tmp_path, models, "wide")          # an adapter for a model with a wider hidden size
    with pytest.raises(ValueError, match=r"layer \d q_proj has A \[8, 80\].*needs A \[r, 64\]"):
        llm.generate([[5, 6]], greedy(), lora_request=LoRARequest("wide", 3, wide))


def test_two_tensor_parallel_ranks_match_one(models):
    """2 gloo ranks: each holds its slice of every adapter (B's rows of q/k/v/gate/up, A's columns of o/down);
    a batch mixing two adapters and the base, with chunked prefill, equals one rank's output."""
    base = models["qwen3"]
    prompts = random_prompts(1000, [3, 19, 9, 27], seed=17)
    loras = [lora(models, "qwen3-all", 1), None, lora(models, "qwen3-qv", 2), lora(models, "qwen3-all", 1)]
    want = [o.outputs[0].token_ids for o in engine(base, max_loras=2).generate(prompts, greedy(), lora_request=loras)]
    with LLM(model=str(base), device="cpu", dtype="float32", block_size=4, enable_lora=True, max_lora_rank=16,
             max_loras=1, max_num_batched_tokens=16, tensor_parallel_size=2) as llm:
        outs = llm.generate(prompts, greedy(), lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == want
