"""--quantization q8_0 | q4_0: a float checkpoint's linear layers and embedding table quantized at load into
GGUF blocks on CPU, so any model is computed by the same kernel as a quantized .gguf file.

Each rank quantizes the slice it holds. The blocks are made by the `gguf` package's quantizer (llama.cpp's
reference rounding: one fp16 scale per 32 weights, round to nearest), so the result equals what llama.cpp's
converter writes for Q8_0 / Q4_0. A layer whose input width is not a multiple of 32 stays float (logged).
"""
from __future__ import annotations

import logging

import gguf
import numpy as np
import torch

from engine.layers.linear import LinearBase, VocabParallelEmbedding
from engine.layers.quantized import QuantizedWeight, QuantSegment
from engine.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

# --quantization value -> the ggml block format it quantizes into
AT_LOAD = {"q8_0": "Q8_0", "q4_0": "Q4_0"}


def quantized(weight: torch.Tensor, qtype: str) -> QuantizedWeight:
    """A float [N, K] weight as blocks of qtype."""
    values = weight.detach().float().numpy()
    blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype])
    return QuantizedWeight([QuantSegment(qtype, torch.from_numpy(np.ascontiguousarray(blocks).view(np.uint8)))],
                           weight.shape[1])


def quantize_model(model: LlamaForCausalLM, quantization: str) -> None:
    """Replaces the float weights of every linear layer and the embedding table by blocks (a tied LM head
    shares the table's blocks)."""
    qtype = AT_LOAD[quantization]
    tied = model.lm_head.weight is model.embed_tokens.weight
    kept_float = []
    for name, module in model.named_modules():
        if not isinstance(module, (LinearBase, VocabParallelEmbedding)) or module.weight is None:
            continue
        if tied and module is model.lm_head:
            continue
        if module.weight.shape[1] % 32:
            kept_float.append(name)
            continue
        module.set_quantized(quantized(module.weight, qtype))
    if tied:
        model.lm_head.set_quantized(model.embed_tokens.qweight)
    if kept_float:
        log.info("%s stay float: their input width is not a multiple of 32", ", ".join(kept_float))
    log.info("quantized the linear layers and the embedding table into %s blocks at load", qtype)
