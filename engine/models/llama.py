"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) as one module with flags.

Inputs are flat token batches (varlen): [num_tokens] ids and positions plus the paged attention
metadata; q/k/v and gate/up projections are fused into one matmul each.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention.base import AttentionMetadata
from engine.distributed import parallel_state
from engine.layers.activation import SiluAndMul
from engine.layers.attention import PagedAttention
from engine.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from engine.layers.native_decoder import NativeDecoder
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.config import ModelConfig

if TYPE_CHECKING:
    from engine.cpu_kernels import CpuOps, SmallBatchLinear


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.head_dim = cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary: RotaryEmbedding | None = None  # shared, set by the model
        self.fused_rope = None  # kernels.rope when the model runs its Triton kernels
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(q.shape[0], -1, self.head_dim)
        k = k.reshape(k.shape[0], -1, self.head_dim)
        if self.fused_rope is not None:  # in place on the views of the fused qkv output
            cache = self.rotary.cos_sin_cache
            if self.q_norm is not None:
                self.fused_rope.qk_norm_rope(q, k, positions, cache, self.q_norm.weight, self.k_norm.weight,
                                             self.q_norm.eps)
            else:
                self.fused_rope.apply_rope(q, k, positions, cache)
            return self.o_proj(self.attn(q, k, v, meta))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(positions, q, k)
            return self.o_proj(self.attn(q, k, v, meta))
        # q and k are neighbours in the fused qkv output: rotate both with one set of ops
        num_q_heads = q.shape[1]
        qk = qkv[:, :self.q_size + self.kv_size].view(qkv.shape[0], -1, self.head_dim)
        q, k = self.rotary.rotate_qk(positions, qk).split([num_q_heads, k.shape[1]], dim=1)
        return self.o_proj(self.attn(q, k, v, meta))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, positions, hidden, residual, meta):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, full_config: ModelConfig, max_position: int) -> None:
        super().__init__()
        # config: this tensor-parallel rank's shard of the model (heads, KV heads, MLP width, vocabulary
        # rows); the same as full_config when there is one rank.
        self.full_config = full_config
        self.config = cfg = parallel_state.shard_config(full_config, parallel_state.tp_world_size())
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, full_config.vocab_size)
        self.max_position = max_position
        self.native: NativeDecoder | None = None   # quantized layers in one native call each (CPU kernels)

    def init_rotary(self, device: torch.device) -> None:
        """Built after the weights are loaded (the module is created on the meta device)."""
        cfg = self.config
        rotary = RotaryEmbedding(cfg.head_dim, self.max_position, cfg.rope_theta, cfg.rope_scaling).to(device)
        for layer in self.layers:
            layer.self_attn.rotary = rotary
        self.rotary = rotary

    def use_triton_kernels(self) -> None:
        """Swap norm, RoPE (+ Qwen3 q/k norm) and SiLU-and-mul for their fused Triton kernels."""
        from kernels import activation, norm, rope
        self._use_fused(norm=norm, activation=activation, rope=rope)

    def use_cpu_kernels(self, ops: CpuOps, small_batch: SmallBatchLinear | None) -> None:
        """Swap norm, SiLU-and-mul and RoPE (+ Qwen3 q/k norm) for their compiled CPU kernels and, with small_batch, route
        every linear layer's few-row products (decode steps) to the CPU kernel."""
        self._use_fused(norm=ops, activation=ops, rope=ops, small_batch=small_batch)
        if NativeDecoder.supports(self):
            self.native = NativeDecoder(self)

    def _use_fused(self, norm: object = None, activation: object = None, rope: object = None,
                   small_batch: SmallBatchLinear | None = None) -> None:
        """norm/activation/rope: modules or objects with the functions of kernels.norm/activation/rope."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.fused = norm
            elif isinstance(module, SiluAndMul):
                module.fused = activation
            elif isinstance(module, Attention):
                module.fused_rope = rope
            elif isinstance(module, LinearBase):
                module.small_batch = small_batch

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        if self.native is not None and self.native.applies(hidden):
            hidden, residual = self.native.forward(hidden, positions, meta)
        else:
            self.rotary.prepare(positions)     # the modules' per-step cos/sin lookup (the native layer reads the table)
            for layer in self.layers:
                hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
