"""Embedding requests: which rows of a step's final hidden states are pooled, and the vectors they make.

An embedding request (SamplingParams.embed) is a prefill-only engine request. Its prompt is computed like any
other, in chunks when it does not fit one step, batched with generation; nothing is sampled for it. Each step
the model runner reduces the rows a request's chunk pools to one fp32 row (ModelRunner.forward: the sum of the
chunk's final hidden states for mean pooling, the last prompt token's for last pooling), and the engine adds a
request's chunks up here, on its own thread, as their steps resolve. After the last chunk the vector is
L2-normalized and goes to the front end as little-endian float32 bytes (RequestDelta.embedding, what the
OpenAI API's base64 encoding holds); the request finishes with "stop" and its KV blocks are freed.

The hidden states are the model's after its final norm: transformers' `last_hidden_state` of the base model.
Mean pooling needs every position's, so its requests take no prefix-cache hit (Sequence.num_reusable_tokens);
last pooling needs only the last token's, which is always computed, so a cached prefix serves it as is.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.request import Sequence
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq


def embedding_params() -> SamplingParams:
    """The parameters of an embedding request (a new object each time: the engine keeps and edits its own)."""
    return SamplingParams(max_tokens=0, embed=True)


def embedding_values(data: bytes) -> list[float]:
    """An embedding as the engine sends it (little-endian float32 bytes) -> its values."""
    return np.frombuffer(data, dtype="<f4").tolist()


@dataclass
class PoolChunk:
    """One embedding request's chunk in a step, and the rows of the step's hidden states it pools."""
    seq: Sequence
    start: int        # position of the chunk's first token in the sequence
    rows: range       # rows of the step's flat batch whose final hidden states it pools
    final: bool       # the chunk ends the prompt: the vector is complete once it is added


def plan_pooling(items: list[ScheduledSeq]) -> list[PoolChunk]:
    """The pooled chunks of a scheduled step, in batch order (before its tokens are counted as computed)."""
    chunks, row = [], 0
    for item in items:
        seq, n = item.seq, item.num_new_tokens
        if seq.request.pooling is not None:
            start = seq.num_computed_tokens
            final = start + n == seq.num_tokens
            if seq.request.pooling == "mean":
                chunks.append(PoolChunk(seq, start, range(row, row + n), final))
            elif final:
                chunks.append(PoolChunk(seq, start, range(row + n - 1, row + n), final))
        row += n
    return chunks


def pool_fields(chunks: list[PoolChunk]) -> tuple[np.ndarray, np.ndarray]:
    """The runner's two batch fields: the pooled rows back to back, and each chunk's offsets into them
    (empty when the step pools nothing)."""
    if not chunks:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    rows = np.concatenate([np.arange(c.rows.start, c.rows.stop) for c in chunks])
    offsets = np.zeros(len(chunks) + 1, np.int64)
    np.cumsum([len(c.rows) for c in chunks], out=offsets[1:])
    return rows, offsets


def pool_rows(hidden: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[num_chunks, hidden] fp32: the sum of each chunk's rows (one row for last pooling), on the device,
    without a host sync."""
    num_chunks = offsets.shape[0] - 1
    chunk_of_row = torch.repeat_interleave(torch.arange(num_chunks, device=hidden.device), offsets.diff(),
                                           output_size=rows.shape[0])
    out = torch.zeros(num_chunks, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, chunk_of_row, hidden[rows].float())


def add_chunk(chunk: PoolChunk, pooled: torch.Tensor) -> torch.Tensor | None:
    """Adds a resolved chunk's pooled row to its sequence; returns the finished (not yet normalized) vector
    after the final chunk, else None.

    A sequence's chunks resolve in launch order, and a recomputation after a preemption starts again at
    position 0 (mean pooling takes no cached prefix), so each chunk starts at 0 (it starts the sum afresh)
    or where the previous one ended: a chunk still in flight when its sequence was preempted is as valid
    as any other, since a position's hidden state depends only on the tokens up to it.
    """
    seq = chunk.seq
    if seq.request.pooling == "last":
        return pooled if chunk.final else None
    if chunk.start == 0:
        seq.pooled_sum = pooled
    elif chunk.start == seq.num_pooled and seq.pooled_sum is not None:
        seq.pooled_sum = seq.pooled_sum + pooled
    else:
        raise RuntimeError(f"mean pooling of request {seq.request.request_id}: a chunk at position {chunk.start} "
                           f"follows positions [0, {seq.num_pooled})")
    seq.num_pooled = chunk.start + len(chunk.rows)
    if not chunk.final:
        return None
    total, seq.pooled_sum = seq.pooled_sum, None
    return total / seq.num_pooled


def encode_vectors(vectors: list[torch.Tensor]) -> list[bytes]:
    """L2-normalized, as little-endian float32 bytes: one device->host copy for all of a step's vectors."""
    normalized = F.normalize(torch.stack(vectors), dim=-1).cpu().numpy().astype("<f4", copy=False)
    return [row.tobytes() for row in normalized]
