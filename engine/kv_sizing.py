"""How many KV blocks to allocate: given, derived from the workload on CPU, or from free GPU memory."""
from __future__ import annotations

import logging

import torch

from engine.attention.base import AttentionMetadata
from engine.config import EngineConfig
from engine.layers.attention import make_backend
from engine.model_runner import kv_cache_bytes_per_block
from engine.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)
CPU_KV_BUDGET_BYTES = 2 << 30
GiB = float(1 << 30)


def choose_num_blocks(cfg: EngineConfig, model: LlamaForCausalLM, max_model_len: int,
                      device: torch.device) -> int:
    per_block = kv_cache_bytes_per_block(model, cfg.block_size, cfg.torch_dtype)
    if cfg.num_kv_blocks is not None:
        blocks = cfg.num_kv_blocks
    elif device.type == "cpu":
        wanted = cfg.max_num_seqs * -(-max_model_len // cfg.block_size) + 1
        blocks = max(2, min(wanted, CPU_KV_BUDGET_BYTES // per_block))
    else:
        blocks = _blocks_from_gpu_memory(cfg, model, max_model_len, device, per_block)
    log.info("KV cache: %d blocks of %d tokens = %d tokens, %.2f GiB", blocks, cfg.block_size,
             (blocks - 1) * cfg.block_size, blocks * per_block / GiB)
    return blocks


@torch.inference_mode()
def profile_peak_memory(cfg: EngineConfig, model: LlamaForCausalLM, max_model_len: int,
                        device: torch.device) -> int:
    """Peak bytes allocated by a forward at the largest token budget (weights included)."""
    mc = model.config
    num_tokens = cfg.max_num_batched_tokens
    q_lens = [min(max_model_len, num_tokens - s) for s in range(0, num_tokens, max_model_len)]
    cu = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    kv = torch.zeros(mc.num_layers, 2, 1, cfg.block_size, mc.num_kv_heads, mc.head_dim,
                     dtype=cfg.torch_dtype, device=device)
    backend = make_backend(cfg.attention_backend, num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads,
                           head_dim=mc.head_dim, max_num_seqs=cfg.max_num_seqs, device=device,
                           dtype=cfg.torch_dtype)
    for i, attn in enumerate(model.attention_layers()):
        attn.backend, attn.k_cache, attn.v_cache = backend, kv[i, 0], kv[i, 1]
    # every slot is padding (-1) and every block-table entry the null block: shapes matter, values do not
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int32, device=device),
        block_tables=torch.zeros(len(q_lens), 1, dtype=torch.int32, device=device),
        seq_lens=torch.ones(len(q_lens), dtype=torch.int32, device=device),
        cu_seqlens_q=cu, max_seqlen_q=max(q_lens), max_seqlen_k=1, is_decode_only=False)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.zeros(num_tokens, dtype=torch.int32, device=device)
    hidden = model(ids, torch.zeros_like(ids), meta)
    model.compute_logits(hidden[: min(num_tokens, cfg.max_num_seqs)])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del hidden, kv
    torch.cuda.empty_cache()
    return peak


def _blocks_from_gpu_memory(cfg: EngineConfig, model: LlamaForCausalLM, max_model_len: int,
                            device: torch.device, per_block: int) -> int:
    peak = profile_peak_memory(cfg, model, max_model_len, device)
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = total - free - torch.cuda.memory_reserved(device)
    available = total * cfg.gpu_memory_utilization - peak - outside_torch
    blocks = int(available // per_block)
    if blocks < 2:
        raise ValueError(f"no GPU memory left for the KV cache (peak {peak / GiB:.2f} GiB of {total / GiB:.2f} GiB); "
                         "raise gpu_memory_utilization or lower max_num_batched_tokens.")
    log.info("GPU memory: total %.2f GiB, profiled peak %.2f GiB, outside torch %.2f GiB",
             total / GiB, peak / GiB, outside_torch / GiB)
    return blocks
