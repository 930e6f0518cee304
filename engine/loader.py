"""Hugging Face checkpoint directory or .gguf file -> our model, tokenizer and generation defaults.

Weights are read tensor by tensor from (possibly sharded) safetensors, or dequantized tensor by tensor
from a GGUF file (engine.gguf_loader), and copied straight into our modules under their Hugging Face
names; q/k/v and gate/up are fused on the way in. No transformers model object is ever built. With
--quantization gguf (the default for a .gguf file on CPU) the linear layers and the embedding table whose
tensors are in a format the CPU kernel computes with keep their blocks instead (engine/layers/quantized.py);
--quantization q8_0 / q4_0 quantizes a float checkpoint's into blocks at load (engine/quantize.py).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from engine import gguf_loader
from engine.config import QUANTIZATION_CHOICES
from engine.distributed import parallel_state
from engine.layers.linear import LinearBase, VocabParallelEmbedding
from engine.layers.quantized import QuantizedWeight, QuantSegment
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

# HF name fragment -> (our fused parameter fragment, shard id)
_FUSED = {
    ".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: object
    generation_defaults: dict
    eos_token_ids: list[int]


def read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def load_model_config(model_dir: Path, quantization: str = "none") -> ModelConfig:
    """The model's config; quantization (resolved) decides which GGUF tensor types are readable."""
    if gguf_loader.is_gguf(model_dir):
        config = gguf_loader.hf_config(gguf_loader.open_gguf(model_dir, dequantize_any=quantization == "none"))
        try:
            return ModelConfig.from_hf(config)
        except KeyError as exc:
            raise ValueError(f"{str(model_dir)!r} lacks the metadata that gives {exc.args[0]}; is it a complete "
                             f"llama.cpp model file?") from None
    if not model_dir.is_dir():
        raise ValueError(f"model directory {str(model_dir)!r} does not exist.")
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{str(model_dir)!r} has no config.json; is it a Hugging Face model directory?")
    return ModelConfig.from_hf(read_json(model_dir / "config.json"))


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(read_json(index)["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise ValueError(f"no safetensors weights found in {str(model_dir)!r} (missing: {missing or '*.safetensors'}).")
    return files


def checkpoint_target(name: str) -> tuple[str, object]:
    name = name.removeprefix("model.")
    for frag, (fused, shard) in _FUSED.items():
        if frag in name:
            return name.replace(frag, fused), shard
    return name, None


@dataclass(frozen=True)
class RankPart:
    """This rank's part of a checkpoint tensor: `length` entries from `start` along `dim` (whose full size is
    `full`), copied to rows `row`.. of our (fused, per-rank) parameter; start None: the whole tensor."""
    dim: int = 0
    start: int | None = None
    length: int = 0
    full: int = 0
    row: int = 0


def rank_part(target: str, shard: object, cfg: ModelConfig, rank: int, tp: int) -> RankPart:
    """Column-parallel weights (q/k/v, gate/up, vocabulary rows) split dim 0, row-parallel ones dim 1."""
    hd = cfg.head_dim
    if shard in ("q", "k", "v"):
        local = parallel_state.shard_config(cfg, tp)
        q, kv = local.num_heads * hd, local.num_kv_heads * hd
        if shard == "q":
            return RankPart(0, rank * q, q, cfg.num_heads * hd, 0)
        start = parallel_state.kv_head_start(cfg.num_kv_heads, rank, tp) * hd
        return RankPart(0, start, kv, cfg.num_kv_heads * hd, q if shard == "k" else q + kv)
    if shard is not None:   # gate (0) / up (1)
        width = cfg.intermediate_size // tp
        return RankPart(0, rank * width, width, cfg.intermediate_size, shard * width)
    if tp == 1:
        return RankPart()
    if target.endswith("o_proj.weight"):
        width = cfg.num_heads * hd // tp
        return RankPart(1, rank * width, width, cfg.num_heads * hd)
    if target.endswith("down_proj.weight"):
        width = cfg.intermediate_size // tp
        return RankPart(1, rank * width, width, cfg.intermediate_size)
    if target in ("embed_tokens.weight", "lm_head.weight"):
        rows = parallel_state.padded_vocab(cfg.vocab_size, tp)
        return RankPart(0, rank * rows, max(0, min(rows, cfg.vocab_size - rank * rows)), cfg.vocab_size)
    return RankPart()              # replicated (norms)


def _read(source, part: RankPart) -> torch.Tensor:
    """The part of a torch tensor, quantized blocks or a safetensors slice (read lazily: only this part leaves
    the file)."""
    if part.start is None:
        return source if isinstance(source, (torch.Tensor, gguf_loader.QuantBlocks)) else source[:]
    shape = tuple(source.shape) if isinstance(source, (torch.Tensor, gguf_loader.QuantBlocks)) else \
        tuple(source.get_shape())
    if len(shape) <= part.dim or shape[part.dim] != part.full:
        raise ValueError(f"tensor shape {shape} does not match the model's (dimension {part.dim} should be "
                         f"{part.full}).")
    end = part.start + part.length
    if isinstance(source, gguf_loader.QuantBlocks):
        return source.narrow(part.dim, part.start, part.length)
    if isinstance(source, torch.Tensor):
        return source.narrow(part.dim, part.start, part.length)
    return source[part.start:end] if part.dim == 0 else source[:, part.start:end]


def _copy_shard(param: torch.Tensor, source, target: str, shard: object, cfg: ModelConfig) -> None:
    part = rank_part(target, shard, cfg, parallel_state.tp_rank(), parallel_state.tp_world_size())
    tensor = _read(source, part)
    dst = param.data
    if part.start is not None and part.dim == 0:
        if part.length < param.shape[0] and shard is None:
            dst.zero_()              # the vocabulary padding rows of the last rank stay 0
        dst = dst[part.row:part.row + part.length]
    if dst.shape != tensor.shape:
        raise ValueError(f"tensor shape {tuple(tensor.shape)} does not match the model's {tuple(dst.shape)}.")
    dst.copy_(tensor)


def safetensors_tensors(files: list[Path]) -> Iterator[tuple[str, object]]:
    """(name, safetensors slice) pairs: nothing is read until _copy_shard takes this rank's part."""
    show = sum(f.stat().st_size for f in files) > 1 << 30
    for path in tqdm(files, desc="Loading safetensors", disable=not show, unit="file"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if not name.endswith(_IGNORED_SUFFIXES):
                    yield name, f.get_slice(name)


def load_tensors(model: LlamaForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copies (Hugging Face name, tensor) pairs into the model, fusing q/k/v and gate/up on the way."""
    params = dict(model.named_parameters())
    expected_parts: dict[str, int] = {n: (3 if "qkv_proj.weight" in n or "qkv_proj.bias" in n else
                                          2 if "gate_up_proj" in n else 1) for n in params}
    seen: dict[str, int] = {}
    blocks: dict[str, list[tuple[int, gguf_loader.QuantBlocks]]] = {}   # target -> (first row, this rank's part)
    for name, tensor in tensors:
        target, shard = checkpoint_target(name)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model.")
        try:
            if isinstance(tensor, gguf_loader.QuantBlocks):
                part = rank_part(target, shard, model.full_config, parallel_state.tp_rank(),
                             parallel_state.tp_world_size())
                blocks.setdefault(target, []).append((part.row, _read(tensor, part)))
            else:
                _copy_shard(params[target], tensor, target, shard, model.full_config)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
        seen[target] = seen.get(target, 0) + 1
    for target, parts in blocks.items():
        _set_quantized(model, target, parts)
    if model.config.tie_word_embeddings and "lm_head.weight" not in seen:
        if model.embed_tokens.qweight is not None:
            model.lm_head.set_quantized(model.embed_tokens.qweight)
        else:
            model.lm_head.weight = model.embed_tokens.weight
        seen["lm_head.weight"] = 1
    missing = [n for n, parts in expected_parts.items() if seen.get(n, 0) < parts]
    if missing:
        raise ValueError(f"checkpoint is missing tensors for: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def _set_quantized(model: LlamaForCausalLM, target: str, parts: list[tuple[int, gguf_loader.QuantBlocks]]) -> None:
    """One layer's weight from its checkpoint tensors' blocks, in row order (q, k, v; gate, up)."""
    module = model.get_submodule(target.rpartition(".")[0])
    rows, cols = module.weight.shape
    segments = [QuantSegment(p.qtype, p.blocks) for _, p in sorted(parts, key=lambda rp: rp[0])]
    have = sum(s.blocks.shape[0] for s in segments)
    if have < rows:     # the vocabulary padding rows of the last rank: zero blocks (scale 0) are zero weights
        last = segments[-1]
        segments.append(QuantSegment(last.qtype, torch.zeros(rows - have, last.blocks.shape[1], dtype=torch.uint8)))
    module.set_quantized(QuantizedWeight(segments, cols))


def kept_quantized(file: gguf_loader.GGUFFile, model: LlamaForCausalLM) -> frozenset[str]:
    """Hugging Face names of the tensors that stay blocks: every part of a linear layer's or the embedding's
    weight in a format the CPU kernel computes with. The rest is dequantized at load (float stays float)."""
    from engine.cpu_kernels import QUANT_FORMATS  # kernels/ only when asked for (engine/layers/quantized.py)

    types = gguf_loader.hf_types(file, model.config.num_layers)
    groups: dict[str, list[str]] = {}
    for name in types:
        groups.setdefault(checkpoint_target(name)[0], []).append(name)
    keep: set[str] = set()
    for target, names in groups.items():
        module = model.get_submodule(target.rpartition(".")[0]) if target.endswith(".weight") else None
        if isinstance(module, (LinearBase, VocabParallelEmbedding)) and all(types[n] in QUANT_FORMATS for n in names):
            keep.update(names)
    inflated = sorted({types[n] for n in types if n not in keep and types[n] not in _FLOAT_TYPES})
    if inflated:
        log.info("GGUF tensors of type %s are dequantized at load (the CPU kernel computes with %s)",
                 ", ".join(inflated), ", ".join(QUANT_FORMATS))
    return frozenset(keep)


def resolve_quantization(quantization: str, path: Path, device: torch.device) -> str:
    """'gguf', 'none', 'q8_0' or 'q4_0' for this model and device ('auto': gguf for a .gguf file on CPU)."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}.")
    is_gguf = gguf_loader.is_gguf(path)
    if quantization == "auto":
        return "gguf" if is_gguf and device.type == "cpu" else "none"
    if quantization == "gguf" and not is_gguf:
        raise ValueError(f"--quantization gguf needs a .gguf model file; {str(path)!r} is not one "
                         f"(use --quantization none).")
    if quantization == "gguf" and device.type != "cpu":
        raise ValueError("--quantization gguf computes with the blocks on CPU only; on CUDA a GGUF file is "
                         "dequantized into --dtype at load (use --quantization none or auto).")
    if quantization in ("q8_0", "q4_0") and is_gguf:
        raise ValueError(f"--quantization {quantization} quantizes a float checkpoint at load; a .gguf file keeps "
                         f"its own blocks (use --quantization gguf, or none to dequantize it).")
    if quantization in ("q8_0", "q4_0") and device.type != "cpu":
        raise ValueError(f"--quantization {quantization} computes with blocks on CPU only (use none on CUDA).")
    return quantization


def load_weights(model: LlamaForCausalLM, files: list[Path]) -> None:
    load_tensors(model, safetensors_tensors(files))


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


def generation_defaults(model_dir: Path) -> tuple[dict, list[int]]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}, []
    gen = read_json(path)
    eos = gen.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return {k: gen[k] for k in _SAMPLING_KEYS if gen.get(k) is not None}, eos_ids


def _empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_position: int
                 ) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_position)
    # Module.to_empty() calls empty_like on meta tensors, whose Python reference imports sympy: seconds of
    # startup on a small CPU. torch.empty with a shape does the same job without it.
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            setattr(module, name, nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device)))
        for name, buf in module.named_buffers(recurse=False):
            module.register_buffer(name, torch.empty(buf.shape, dtype=buf.dtype, device=device))
    return model


def _finish(model: LlamaForCausalLM, device: torch.device) -> None:
    model.init_rotary(device)
    model.eval().requires_grad_(False)


def _eos_ids(gen_eos: list[int], cfg: ModelConfig, tokenizer) -> list[int]:
    return list(dict.fromkeys([*gen_eos, *cfg.eos_token_ids]
                              or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])))


def load_gguf(path: Path, dtype: torch.dtype, device: torch.device, max_position: int,
              quantization: str = "none") -> LoadedModel:
    """A .gguf file: config, tokenizer and weights (dequantized into `dtype`, or kept as blocks with
    quantization 'gguf') all come from it."""
    file = gguf_loader.open_gguf(path, dequantize_any=quantization == "none")
    cfg = ModelConfig.from_hf(gguf_loader.hf_config(file))
    model = _empty_model(cfg, dtype, device, max_position)
    keep = kept_quantized(file, model) if quantization == "gguf" else frozenset()
    load_tensors(model, gguf_loader.named_tensors(file, cfg.num_heads, cfg.num_kv_heads, cfg.num_layers, keep))
    _finish(model, device)
    tokenizer = gguf_loader.load_tokenizer(path)
    log.info("loaded %s (%s, %d layers) in %s on %s", path, cfg.architecture, cfg.num_layers, dtype, device)
    return LoadedModel(model, cfg, tokenizer, {}, _eos_ids([], cfg, tokenizer))


def load(model_dir: str | Path, dtype: torch.dtype, device: torch.device, max_position: int,
         quantization: str = "auto") -> LoadedModel:
    """A Hugging Face checkpoint directory, or a .gguf file (its blocks kept with quantization 'gguf';
    'auto': gguf on CPU)."""
    model_dir = Path(model_dir)
    quantization = resolve_quantization(quantization, model_dir, device)
    if gguf_loader.is_gguf(model_dir):
        return load_gguf(model_dir, dtype, device, max_position, quantization)
    cfg = load_model_config(model_dir)
    files = weight_files(model_dir)
    model = _empty_model(cfg, dtype, device, max_position)
    load_weights(model, files)
    if quantization in ("q8_0", "q4_0"):
        from engine.quantize import quantize_model  # gguf and kernels/ only when asked for
        quantize_model(model, quantization)
    _finish(model, device)
    tokenizer = load_tokenizer(model_dir)
    defaults, gen_eos = generation_defaults(model_dir)
    log.info("loaded %s (%s, %d layers) in %s on %s", model_dir, cfg.architecture, cfg.num_layers, dtype, device)
    return LoadedModel(model, cfg, tokenizer, defaults, _eos_ids(gen_eos, cfg, tokenizer))
