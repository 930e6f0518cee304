"""GGUF quantized blocks on CPU through the compiled kernel (quant.cpp, quant_tiles.cpp): linear layers computed
from the blocks in integers, and rows dequantized into fp32 or bf16 (embedding lookups, prefill GEMMs).

Blocks are a uint8 tensor [rows, row_bytes]: each output row's blocks (32 weights; 256 for the K-quants), as a
.gguf file stores them, or (where has_interleaved) the same bytes interleaved across groups
of 16 rows by interleave_, the layout the kernel's tiles unpack without a transpose (quant_x16.h). The
reference for both is the `gguf` package's dequantizer (engine/layers/quantized.py's fallback).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels.cpu.build import load_kernel


@dataclass(frozen=True)
class QuantFormat:
    type_id: int        # ggml's type id
    block_weights: int  # 32, or 256 for the K-quants' super-blocks
    block_bytes: int

    def row_bytes(self, in_features: int) -> int:
        return in_features // self.block_weights * self.block_bytes


# ggml type name -> format: the formats quant.cpp computes with.
FORMATS = {"Q4_0": QuantFormat(2, 32, 18), "Q4_1": QuantFormat(3, 32, 20), "Q5_0": QuantFormat(6, 32, 22),
           "Q5_1": QuantFormat(7, 32, 24), "Q8_0": QuantFormat(8, 32, 34), "Q4_K": QuantFormat(12, 256, 144),
           "Q5_K": QuantFormat(13, 256, 176), "Q6_K": QuantFormat(14, 256, 210)}
DTYPES = (torch.float32, torch.bfloat16)
INTERLEAVED = 256               # type id flag of interleaved blocks (quant_x16.h)
GROUP_ROWS = 16


def type_id(qtype: str, interleaved: bool) -> int:
    """The kernel's id of a format and layout."""
    return FORMATS[qtype].type_id | (INTERLEAVED if interleaved else 0)


class QuantKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        # The most input rows linear_into is meant for (None: any): the build with AVX-512 VNNI computes
        # prefill-sized inputs from the blocks too; the others hand more than 16 rows to a float GEMM.
        self.max_rows: int | None = lib.qlinear_max_rows() or None
        # Whether linear_into rounds inputs to int8 when asked (int8_inputs): builds with AVX-512 VNNI.
        self.has_int8: bool = bool(lib.qlinear_has_int8())
        # Whether the kernel reads interleaved blocks (interleave_): builds with AVX-512 VNNI, whose tiles
        # they are for.
        self.has_interleaved: bool = bool(lib.qlinear_has_interleaved())

    def interleaves(self, qtype: str, rows: int) -> bool:
        """Whether a weight of this format and row count is best kept interleaved."""
        return self.has_interleaved and qtype in FORMATS and rows % GROUP_ROWS == 0

    def interleave_(self, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
        """Rearranges contiguous blocks [N, row_bytes] (N a multiple of 16) in place into the interleaved
        layout, 16 rows at a time (no second copy of the weight); returns them."""
        n, row_bytes = blocks.shape
        K = row_bytes // FORMATS[qtype].block_bytes * FORMATS[qtype].block_weights
        if not blocks.is_contiguous() or self.lib.qinterleave(blocks.data_ptr(), FORMATS[qtype].type_id, n, K,
                                                              row_bytes) != 0:
            raise ValueError(f"{qtype} blocks {tuple(blocks.shape)} cannot be interleaved")
        return blocks

    def linear_into(self, x: torch.Tensor, blocks: torch.Tensor, qtype: str, out: torch.Tensor,
                    int8_inputs: bool = False, interleaved: bool = False) -> None:
        """out[:, :] = x @ W^T for x [M, K] (fp32/bf16, contiguous) and W's blocks [N, row_bytes]; out is
        [M, N] (fp32/bf16: fp32 keeps the kernel's fp32 sums of bf16 inputs) with any row stride (a column slice
        of a fused output). int8_inputs: the inputs are rounded to int8 per block of 32 (llama.cpp's rounding,
        VNNI vpdpbusd) where has_int8, else to int16. interleaved: the blocks as interleave_ leaves them."""
        M, K = x.shape
        if out.stride(1) != 1 or out.dtype not in DTYPES:
            raise ValueError("out must be fp32 or bf16 with unit column stride")
        status = self.lib.qlinear(x.data_ptr(), blocks.data_ptr(), type_id(qtype, interleaved), M, blocks.shape[0], K,
                                  blocks.stride(0), out.data_ptr(), out.stride(0), int(x.dtype == torch.bfloat16),
                                  int(out.dtype == torch.bfloat16), int(int8_inputs))
        if status != 0:
            raise ValueError(f"the quantized linear kernel rejected {qtype} blocks {tuple(blocks.shape)} for "
                             f"{K} input features")

    def dequantize(self, blocks: torch.Tensor, qtype: str, K: int, dtype: torch.dtype,
                   rows: torch.Tensor | None = None, interleaved: bool = False) -> torch.Tensor:
        """The weight rows `rows` (all rows when None) as a [len(rows), K] tensor of dtype (fp32/bf16)."""
        if rows is not None:
            rows = rows.to(torch.int64).contiguous()
        n = blocks.shape[0] if rows is None else rows.numel()
        out = torch.empty(n, K, dtype=dtype)
        status = self.lib.qdequant(blocks.data_ptr(), type_id(qtype, interleaved), blocks.stride(0), blocks.shape[0],
                                   None if rows is None else rows.data_ptr(), n, K, out.data_ptr(),
                                   int(dtype == torch.bfloat16))
        if status != 0:
            raise ValueError(f"the dequantize kernel rejected {qtype} blocks {tuple(blocks.shape)} for {K} columns")
        return out


def load_quant_kernel() -> QuantKernel | None:
    """The kernel, or None where no C++ compiler was found."""
    lib = load_kernel()
    return None if lib is None else QuantKernel(lib)
