"""Weights kept as GGUF quantized blocks (--quantization gguf on CPU): linear layers, the embedding lookup and a
tied LM head computed from the blocks.

A QuantizedWeight is a [N, K] weight as row segments of blocks (a fused q/k/v or gate/up weight has one
segment per checkpoint tensor, each in its own format). Few-row products (decode) go to the compiled kernel,
which dots the blocks with input rows rounded to int16 per block of 32; with AVX-512 VNNI the kernel takes
every row count by tiles (weights of whole groups of 16 rows kept interleaved for them), and bf16 inputs are
rounded to int8 (LinearBase.int8_for); more rows elsewhere dequantize the weight into the
activations' dtype for torch's GEMM.
Without the compiled kernels (no C++ compiler) the `gguf` package's dequantizer does the same: it is also the
tests' reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# Up to this many input rows the kernel's integer dot products beat dequantize + torch's GEMM on CPUs without
# AVX-512 VNNI. Measured on a quiet 2-vCPU AMD EPYC (AVX2 path) for SmolLM2's Q4_1 gate_up (3072x576) and down
# (576x1536): at 1 row 0.12 vs 0.80 ms and 0.09 vs 0.15 ms, at 16 rows 1.13 vs 1.32 and 0.73 vs 0.54, at 64 rows
# 3.3 vs 2.3 and 2.1 vs 1.0 (benchmarks/gguf_quantized.py --crossover). With AVX-512 VNNI the kernel's tile
# path computes any number of rows from the blocks (0.6-0.8x of dequantize + GEMM from 8 rows up to prefill
# sizes, 0.2-0.3x for the LM head: docs/benchmarks.md), so there is no limit (QuantKernel.max_rows is None).
# Steps up to the limit are also what the native decoder layer (native_decoder.py) takes.
MAX_KERNEL_ROWS = 16


def kernel_max_rows(kernel) -> int:
    """Input rows the compiled kernel takes (0 without it)."""
    if kernel is None:
        return 0
    return kernel.max_rows or 1 << 62


@dataclass(frozen=True)
class QuantSegment:
    qtype: str                  # ggml type name: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K
    blocks: torch.Tensor        # uint8 [rows, row_bytes]
    interleaved: bool = False   # the blocks interleaved across 16 rows (kernels/cpu/quant_x16.h)


class QuantizedWeight:
    def __init__(self, segments: list[QuantSegment], in_features: int) -> None:
        # kernels/ is imported only when a model keeps blocks: scripts run from benchmarks/ (whose kernels.py
        # shadows the package) still import the engine.
        from engine.cpu_kernels import QUANT_FORMATS, load_quant_kernel
        for seg in segments:
            if seg.qtype not in QUANT_FORMATS:
                raise ValueError(f"{seg.qtype} blocks cannot be computed with (formats: {', '.join(QUANT_FORMATS)})")
            fmt = QUANT_FORMATS[seg.qtype]
            if in_features % fmt.block_weights or seg.blocks.shape[1] != fmt.row_bytes(in_features):
                raise ValueError(f"{seg.qtype} rows of {seg.blocks.shape[1]} bytes do not hold {in_features} weights")
        self.kernel = load_quant_kernel()
        self.segments = [self._laid_out(s) for s in segments]
        self.in_features = in_features
        self.out_features = sum(s.blocks.shape[0] for s in segments)
        self.max_kernel_rows = kernel_max_rows(self.kernel)

    def _laid_out(self, seg: QuantSegment) -> QuantSegment:
        """The segment as the kernel reads it fastest: interleaved across 16 rows where it can (its tiles then
        unpack without a transpose, and take every row count: one decode row in 0.3-0.5x the time of the
        file's layout, 64 rows 0.7-0.8x; docs/benchmarks.md), else as the file stores it."""
        blocks = seg.blocks.contiguous()
        if seg.interleaved or self.kernel is None or not self.kernel.interleaves(seg.qtype, blocks.shape[0]):
            return QuantSegment(seg.qtype, blocks, seg.interleaved)
        if blocks.untyped_storage().nbytes() != blocks.numel():    # a view: its base must keep the file's layout
            blocks = blocks.clone()
        return QuantSegment(seg.qtype, self.kernel.interleave_(blocks, seg.qtype), True)

    @property
    def nbytes(self) -> int:
        return sum(s.blocks.numel() for s in self.segments)

    @property
    def format(self) -> str:
        return "+".join(dict.fromkeys(s.qtype for s in self.segments))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None,
               int8_inputs: bool = False) -> torch.Tensor:
        """x @ W^T + bias in x's dtype, or in out_dtype (fp32 logits from bf16 activations: rounding logits to
        bf16 steps of 1/16..1/8 ties near-equal tokens). int8_inputs: inputs rounded to int8 per block of 32
        (with AVX-512 VNNI; kernels/cpu/quant_tiles.cpp), else to int16."""
        out_dtype = out_dtype or x.dtype
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 0:      # e.g. the LM head of a step whose prefill chunks all end mid-prompt
            return x.new_empty(*x.shape[:-1], self.out_features, dtype=out_dtype)
        if rows.shape[0] <= self.max_kernel_rows and rows.dtype in (torch.float32,
                                                                                            torch.bfloat16):
            rows = rows.contiguous()
            out = torch.empty(rows.shape[0], self.out_features, dtype=out_dtype)
            col = 0
            for seg in self.segments:
                n = seg.blocks.shape[0]
                self.kernel.linear_into(rows, seg.blocks, seg.qtype, out[:, col:col + n], int8_inputs, seg.interleaved)
                col += n
            if bias is not None:
                out += bias
            return out.reshape(*x.shape[:-1], self.out_features)
        if out_dtype != x.dtype:
            x, bias = x.to(out_dtype), None if bias is None else bias.to(out_dtype)
        return F.linear(x, self.dequantize(out_dtype), bias)

    def dequantize(self, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The whole weight, or its rows `rows` (an embedding lookup), as floats of dtype."""
        if len(self.segments) == 1:
            return self._dequantize_segment(self.segments[0], dtype, rows)
        if rows is not None:
            return self.dequantize(dtype)[rows]
        return torch.cat([self._dequantize_segment(s, dtype, None) for s in self.segments])

    def _dequantize_segment(self, seg: QuantSegment, dtype: torch.dtype, rows: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is not None and dtype in (torch.float32, torch.bfloat16):
            return self.kernel.dequantize(seg.blocks, seg.qtype, self.in_features, dtype, rows, seg.interleaved)
        if seg.interleaved:
            raise ValueError("interleaved blocks are read by the compiled kernel only")
        blocks = seg.blocks if rows is None else seg.blocks[rows.reshape(-1)]
        return dequantize_reference(blocks, seg.qtype, self.in_features).to(dtype)


def dequantize_reference(blocks: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """fp32 [rows, in_features] by the `gguf` package (llama.cpp's own numpy port of its dequantizers)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(np.ascontiguousarray(blocks.numpy()), GGMLQuantizationType[qtype])
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(blocks.shape[0], in_features)


def weight_nbytes(model: torch.nn.Module) -> int:
    """Bytes of weights the model holds: parameters and quantized blocks, a tied weight once."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[id(p)] = p.numel() * p.element_size()
    for module in model.modules():
        q = getattr(module, "qweight", None)
        if q is not None:
            seen[id(q)] = q.nbytes
    return sum(seen.values())


def weight_format(model: torch.nn.Module, dtype: torch.dtype) -> str:
    """'Q4_1+Q8_0 blocks, float32 rest' for a quantized model, else the dtype's name."""
    formats = {f for m in model.modules() if getattr(m, "qweight", None) is not None for f in m.qweight.format.split("+")}
    name = str(dtype).removeprefix("torch.")
    return f"{'+'.join(sorted(formats))} blocks, {name} rest" if formats else name
