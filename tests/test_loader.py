"""Loading Hugging Face directories: sharded weights, generation defaults, and clear errors."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.loader import load
from engine.tiny_model import build_checkpoint
from tests.helpers import random_prompts

DEVICE = torch.device("cpu")


def _load(path):
    return load(path, torch.float32, DEVICE, max_position=64)


def test_sharded_and_single_file_give_the_same_model(tmp_path):
    single = build_checkpoint(tmp_path / "one", "qwen3", seed=3)
    sharded = build_checkpoint(tmp_path / "many", "qwen3", seed=3, max_shard_bytes=20_000)
    assert len(list(sharded.glob("*.safetensors"))) > 1 and (sharded / "model.safetensors.index.json").is_file()
    a, b = _load(single).model, _load(sharded).model
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name
    # fused q/k/v rows are the checkpoint's q, k, v stacked
    raw = load_file(str(single / "model.safetensors"))
    q, k = raw["model.layers.0.self_attn.q_proj.weight"], raw["model.layers.0.self_attn.k_proj.weight"]
    qkv = a.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(qkv[:q.shape[0]], q) and torch.equal(qkv[q.shape[0]:q.shape[0] + k.shape[0]], k)


def test_generation_config_supplies_eos_ids_and_defaults(tmp_path):
    path = build_checkpoint(tmp_path / "m", "llama", seed=4)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(temperature=0.6, top_p=0.9)
    (path / "generation_config.json").write_text(json.dumps(gen))
    loaded = _load(path)
    assert loaded.eos_token_ids == gen["eos_token_id"]
    assert loaded.generation_defaults == {"temperature": 0.6, "top_p": 0.9}


def test_eos_stops_generation_unless_ignored(tmp_path):
    path = build_checkpoint(tmp_path / "m", "llama", seed=4)
    llm = LLM(model=str(path), device="cpu", block_size=8)
    prompt = random_prompts(1000, [5], seed=1)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    eos = free.token_ids[2]
    llm.engine.eos_token_ids = [eos]   # make a token the model emits an eos
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert out.token_ids == free.token_ids[:free.token_ids.index(eos) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, min_tokens=6))[0].outputs[0]
    assert len(held.token_ids) == 6 and eos not in held.token_ids   # masked until min_tokens


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        _load(tmp_path / "nope")


def test_unsupported_architecture(tmp_path):
    path = build_checkpoint(tmp_path / "m", "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architectures.*GPT2LMHeadModel"):
        _load(path)


def _rewrite_weights(path, edit) -> None:
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f))


def test_missing_tensor_is_named(tmp_path):
    path = build_checkpoint(tmp_path / "m", "llama")
    _rewrite_weights(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="missing tensors.*layers.1.mlp.gate_up_proj"):
        _load(path)


def test_mismatched_tensor_shape_is_named(tmp_path):
    path = build_checkpoint(tmp_path / "m", "llama")

    def shrink(t):
        t["model.norm.weight"] = t["model.norm.weight"][:-1].clone()
    _rewrite_weights(path, shrink)
    with pytest.raises(ValueError, match="model.norm.weight.*does not match"):
        _load(path)


def test_unexpected_tensor_is_named(tmp_path):
    path = build_checkpoint(tmp_path / "m", "llama")

    def add(t):
        t["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    _rewrite_weights(path, add)
    with pytest.raises(ValueError, match="extra.weight.*no place"):
        _load(path)
