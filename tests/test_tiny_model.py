"""Random-weight checkpoints load in transformers, are deterministic, and are not degenerate."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine import tiny_model
from engine.default_model import resolve_model
from engine.tiny_model import ARCHS, SHAPES, build_checkpoint, ensure_tiny_random, make_config, weight_shapes


def load_all(path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def greedy(model, tok, prompt: str, n: int = 12) -> list[int]:
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_arch_builds_and_loads_in_transformers(tmp_path, arch):
    path = build_checkpoint(tmp_path / arch, arch, seed=1)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert type(model).__name__ == ARCHS[arch][0]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # Every stored tensor is the one transformers uses.
    params = dict(model.named_parameters())
    for name, t in load_all(path).items():
        assert torch.equal(params[name].detach(), t), name
    tok = AutoTokenizer.from_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] >= len(tok) and config["vocab_size"] % 64 == 0
    eos = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    assert tok.eos_token_id in eos and tok.convert_tokens_to_ids("<|im_end|>") in eos
    # Not degenerate: different prompts continue differently, and not as one repeated token.
    outs = [greedy(model, tok, p) for p in ("The lighthouse keeper", "def fibonacci(n):", "你好，世界")]
    assert len({tuple(o) for o in outs}) == 3
    assert all(len(set(o)) > 3 for o in outs)


def test_chat_template_renders(tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model.ensure_tokenizer())
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok(text).input_ids
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3   # special tokens stay whole
    assert tok.decode(ids, skip_special_tokens=True) == "system\nBe brief.\nuser\nHi!\nassistant\n"


def test_sharded_checkpoint_has_valid_index(tmp_path):
    path = build_checkpoint(tmp_path / "sharded", "qwen2", max_shard_bytes=40_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
    tensors = {}
    for f in files:
        shard = load_file(path / f)
        assert all(index["weight_map"][n] == f for n in shard)
        big = max(t.numel() * t.element_size() for t in shard.values())
        assert sum(t.numel() * t.element_size() for t in shard.values()) <= max(40_000, big)
        tensors.update(shard)
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    unsharded = load_all(build_checkpoint(tmp_path / "single", "qwen2"))
    assert tensors.keys() == unsharded.keys() and all(torch.equal(tensors[k], unsharded[k]) for k in tensors)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_building_is_deterministic_in_seed(tmp_path):
    a = load_all(build_checkpoint(tmp_path / "a", "qwen3", seed=3, dtype="bfloat16"))
    b = load_all(build_checkpoint(tmp_path / "b", "qwen3", seed=3, dtype="bfloat16"))
    c = load_all(build_checkpoint(tmp_path / "c", "qwen3", seed=4, dtype="bfloat16"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(t.dtype == torch.bfloat16 for t in a.values())
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_tokenizer_training_is_deterministic(tmp_path):
    (tmp_path / "x").mkdir()
    tiny_model._train_tokenizer(tmp_path / "x")
    cached = tiny_model.ensure_tokenizer()
    assert (tmp_path / "x" / "tokenizer.json").read_text() == (cached / "tokenizer.json").read_text()
    assert 1000 <= tiny_model._tokenizer_vocab_size(cached) <= 2000


def test_overrides(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128}
    path = build_checkpoint(tmp_path / "o", "llama", tie_word_embeddings=True, rope_scaling=rope,
                            num_key_value_heads=1, head_dim=8, vocab_size=2048)
    tensors = load_all(path)
    assert "lm_head.weight" not in tensors                       # tied: stored once, as HF does
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (8, 64)
    assert tensors["model.embed_tokens.weight"].shape == (2048, 64)
    config = AutoConfig.from_pretrained(path)
    assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["factor"] == 8.0
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        build_checkpoint(tmp_path / "bad", "llama", num_key_value_heads=3)
    with pytest.raises(ValueError, match="unknown arch"):
        build_checkpoint(tmp_path / "bad", "gpt2")
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        build_checkpoint(tmp_path / "bad", "llama", vocab_size=100)


@pytest.mark.parametrize("name,billions", [("qwen3-0.6b", 0.596), ("llama-3.2-1b", 1.236)])
def test_real_shapes_match_published_sizes(name, billions):
    shape = dict(SHAPES[name])
    arch, vocab = shape.pop("arch"), shape.pop("vocab_size")
    shapes = weight_shapes(make_config(arch, vocab, 0, "bfloat16", **shape))
    count = sum(torch.Size(s).numel() for s in shapes.values())
    assert abs(count / 1e9 - billions) < 0.001
    assert "lm_head.weight" not in shapes                        # both are tied


def test_tiny_random_is_built_once_and_resolved(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    path = ensure_tiny_random()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_random() == path and (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert resolve_model("tiny-random") == path
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")] == []  # no temp left
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 4
    assert resolve_model(str(path)) == path
    with pytest.raises(ValueError, match="tiny-random"):
        resolve_model(tmp_path / "missing")
