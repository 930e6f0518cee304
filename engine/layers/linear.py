"""Tensor-parallel linear layers (Megatron-style) built on plain nn.Linear / nn.Embedding weights.

Each rank holds a slice of every weight (engine/loader.py reads only that slice); with one rank every
class here is exactly its torch parent. Collectives come from engine.distributed.parallel_state.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import parallel_state as ps

if TYPE_CHECKING:
    from engine.cpu_kernels import SmallBatchLinear
    from engine.layers.quantized import QuantizedWeight
    from engine.lora.layers import LoRAProjection


class LinearBase(nn.Linear):
    # kernels.cpu.linear.SmallBatchLinear on AVX-512 CPUs (set by the model's use_cpu_kernels): decode
    # steps of a few rows read each weight once instead of going through torch's matmul.
    small_batch: SmallBatchLinear | None = None
    # The weight as GGUF blocks (--quantization gguf): then there is no float `weight` parameter.
    qweight: QuantizedWeight | None = None
    # The adapters' slot table (--enable-lora, engine/lora/): their terms are added to this layer's output.
    lora: LoRAProjection | None = None
    # From blocks, bf16 inputs are rounded to int8 per block of 32 (llama.cpp's rounding of every layer's
    # inputs; VNNI's fast path), fp32 inputs to int16. False: int16 always (the tests' reference).
    int8_inputs: bool = True

    def int8_for(self, dtype: torch.dtype) -> bool:
        """Whether inputs of this dtype are rounded to int8: bf16 activations, whose own rounding is of the
        same size (8 significant bits against 7 bits and a sign per block). fp32 keeps int16: there int8 noise
        moved SmolLM2's README answer, a near tie, by 0.07 nats under a 1-ulp change elsewhere (a vectorized
        SiLU). In bf16, int8 on every projection and the LM head: perplexity 23.58 (int16 but gate/up: 23.53,
        llama.cpp 23.55), the README answer 0.25 nats ahead (docs/benchmarks.md)."""
        return self.int8_inputs and dtype == torch.bfloat16

    def set_quantized(self, qweight: QuantizedWeight) -> None:
        if (qweight.out_features, qweight.in_features) != tuple(self.weight.shape):
            raise ValueError(f"quantized weight [{qweight.out_features}, {qweight.in_features}] does not match "
                             f"the layer's {list(self.weight.shape)}")
        del self.weight
        self.weight = None
        self.qweight = qweight

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight.linear(x, bias, int8_inputs=self.int8_for(x.dtype))
        small = self.small_batch
        if small is not None and small.applies(x, self.weight):
            return small(x, self.weight, bias)
        return F.linear(x, self.weight, bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks (fused QKV, gate/up): each rank computes its own columns and
    feeds them to a row-parallel layer, so no collective is needed here."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.bias)
        return out if self.lora is None else self.lora.add(x, out)


class RowParallelLinear(LinearBase):
    """Input features split across ranks (o_proj, down_proj): each rank's product is a partial sum; one
    all-reduce makes the full output on every rank."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = ps.all_reduce(self.matmul(x, None))
        if self.lora is not None:
            out = self.lora.add(x, out)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the (padded) vocabulary; tokens outside them embed to 0 before the all-reduce."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        # The checkpoint overwrites every weight: an explicit (uninitialised) weight skips Embedding's random
        # init, whose normal_ on the meta device imports torch._dynamo (seconds of startup on a small CPU).
        super().__init__(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
        self.vocab_start = ps.tp_rank() * num_embeddings
        self.qweight: QuantizedWeight | None = None   # the table as GGUF blocks (--quantization gguf)
        self.dtype = torch.get_default_dtype()

    def set_quantized(self, qweight: QuantizedWeight) -> None:
        """Rows are looked up in the blocks and dequantized into the float weight's dtype."""
        if (qweight.out_features, qweight.in_features) != tuple(self.weight.shape):
            raise ValueError(f"quantized table [{qweight.out_features}, {qweight.in_features}] does not match "
                             f"the embedding's {list(self.weight.shape)}")
        self.dtype = self.weight.dtype
        del self.weight
        self.weight = None
        self.qweight = qweight

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:
            return F.embedding(ids, self.weight)
        return self.qweight.dequantize(self.dtype, ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if ps.tp_world_size() == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = self._lookup(local.masked_fill(outside, 0))
        return ps.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(ColumnParallelLinear):
    """Logits of this rank's vocabulary rows, gathered into the whole vocabulary (padding cut off)."""

    def __init__(self, hidden_size: int, num_local_rows: int, vocab_size: int) -> None:
        super().__init__(hidden_size, num_local_rows, bias=False)
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # From blocks the logits come out in fp32 (the kernel sums in fp32): none are lost to bf16 rounding.
        if self.qweight is None:
            logits = super().forward(x)
        else:
            logits = self.qweight.linear(x, None, torch.float32, int8_inputs=self.int8_for(x.dtype))
        return ps.all_gather_last_dim(logits)[..., :self.vocab_size]
