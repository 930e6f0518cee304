"""A whole decoder layer of a quantized model in one call of the compiled kernel (layer.cpp).

LayerWeights holds one layer's constants (norm weights, the four projections' blocks, its KV cache); StepInputs
holds what every layer of one step shares (positions, RoPE table, attention metadata as int32). Tensors passed
in must stay alive while the structures are used: the caller keeps them.
"""
from __future__ import annotations

import ctypes

import torch

from kernels.cpu.build import load_kernel
from kernels.cpu.quant import type_id

MAX_SEGMENTS = 4
_p, _i, _i64, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


class QLinear(ctypes.Structure):
    _fields_ = [("num_segments", _i), ("blocks", _p * MAX_SEGMENTS), ("qtype", _i * MAX_SEGMENTS),
                ("rows", _i * MAX_SEGMENTS), ("row_bytes", _i64 * MAX_SEGMENTS), ("in_features", _i),
                ("out_features", _i), ("int8_inputs", _i)]


class LayerWeights(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_norm", _p), ("q_norm", _p), ("k_norm", _p), ("eps", _f),
                ("qkv", QLinear), ("o", QLinear), ("gate_up", QLinear), ("down", QLinear),
                ("k_cache", _p), ("v_cache", _p), ("num_heads", _i), ("num_kv_heads", _i), ("head_dim", _i),
                ("block_size", _i), ("scale", _f)]


class StepInputs(ctypes.Structure):
    _fields_ = [("tokens", _i64), ("positions", _p), ("cos_sin", _p), ("cos_sin_stride", _i64),
                ("slot_mapping", _p), ("block_tables", _p), ("block_tables_stride", _i64), ("seq_lens", _p),
                ("cu_seqlens_q", _p), ("num_seqs", _i), ("is_bf16", _i)]


def qlinear(segments: list[tuple[str, torch.Tensor, bool]], in_features: int, int8_inputs: bool) -> QLinear:
    """segments: (ggml type name, uint8 blocks [rows, row_bytes], interleaved) in row order; int8_inputs and
    interleaved as in QuantKernel.linear_into."""
    if len(segments) > MAX_SEGMENTS:
        raise ValueError(f"a projection of {len(segments)} block segments (at most {MAX_SEGMENTS})")
    q = QLinear(num_segments=len(segments), in_features=in_features,
                out_features=sum(blocks.shape[0] for _, blocks, _ in segments), int8_inputs=int(int8_inputs))
    for i, (qtype, blocks, interleaved) in enumerate(segments):
        q.blocks[i], q.qtype[i] = blocks.data_ptr(), type_id(qtype, interleaved)
        q.rows[i], q.row_bytes[i] = blocks.shape[0], blocks.stride(0)
    return q


def step_inputs(tokens: int, positions: torch.Tensor, cos_sin: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                is_bf16: bool) -> StepInputs:
    """int32 contiguous tensors, kept alive by the caller."""
    return StepInputs(tokens=tokens, positions=positions.data_ptr(), cos_sin=cos_sin.data_ptr(),
                      cos_sin_stride=cos_sin.stride(0), slot_mapping=slot_mapping.data_ptr(),
                      block_tables=block_tables.data_ptr(), block_tables_stride=block_tables.stride(0),
                      seq_lens=seq_lens.data_ptr(), cu_seqlens_q=cu_seqlens_q.data_ptr(),
                      num_seqs=seq_lens.shape[0], is_bf16=int(is_bf16))


class LayerKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fn = lib.cpu_decoder_layer
        self.fn.restype = _i
        self.fn.argtypes = [ctypes.POINTER(LayerWeights), ctypes.POINTER(StepInputs), _p, _p, _i]

    def __call__(self, weights: LayerWeights, step: StepInputs, hidden: torch.Tensor, residual: torch.Tensor,
                 first: bool) -> None:
        """hidden [T, H] -> the layer's MLP output, in place; residual [T, H] updated in place."""
        status = self.fn(ctypes.byref(weights), ctypes.byref(step), hidden.data_ptr(), residual.data_ptr(),
                         int(first))
        if status != 0:
            raise RuntimeError(f"the CPU decoder-layer kernel failed (status {status})")


def load_layer_kernel() -> LayerKernel | None:
    lib = load_kernel()
    return None if lib is None else LayerKernel(lib)
