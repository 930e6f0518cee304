"""From an EngineConfig to a ready ModelRunner: the part every tensor-parallel rank does alike.

The engine (rank 0) and each worker rank (engine/distributed/workers.py) call build_runner with the same
ModelPlan, so every rank loads its shard, sizes the same KV cache and captures the same graphs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine import loader
from engine.config import EngineConfig
from engine.cpu_runtime import keep_freed_memory
from engine.distributed import parallel_state
from engine.kv_sizing import choose_num_blocks
from engine.layers.quantized import weight_format, weight_nbytes
from engine.lora.manager import LoRAManager, attach_lora
from engine.model_runner import ModelRunner
from engine.models.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelPlan:
    config: EngineConfig          # resolved: no "auto" left, the attention backend final
    model_dir: str
    model_name: str
    model_config: ModelConfig     # the whole model's (not one rank's)
    max_model_len: int


def plan_model(config: EngineConfig) -> ModelPlan:
    from engine.default_model import resolve  # the built-in model is built on first use
    cfg = config.resolved()
    resolved = resolve(cfg.model)
    quantization = loader.resolve_quantization(cfg.quantization, Path(resolved.path), torch.device(cfg.device))
    model_cfg = loader.load_model_config(Path(resolved.path), quantization)
    max_model_len = _max_model_len(cfg, model_cfg)
    hd = model_cfg.head_dim
    triton_fits = hd & (hd - 1) == 0 and 16 <= hd <= 256
    if config.attention_backend == "auto" and cfg.attention_backend == "triton" and not triton_fits:
        log.warning("head_dim %d is not supported by the Triton kernels; using the torch backend", hd)
        cfg = replace(cfg, attention_backend="torch")
    if cfg.tensor_parallel_size > 1:
        parallel_state.check_divisible(model_cfg, cfg.tensor_parallel_size)
    return ModelPlan(cfg, str(resolved.path), resolved.name, model_cfg, max_model_len)


def _max_model_len(cfg: EngineConfig, model_cfg: ModelConfig) -> int:
    limit = model_cfg.max_position_embeddings
    if model_cfg.sliding_window:  # windows are not implemented: stay inside one window
        limit = min(limit, model_cfg.sliding_window)
    asked = cfg.max_model_len
    if asked is not None and asked > limit:
        raise ValueError(f"max_model_len {asked} exceeds what the model supports ({limit}).")
    return asked or limit


@dataclass
class BuiltRunner:
    loaded: loader.LoadedModel
    num_kv_blocks: int
    runner: ModelRunner
    model_weight_bytes: int     # weights held by all ranks together (GGUF blocks at their size)
    weight_format: str          # e.g. "Q4_1+Q8_0 blocks, float32 rest", or "float32"
    lora: LoRAManager | None    # the adapters' slot tables (--enable-lora)


def build_runner(plan: ModelPlan, device: torch.device) -> BuiltRunner:
    """Loads this rank's shard, allocates its KV cache (the same block count on every rank) and captures
    the decode graphs (collective: every rank captures the same buckets in the same order)."""
    cfg = plan.config
    if device.type == "cpu":
        keep_freed_memory()
    loaded = loader.load(plan.model_dir, cfg.torch_dtype, device, plan.max_model_len, cfg.quantization)
    if cfg.attention_backend == "triton":
        loaded.model.use_triton_kernels()
    if device.type == "cpu" and cfg.attention_backend == "cpu":
        # The compiled CPU kernels beside the CPU attention backend (the torch backend stays all-torch).
        from engine.cpu_kernels import use_cpu_kernels
        use_cpu_kernels(loaded.model, cfg.torch_dtype)
    num_blocks = parallel_state.all_reduce_min(choose_num_blocks(cfg, loaded.model, plan.max_model_len, device))
    graph_batch = None if cfg.enforce_eager else min(cfg.max_num_seqs, cfg.max_cudagraph_batch)
    runner = ModelRunner(loaded.model, num_blocks, cfg.block_size, cfg.attention_backend, cfg.max_num_seqs,
                         device, cfg.torch_dtype, plan.max_model_len, graph_batch)
    lora = attach_lora(cfg, runner, device)
    if runner.graphs is not None:
        runner.graphs.capture()
    weight_bytes = parallel_state.all_reduce_sum(weight_nbytes(loaded.model))
    return BuiltRunner(loaded, num_blocks, runner, weight_bytes, weight_format(loaded.model, cfg.torch_dtype), lora)
