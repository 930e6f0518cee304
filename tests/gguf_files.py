"""Small GGUF files for tests, written with gguf.GGUFWriter the way llama.cpp's converter writes them.

`write_gguf` turns a tiny random Hugging Face checkpoint (engine.tiny_model) into a GGUF file: llama.cpp
metadata keys, the tokenizer as a gpt2-style vocabulary + merges, Q/K rows permuted for llama, and the
2-D weights quantized with gguf.quants. The K-quant types cannot be quantized by the Python package, so
`random_blocks` writes valid blocks of random bytes instead (finite, small scales).
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from engine.gguf_loader import _HF_NAMES

WRITABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# byte offsets of each K-quant block's float16 scales (d, and dmin where there is one)
_K_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
                    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,)}


def random_blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, bytes per row] of random blocks whose float16 scales are small positive numbers."""
    block, type_size = gguf.GGML_QUANT_SIZES[Q[qtype]]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // block, type_size), dtype=np.uint8)
    for off in _K_SCALE_OFFSETS[qtype]:
        scale = rng.uniform(2e-4, 1e-3, size=(rows, cols // block)).astype(np.float16)
        data[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (the inverse of the loader's)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_names(num_layers: int) -> dict[str, str]:
    names = {}
    for tensor, hf in _HF_NAMES.items():
        pattern = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[tensor]]
        for bid in range(num_layers) if "{bid}" in pattern else [None]:
            names[hf.format(bid=bid)] = pattern.format(bid=bid)
    return names


def _write_tokenizer(w: gguf.GGUFWriter, ckpt: Path, config: dict) -> None:
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = [""] * config["vocab_size"]
    for text, i in vocab.items():
        tokens[i] = text
    for i in range(len(vocab), len(tokens)):      # the padded tail of the embedding matrix
        tokens[i] = f"[PAD{i}]"
    special = {t["id"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(json.loads((ckpt / "tokenizer_config.json").read_text())["chat_template"])


def _write_metadata(w: gguf.GGUFWriter, c: dict) -> None:
    w.add_name("tiny test model")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_dimension_count(c["head_dim"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_vocab_size(c["vocab_size"])


def write_gguf(ckpt: Path, out: Path, arch: str, qtype: str = "F32", seed: int = 0) -> Path:
    """`ckpt` (an HF checkpoint of `arch`) as a GGUF file whose 2-D weights are stored as `qtype`."""
    config = json.loads((ckpt / "config.json").read_text())
    tensors = load_file(str(ckpt / "model.safetensors"))
    names = _gguf_names(config["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), arch)
    _write_metadata(w, config)
    _write_tokenizer(w, ckpt, config)
    for i, (hf_name, tensor) in enumerate(sorted(tensors.items())):
        base, _, suffix = hf_name.rpartition(".")
        values = tensor.float().numpy()
        if arch == "llama" and base.endswith((".q_proj", ".k_proj")):
            values = _permute(values, config["num_attention_heads"] if base.endswith(".q_proj")
                              else config["num_key_value_heads"])
        name = f"{names[base]}.{suffix}"
        if values.ndim == 1 or qtype == "F32":
            w.add_tensor(name, values)
        elif qtype in K_QUANTS:
            w.add_tensor(name, random_blocks(qtype, *values.shape, seed=seed + i), raw_dtype=Q[qtype])
        else:
            w.add_tensor(name, gguf.quants.quantize(values, Q[qtype]), raw_dtype=Q[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _arch_file(path: Path, arch: str) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


BAD_CASES = ("missing", "not-gguf", "truncated-data", "truncated-header", "arch", "quant")


def bad_gguf_files(root: Path, good: Path) -> dict[str, tuple[Path, str]]:
    """BAD_CASES -> (a file made from the good file `good`, a pattern its one-line error must match)."""
    data = good.read_bytes()
    (root / "notgguf.gguf").write_text("this is not a model\n")
    (root / "cut-data.gguf").write_bytes(data[: len(data) - 1000])
    (root / "cut-header.gguf").write_bytes(data[:200])
    iq = root / "iq2.gguf"
    w = gguf.GGUFWriter(str(iq), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 66), dtype=np.uint8), raw_dtype=Q.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {
        "missing": (root / "missing.gguf", "does not exist"),
        "not-gguf": (root / "notgguf.gguf", "is not a GGUF file"),
        "truncated-data": (root / "cut-data.gguf", "is truncated: tensor .* ends at byte"),
        "truncated-header": (root / "cut-header.gguf", "truncated or corrupt header.*supported architectures"),
        "arch": (_arch_file(root / "gpt2.gguf", "gpt2"), "'gpt2' model; supported architectures: llama"),
        "quant": (iq, "stored as IQ2_XXS, a type the quantized CPU path .* start with --quantization none"),
    }


def torch_dequantize(data: np.ndarray, qtype: str) -> torch.Tensor:
    """transformers' own (torch) dequantizer: an implementation independent of gguf.quants."""
    from transformers.integrations.gguf.dequant import dequantize
    return dequantize(torch.from_numpy(data), int(Q[qtype]))
