"""The decoder layers of a quantized llama-family model run by one native call each (kernels/cpu/layer.cpp).

At one sequence a decode step of SmolLM2 (30 layers) spent more time in Python between the per-layer kernels
than in them. The native layer calls the same kernels in the same order as the torch modules, so the output
is the same bit for bit (tests/test_native_decoder.py); the modules stay the reference and run whatever the
native layer does not take: more rows than the quantized kernel serves (long prefill chunks where it has no tile path), tensor
parallelism, biases, a layer with float weights, another attention backend.
"""
from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata
from engine.distributed import parallel_state
from engine.layers.linear import LinearBase
from engine.layers.quantized import kernel_max_rows


def _projection(lin: LinearBase, dtype: torch.dtype):
    from kernels.cpu.layer import qlinear
    q = lin.qweight
    return qlinear([(s.qtype, s.blocks, s.interleaved) for s in q.segments], q.in_features, lin.int8_for(dtype))


class NativeDecoder:
    def __init__(self, model: torch.nn.Module) -> None:
        from kernels.cpu.layer import load_layer_kernel
        self.model = model
        from kernels.cpu.quant import load_quant_kernel
        self.kernel = load_layer_kernel()
        self.max_rows = kernel_max_rows(load_quant_kernel())   # the rows the modules' projections run natively
        self._weights: list | None = None
        self._cache_ptr = 0

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """Every projection of every layer in blocks the kernel computes with, no biases, one rank."""
        if parallel_state.tp_world_size() != 1:
            return False
        if model.rotary.cos_sin_cache.shape[-1] != model.config.head_dim:   # partial rotary: the modules
            return False
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if lin.qweight is None or lin.bias is not None or len(lin.qweight.segments) > 4:
                    return False
        return True

    def applies(self, hidden: torch.Tensor) -> bool:
        backend = self.model.layers[0].self_attn.attn.backend
        lora = self.model.layers[0].self_attn.qkv_proj.lora     # adapters in the step: the modules add them
        return (self.kernel is not None and (lora is None or not lora.batch.active) and 0 < hidden.shape[0] <= self.max_rows
                and hidden.dtype in (torch.float32, torch.bfloat16) and backend is not None
                and backend.name == "cpu" and backend.kernel is not None)

    def reset(self) -> None:
        """Rebuilds the per-layer structures at the next step (after a projection's settings changed)."""
        self._weights = None

    def _layer_weights(self) -> list:
        """Built at the first step (the KV cache is bound after the model is built) and again if it moves."""
        from kernels.cpu.layer import LayerWeights
        first = self.model.layers[0].self_attn.attn
        if self._weights is not None and self._cache_ptr == first.k_cache.data_ptr():
            return self._weights
        weights = []
        for layer in self.model.layers:
            attn, mlp, pa = layer.self_attn, layer.mlp, layer.self_attn.attn
            dtype = pa.k_cache.dtype    # the activations' dtype
            weights.append(LayerWeights(
                input_norm=layer.input_layernorm.weight.data_ptr(), post_norm=layer.post_attention_layernorm.weight.data_ptr(),
                q_norm=None if attn.q_norm is None else attn.q_norm.weight.data_ptr(),
                k_norm=None if attn.k_norm is None else attn.k_norm.weight.data_ptr(),
                eps=layer.input_layernorm.eps,
                qkv=_projection(attn.qkv_proj, dtype),
                o=_projection(attn.o_proj, dtype),
                gate_up=_projection(mlp.gate_up_proj, dtype),
                down=_projection(mlp.down_proj, dtype),
                k_cache=pa.k_cache.data_ptr(), v_cache=pa.v_cache.data_ptr(), num_heads=pa.num_heads,
                num_kv_heads=pa.num_kv_heads, head_dim=pa.head_dim, block_size=pa.k_cache.shape[1], scale=pa.scale))
        self._weights, self._cache_ptr = weights, first.k_cache.data_ptr()
        return weights

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the embeddings [T, H] (overwritten); returns (the last layer's MLP output, the residual)."""
        from kernels.cpu.layer import step_inputs
        hidden = hidden.contiguous()
        residual = torch.empty_like(hidden)
        # int32, contiguous, alive until the last layer returns
        ints = [t.to(torch.int32).contiguous() for t in (positions, meta.slot_mapping, meta.block_tables,
                                                          meta.seq_lens, meta.cu_seqlens_q)]
        cos_sin = self.model.rotary.cos_sin_cache
        step = step_inputs(hidden.shape[0], ints[0], cos_sin, *ints[1:], hidden.dtype == torch.bfloat16)
        for i, weights in enumerate(self._layer_weights()):
            self.kernel(weights, step, hidden, residual, i == 0)
        return hidden, residual
