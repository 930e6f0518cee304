"""Random-weight Hugging Face checkpoints with a real (tiny, locally trained) tokenizer.

No weights can be downloaded, so tests, demos and benchmarks build their own checkpoints: a byte-level
BPE tokenizer trained once on engine/data/corpus.txt, plus random weights whose names and shapes are
exactly those of transformers' model of the chosen architecture. Everything is deterministic in `seed`.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

TINY_RANDOM = "tiny-random"
_RECIPE_VERSION = "1"          # bump when the recipe changes: cached builds are keyed by it
_DATA_DIR = Path(__file__).parent / "data"
_CORPUS = _DATA_DIR / "corpus.txt"
_TOKENIZER_VOCAB = 1500
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
EOS_TOKEN, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]   # ids 0, 1, 2
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# ChatML; content may be a string or a list of OpenAI content parts (only text parts render). Tools render
# in a system turn and tool calls as <tool_call> JSON, as in Qwen2.5's (hermes) template.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n# Tools\n<tools>\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '</tools>\nCall a function as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] | tojson }}{{ '}</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# arch -> (HF architecture class, model_type, arch-specific config.json keys)
ARCHS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaForCausalLM", "llama",
              {"attention_bias": False, "mlp_bias": False, "rope_scaling": None, "pretraining_tp": 1}),
    "mistral": ("MistralForCausalLM", "mistral", {"sliding_window": None}),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", {"use_sliding_window": False, "sliding_window": None}),
    "qwen3": ("Qwen3ForCausalLM", "qwen3",
              {"attention_bias": False, "use_sliding_window": False, "sliding_window": None}),
}

TINY_DEFAULTS = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, intermediate_size=128, max_position_embeddings=512)

# Real model shapes, for benchmarks on random weights (write them in bf16 with max_shard_bytes set).
SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(arch="qwen3", num_hidden_layers=28, hidden_size=1024, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                       tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1000000.0),
    "llama-3.2-1b": dict(arch="llama", num_hidden_layers=16, hidden_size=2048, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                         tie_word_embeddings=True, max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}

# The built-in default model: a Llama a bit bigger than the test defaults.
TINY_RANDOM_CONFIG = dict(num_hidden_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=32, intermediate_size=256, max_position_embeddings=1024)


def cache_dir() -> Path:
    """$PAGEDSERVE_CACHE, else ~/.cache/pagedserve."""
    root = os.environ.get("PAGEDSERVE_CACHE") or os.path.join(Path.home(), ".cache", "pagedserve")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """Build into a temp dir beside `final`, then rename: readers never see a half-written directory,
    and two processes racing both end up using one complete copy."""
    if final.is_dir():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------------------- tokenizer
def _train_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # The full byte alphabet as the initial vocabulary: any text (and any byte) stays encodable.
    trainer = trainers.BpeTrainer(vocab_size=_TOKENIZER_VOCAB, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS.read_text(encoding="utf-8").splitlines(keepends=True), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 131072,
        "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "bos_token": None, "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END], "add_bos_token": False,
        # Cleanup would make streamed (windowed) and one-shot decoding disagree.
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def ensure_tokenizer() -> Path:
    """The trained tokenizer's directory (HF format), trained on first use and cached."""
    key = _digest(_RECIPE_VERSION, _TOKENIZER_VOCAB, CHAT_TEMPLATE, _CORPUS.read_bytes().hex())
    return _build_once(cache_dir() / f"tokenizer-{key}", _train_tokenizer)


def _tokenizer_vocab_size(tok_dir: Path) -> int:
    model = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    ids = list(model["model"]["vocab"].values()) + [t["id"] for t in model["added_tokens"]]
    return max(ids) + 1


# ----------------------------------------------------------------------------------------- checkpoint
def make_config(arch: str, vocab_size: int, eos_token_id: int, dtype: str, **overrides: object) -> dict:
    """config.json contents, in the (legacy) key layout real Hub checkpoints use: rope_theta/rope_scaling."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}.")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}.")
    cls, model_type, extra = ARCHS[arch]
    config = {"architectures": [cls], "model_type": model_type, "vocab_size": vocab_size, **TINY_DEFAULTS,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
              "bos_token_id": eos_token_id, "eos_token_id": eos_token_id, "torch_dtype": dtype,
              "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, **extra}
    config.update(overrides)
    if model_type in ("qwen2", "qwen3"):
        config.setdefault("max_window_layers", config["num_hidden_layers"])
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads}).")
    return config


def weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of transformers' model for `config` (built on the meta device, so
    this costs no memory even for real model sizes). Tied lm_head weights are left out, as HF does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    # named_parameters() yields a shared (tied) parameter once, under its first name.
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _stable_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def init_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """One weight, a function of (seed, name, shape) only: sharding or order never changes values.

    Scales keep every layer's contribution comparable to the embedding in the residual stream (unit-gain
    linears instead of std 0.02), so attention, not just the last token, decides the next token and
    different prompts give different greedy continuations. Norm weights and biases are random (not
    1 and 0) so that a loader that forgets to load them produces different tokens."""
    gen = torch.Generator().manual_seed(_stable_seed(seed, name))
    values = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        values = 1.0 + 0.2 * values
    elif name.endswith(".bias"):
        values *= 0.2
    elif "embed_tokens" in name:
        values *= 0.5
    elif name == "lm_head.weight":
        values *= 3.0 / shape[-1] ** 0.5
    else:
        values *= shape[-1] ** -0.5
    return values.to(dtype)


def _plan_shards(shapes: dict[str, tuple[int, ...]], itemsize: int,
                 max_shard_bytes: int | None) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = itemsize * int(torch.Size(shape).numel())
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_weights(out: Path, shapes: dict[str, tuple[int, ...]], seed: int, dtype: torch.dtype,
                   max_shard_bytes: int | None) -> None:
    from safetensors.torch import save_file

    shards = _plan_shards(shapes, dtype.itemsize, max_shard_bytes)
    if max_shard_bytes is None:
        names = {"model.safetensors": shards[0]}
    else:
        names = {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": s for i, s in enumerate(shards)}
    total = 0
    for fname, shard in names.items():     # one shard in memory at a time
        # Each tensor has its own generator, so filling them on threads (torch releases the GIL) keeps
        # the values deterministic and makes real-size checkpoints several times faster to write.
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            tensors = dict(zip(shard, pool.map(lambda n: init_tensor(n, shapes[n], seed, dtype), shard)))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
    if max_shard_bytes is not None:
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: fname for fname, shard in names.items() for n in shard}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def build_checkpoint(out_dir: str | os.PathLike, arch: str, *, seed: int = 0, dtype: str = "float32",
                     max_shard_bytes: int | None = None, **config_overrides: object) -> Path:
    """Write a random-weight HF checkpoint of `arch` (llama, mistral, qwen2, qwen3) into out_dir.

    Defaults are tiny (TINY_DEFAULTS); any config.json key can be overridden. Real shapes:
    build_checkpoint(d, dtype="bfloat16", max_shard_bytes=2**30, **SHAPES["llama-3.2-1b"])."""
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}.")
    tok_dir = ensure_tokenizer()
    tok_vocab = _tokenizer_vocab_size(tok_dir)
    vocab = int(config_overrides.pop("vocab_size", -(-tok_vocab // 64) * 64))   # round up to 64
    if vocab < tok_vocab:
        raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer's {tok_vocab} tokens.")
    eos_id, im_end_id = SPECIAL_TOKENS.index(EOS_TOKEN), SPECIAL_TOKENS.index(IM_END)
    config = make_config(arch, vocab, eos_id, dtype, **config_overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_weights(out, weight_shapes(config), seed, _DTYPES[dtype], max_shard_bytes)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": eos_id, "eos_token_id": [eos_id, im_end_id]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    for fname in _TOKENIZER_FILES:
        shutil.copyfile(tok_dir / fname, out / fname)
    return out


def ensure_tiny_random() -> Path:
    """The built-in "tiny-random" Llama checkpoint, built once into the cache dir and reused."""
    key = _digest(_RECIPE_VERSION, TINY_RANDOM_CONFIG, ensure_tokenizer().name)
    final = cache_dir() / f"{TINY_RANDOM}-{key}"
    return _build_once(final, lambda tmp: build_checkpoint(tmp, "llama", seed=0, **TINY_RANDOM_CONFIG))

