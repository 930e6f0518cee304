"""GGUF file (llama.cpp's format) -> model config, tokenizer and weights (dequantized, or kept as blocks).

The file is parsed by transformers' GGUF reader (metadata and tensor table, memory-mapped: ~0.02 s where
gguf.GGUFReader spends ~3 s walking every vocabulary string); only a file holding a tensor type that
reader cannot size (Q5_0, Q5_1: llama.cpp's K-quant fallback for rows not a multiple of 256) takes
gguf.GGUFReader's slower walk. transformers' config mapping table turns llama.cpp keys into config.json
keys, and the `gguf` package dequantizes each tensor. Weights come out under their Hugging Face names, so
engine.loader fuses and copies them exactly as it does for safetensors. Tensors the loader keeps quantized
(--quantization gguf) come out as QuantBlocks: their stored bytes, one row of blocks per output row.
"""
from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
# llama.cpp architecture -> our architecture. Mistral checkpoints are stored by llama.cpp as "llama".
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Tensor types we dequantize (each checked against transformers' reading of the same bytes in the tests).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def _dequantize_only_types() -> tuple[str, ...]:
    """Types only gguf's reference dequantizer reads (i-quants, ternary, fp4): read with --quantization none."""
    from gguf.quants import _type_traits
    return tuple(sorted(t.name for t in _type_traits if t.name not in SUPPORTED_TYPES))
# llama.cpp tensor name (gguf.TENSOR_NAMES) -> Hugging Face module name
_HF_NAMES = {
    "TOKEN_EMBD": "model.embed_tokens", "OUTPUT_NORM": "model.norm", "OUTPUT": "lm_head",
    "ATTN_NORM": "model.layers.{bid}.input_layernorm", "FFN_NORM": "model.layers.{bid}.post_attention_layernorm",
    "ATTN_Q": "model.layers.{bid}.self_attn.q_proj", "ATTN_K": "model.layers.{bid}.self_attn.k_proj",
    "ATTN_V": "model.layers.{bid}.self_attn.v_proj", "ATTN_OUT": "model.layers.{bid}.self_attn.o_proj",
    "ATTN_Q_NORM": "model.layers.{bid}.self_attn.q_norm", "ATTN_K_NORM": "model.layers.{bid}.self_attn.k_norm",
    "FFN_GATE": "model.layers.{bid}.mlp.gate_proj", "FFN_UP": "model.layers.{bid}.mlp.up_proj",
    "FFN_DOWN": "model.layers.{bid}.mlp.down_proj",
}
_PARSE_ERRORS = (ValueError, struct.error, IndexError, UnicodeDecodeError, OverflowError, KeyError)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]      # torch order
    qtype: object               # gguf.GGMLQuantizationType
    data: np.ndarray            # the stored bytes (memory-mapped), one row of bytes per output row


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict
    tensors: list[TensorEntry]

    @property
    def arch(self) -> str:
        return self.metadata["general.architecture"]


@dataclass(frozen=True)
class QuantBlocks:
    """A quantized tensor kept as its blocks: `blocks` is uint8 [rows, row_bytes] in memory (not the map)."""
    qtype: str
    blocks: torch.Tensor
    shape: tuple[int, int]      # the weight's [rows, columns]

    def narrow(self, dim: int, start: int, length: int) -> QuantBlocks:
        """Rows (dim 0), or columns (dim 1) at block boundaries: a tensor-parallel rank's part."""
        if dim == 0:
            return QuantBlocks(self.qtype, self.blocks[start:start + length], (length, self.shape[1]))
        per_block = self.blocks.shape[1] * 32 // self.shape[1]
        if start % 32 or length % 32:
            raise ValueError(f"{self.qtype} blocks of 32 cannot be split at column {start} (+{length}); "
                             f"use --quantization none with this --tensor-parallel-size.")
        part = self.blocks[:, start // 32 * per_block:(start + length) // 32 * per_block]
        return QuantBlocks(self.qtype, part, (self.shape[0], length))


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def _supported_line() -> str:
    return (f"supported architectures: {', '.join(ARCHITECTURES)} (mistral as llama); "
            f"supported tensor types: {', '.join(SUPPORTED_TYPES)}")


def _fast_tensor_table(path: Path) -> list[TensorEntry] | None:
    """transformers' tensor table, or None for a file holding a type it cannot size."""
    from gguf import GGMLQuantizationType
    from transformers.integrations.gguf import GgufHeader

    try:
        header = GgufHeader.from_file(str(path))
    except ValueError as exc:
        if "not supported" in str(exc):
            return None
        raise
    size = path.stat().st_size
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    entries = []
    for info in header.tensors:
        start = header.data_start + info.offset
        if start + info.nbytes > size:
            raise ValueError(f"{str(path)!r} is truncated: tensor {info.name} ends at byte "
                             f"{start + info.nbytes} but the file has {size} bytes.")
        data = blob[start:start + info.nbytes].reshape(*info.shape[:-1], -1)
        entries.append(TensorEntry(info.name, info.shape, GGMLQuantizationType(info.ggml_type), data))
    return entries


def _gguf_reader_tensor_table(path: Path) -> list[TensorEntry]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except ValueError as exc:    # a truncated data section fails its reshape here
        raise ValueError(f"{str(path)!r} is truncated or corrupt ({exc}).") from None
    return [TensorEntry(t.name, tuple(reversed(t.shape.tolist())), t.tensor_type,
                        t.data.view(np.uint8).reshape(*reversed(t.shape[1:].tolist()), -1)) for t in reader.tensors]


def open_gguf(path: str | Path, dequantize_any: bool = False) -> GGUFFile:
    """Reads and checks the metadata and tensor table; raises ValueError naming the problem.
    dequantize_any: also accept the types only gguf's reference dequantizer reads (--quantization none)."""
    from transformers.integrations.gguf import read_gguf_metadata

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist.")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{str(path)!r} is not a GGUF file (it does not start with the bytes 'GGUF').")
    try:
        metadata, _ = read_gguf_metadata(str(path))
        tensors = _fast_tensor_table(path)
        if tensors is None:
            tensors = _gguf_reader_tensor_table(path)
    except _PARSE_ERRORS as exc:
        if "truncated" in str(exc):
            raise
        raise ValueError(f"{str(path)!r} is not a readable GGUF file (truncated or corrupt header: {exc}); "
                         f"{_supported_line()}.") from None
    file = GGUFFile(path, metadata, tensors)
    if file.arch not in ARCHITECTURES:
        raise ValueError(f"{str(path)!r} holds a {file.arch!r} model; {_supported_line()}.")
    dequantize_only = _dequantize_only_types()
    for entry in tensors:
        qtype = entry.qtype.name
        if qtype in dequantize_only and not dequantize_any:
            raise ValueError(f"{str(path)!r}: tensor {entry.name} is stored as {qtype}, a type the quantized CPU "
                             f"path (--quantization gguf, the default for a .gguf file) does not compute with; "
                             f"start with --quantization none to dequantize it into --dtype at load.")
        if qtype not in SUPPORTED_TYPES and qtype not in dequantize_only:
            raise ValueError(f"{str(path)!r}: tensor {entry.name} is stored as {qtype}; {_supported_line()}.")
    return file


def hf_config(file: GGUFFile) -> dict:
    """config.json contents, through transformers' table of llama.cpp keys (its load_gguf_checkpoint does
    the same walk, but only after parsing every vocabulary string: seconds instead of milliseconds)."""
    # The table load_gguf_checkpoint uses, from the module that holds it (transformers.modeling_gguf_pytorch_utils
    # would also import its modeling code: ~2 s of CPU at startup).
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING as mapping

    config: dict = {}
    for key, value in file.metadata.items():
        prefix, _, rest = key.partition(".")
        target = mapping.get(prefix, {}).get(rest)
        if target is not None and target != -1:
            config[target] = value
    names = {entry.name for entry in file.tensors}
    arch = file.arch
    config["model_type"] = arch
    config["architectures"] = [ARCHITECTURES[arch]]
    config["tie_word_embeddings"] = "output.weight" not in names
    config.setdefault("vocab_size", file.metadata.get("tokenizer.ggml.tokens"))  # the reader gives its length
    # Qwen3's head_dim is not hidden_size / heads; llama.cpp stores it as the key length.
    key_length = file.metadata.get(f"{arch}.attention.key_length")
    if key_length:
        config["head_dim"] = key_length
    if arch == "qwen2":
        config["attention_bias"] = True
    extra_eos = [file.metadata[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                 if k in file.metadata]
    if extra_eos:   # llama.cpp ends generation on these too (Llama 3's <|eot_id|>)
        config["eos_token_id"] = [e for e in dict.fromkeys([config.get("eos_token_id"), *extra_eos]) if e is not None]
    return config


def load_tokenizer(path: Path):
    """The file's tokenizer (vocabulary, merges, special tokens, chat template, BOS/EOS) via transformers."""
    from transformers import PreTrainedTokenizerFast

    # PreTrainedTokenizerFast directly: AutoTokenizer would first rebuild the whole config the slow way.
    return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)


def _hf_names(num_layers: int) -> dict[str, str]:
    from gguf import MODEL_TENSOR, TENSOR_NAMES

    names = {}
    for tensor, hf in _HF_NAMES.items():
        pattern = TENSOR_NAMES[MODEL_TENSOR[tensor]]
        for bid in range(num_layers) if "{bid}" in pattern else [None]:
            names[pattern.format(bid=bid)] = hf.format(bid=bid)
    return names


def _unpermute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order (it interleaves the two rotary halves of each head for its rope)."""
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _dequantize(entry: TensorEntry) -> torch.Tensor:
    from gguf.quants import dequantize

    values = dequantize(entry.data, entry.qtype)
    if not values.flags.writeable:      # F32 comes back as a view of the read-only map
        values = values.copy()
    return torch.from_numpy(values).reshape(entry.shape)


def hf_name(entry: TensorEntry, names: dict[str, str], arch: str) -> str:
    base, _, suffix = entry.name.rpartition(".")
    if base not in names:
        raise ValueError(f"GGUF tensor {entry.name!r} has no place in a {arch} model "
                         f"(rope frequency tables, vision towers and MoE experts are not supported).")
    return f"{names[base]}.{suffix}"


def hf_types(file: GGUFFile, num_layers: int) -> dict[str, str]:
    """Hugging Face name -> stored type name, for every tensor of the file."""
    names = _hf_names(num_layers)
    return {hf_name(entry, names, file.arch): entry.qtype.name for entry in file.tensors}


def _stored_rows(entry: TensorEntry) -> torch.Tensor:
    """The stored bytes as uint8 [rows, row_bytes], copied out of the map."""
    return torch.from_numpy(np.array(entry.data, dtype=np.uint8).reshape(entry.shape[0], -1))


def named_tensors(file: GGUFFile, num_heads: int, num_kv_heads: int, num_layers: int,
                  keep: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor | QuantBlocks]]:
    """(Hugging Face name, float32 tensor) for every tensor of the file, dequantized one at a time; the
    Hugging Face names in `keep` come as QuantBlocks instead."""
    names = _hf_names(num_layers)
    permute = file.arch == "llama"      # llama.cpp's converter permutes Q/K for llama only
    for entry in tqdm(file.tensors, desc="Reading GGUF", unit="tensor", leave=False):
        name = hf_name(entry, names, file.arch)
        base = entry.name.rpartition(".")[0]
        kept = name in keep
        tensor = _stored_rows(entry) if kept else _dequantize(entry)
        if permute and base.endswith((".attn_q", ".attn_k")):
            # rows of blocks permute as rows of floats do
            tensor = _unpermute(tensor, num_heads if base.endswith(".attn_q") else num_kv_heads)
        yield name, QuantBlocks(entry.qtype.name, tensor, (entry.shape[0], entry.shape[1])) if kept else tensor
