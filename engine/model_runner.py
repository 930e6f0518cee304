"""Scheduled batch -> flat tensors -> model forward -> logits of the rows that sample.

Batch metadata is assembled with numpy on the host and crosses to the device in ONE copy: every
int field lives in a single int32 buffer that is split into views on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.base import AttentionMetadata
from engine.cuda_graphs import GraphRunner
from engine.layers.attention import make_backend
from engine.lora.layers import LoRABatch
from engine.models.llama import LlamaForCausalLM
from engine.pooling import PoolChunk, pool_fields, pool_rows
from engine.scheduler import SchedulerOutput


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor     # rows of the hidden states whose next token is sampled
    # prompt_logprobs: rows whose logits score the prompt token after them, and those tokens' ids
    prompt_logits_indices: torch.Tensor
    prompt_target_ids: torch.Tensor
    # Overlap: input tokens still being sampled by the previous step (placeholders, < 0) and the rows of that
    # step's sampled-token tensor that fill them, on the device; None when there are none.
    fill_dst: torch.Tensor | None = None
    fill_src: torch.Tensor | None = None
    packed: PackedStep | None = None        # the host form, which tensor parallelism sends to the other ranks
    # Embedding requests (engine/pooling.py): the hidden-state rows pooled, and each chunk's offsets into them
    pool_rows: torch.Tensor | None = None
    pool_offsets: torch.Tensor | None = None
    pooled: torch.Tensor | None = None      # set by forward: [num_pooled_chunks, hidden] fp32, when any
    lora_token_slots: torch.Tensor | None = None   # each token's LoRA slot (-1: base), when adapters are on


@dataclass
class PackedStep:
    """A step's batch metadata on the host: every int field back to back in one int32 tensor."""
    header: np.ndarray       # int64: num_seqs, block-table width, max_seqlen_q, max_seqlen_k, decode-only,
                             # then the length of each of the NUM_FIELDS fields
    host: torch.Tensor


NUM_FIELDS = 14
HEADER_LEN = 5 + NUM_FIELDS


def kv_cache_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.config
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, backend: str,
                 max_num_seqs: int, device: torch.device, dtype: torch.dtype, max_model_len: int,
                 graph_max_batch: int | None) -> None:
        """graph_max_batch: largest decode batch run through the static-buffer graph runner (None: eager)."""
        cfg = model.config
        self.model, self.device, self.block_size = model, device, block_size
        self.kv_cache = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                    dtype=dtype, device=device)
        self.backend = make_backend(backend, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                    head_dim=cfg.head_dim, max_num_seqs=max_num_seqs, device=device, dtype=dtype)
        for i, attn in enumerate(model.attention_layers()):
            attn.backend = self.backend
            attn.k_cache, attn.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        self.pin = device.type == "cuda"
        self.lora_batch: LoRABatch | None = None     # set by the engine with --enable-lora
        self.graphs = None
        if graph_max_batch:
            # Real graphs need a backend that never syncs the host: the Triton one.
            self.graphs = GraphRunner(model, graph_max_batch, max_model_len, block_size, device,
                                      use_graphs=backend == "triton")

    def build_inputs(self, sched: SchedulerOutput, pool: list[PoolChunk] | None = None,
                     lora_slots: np.ndarray | None = None) -> StepInputs:
        """pool: the chunks of embedding requests whose hidden states this step pools (engine/pooling.py);
        lora_slots: each scheduled sequence's LoRA slot (-1: the base model), with --enable-lora."""
        items = sched.scheduled
        q_lens = np.fromiter((s.num_new_tokens for s in items), np.int64, len(items))
        starts = np.fromiter((s.seq.num_computed_tokens for s in items), np.int64, len(items))
        cu = np.zeros(len(items) + 1, np.int64)
        np.cumsum(q_lens, out=cu[1:])
        num_tokens = int(cu[-1])
        seq_lens = starts + q_lens
        # position of every token: its sequence's start + its offset inside the chunk
        positions = np.repeat(starts - cu[:-1], q_lens) + np.arange(num_tokens)
        input_ids = np.empty(num_tokens, np.int64)
        width = max(len(s.seq.block_table) for s in items)
        block_tables = np.zeros((len(items), width), np.int64)
        scored_rows: list[np.ndarray] = []        # prompt_logprobs: few requests ask, most steps have none
        scored_ids: list[int] = []
        for i, s in enumerate(items):
            tokens = s.seq.token_ids[starts[i]:seq_lens[i]]
            input_ids[cu[i]:cu[i + 1]] = tokens + s.seq.spec_token_ids if s.num_spec_tokens else tokens
            block_tables[i, :len(s.seq.block_table)] = s.seq.block_table
            if s.seq.request.prompt_logprobs is not None:
                span = s.seq.prompt_logprob_positions(s.num_new_tokens)
                scored_rows.append(np.arange(span.start, span.stop) + (cu[i] - starts[i]))
                scored_ids += s.seq.token_ids[span.start + 1:span.stop + 1]
        rows = np.repeat(np.arange(len(items)), q_lens)
        bs = self.block_size
        slot_mapping = block_tables[rows, positions // bs] * bs + positions % bs
        sampling = np.fromiter((s.samples for s in items), bool, len(items))
        logits_indices = _logits_rows(items, cu, sampling)
        fill_dst = np.flatnonzero(input_ids < 0)
        fill_src = np.fromiter((items[r].seq.pending_row for r in rows[fill_dst]), np.int64, len(fill_dst))
        prompt_rows = np.concatenate(scored_rows) if scored_rows else np.zeros(0, np.int64)
        token_slots = (np.repeat(lora_slots, q_lens) if lora_slots is not None and (lora_slots >= 0).any()
                       else np.zeros(0, np.int64))
        fields = (input_ids, positions, slot_mapping, seq_lens, cu, logits_indices, block_tables.ravel(),
                  fill_dst, fill_src, prompt_rows, np.array(scored_ids, np.int64), *pool_fields(pool or []),
                  token_slots)
        return self.unpack(_pack(fields, len(items), width, int(q_lens.max()), int(seq_lens.max()),
                                 bool((q_lens == 1).all())))

    def decode_inputs(self, input_ids: np.ndarray, positions: np.ndarray, block_tables: np.ndarray) -> StepInputs:
        """One new token per sequence at the given positions, every row sampled (a draft model's proposal
        steps): the same packing as build_inputs, without a scheduler step behind it."""
        num_seqs, bs = len(input_ids), self.block_size
        slot_mapping = block_tables[np.arange(num_seqs), positions // bs] * bs + positions % bs
        rows = np.arange(num_seqs + 1)
        none = np.zeros(0, np.int64)
        fields = (input_ids, positions, slot_mapping, positions + 1, rows, rows[:-1], block_tables.ravel(), none,
                  none, none, none, *pool_fields([]), none)
        return self.unpack(_pack(fields, num_seqs, block_tables.shape[1], 1, int(positions.max()) + 1, True))

    def unpack(self, packed: PackedStep) -> StepInputs:
        """The one host->device copy of the step, split into views on the device."""
        host = packed.host
        dev = host.pin_memory().to(self.device, non_blocking=True) if self.pin else host.to(self.device)
        num_seqs, width, max_q, max_k, decode_only = (int(v) for v in packed.header[:5])
        parts = dev.split(packed.header[5:].tolist())
        meta = AttentionMetadata(
            slot_mapping=parts[2], block_tables=parts[6].view(num_seqs, width), seq_lens=parts[3],
            cu_seqlens_q=parts[4], max_seqlen_q=max_q, max_seqlen_k=max_k, is_decode_only=bool(decode_only))
        fills = (parts[7], parts[8]) if len(parts[7]) else (None, None)
        pool = (parts[11], parts[12]) if len(parts[12]) else (None, None)
        return StepInputs(parts[0], parts[1], meta, parts[5], parts[9], parts[10], *fills, packed=packed,
                          pool_rows=pool[0], pool_offsets=pool[1],
                          lora_token_slots=parts[13] if len(parts[13]) else None)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole KV blocks (all layers, K and V) before they are written."""
        if copies:
            src, dst = (torch.tensor(c, device=self.device) for c in zip(*copies))
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        self.copy_blocks(sched.block_copies)
        return self.build_inputs(sched)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Runs the model; returns fp32 logits [num_sampling_rows + num_prompt_rows, vocab]: the sampling
        rows first, then the rows that score prompt tokens (prompt_logprobs). A step with embedding requests
        also sets inputs.pooled (it runs eagerly: graphs return logits only)."""
        rows = inputs.logits_indices
        scoring = inputs.prompt_logits_indices.shape[0] > 0
        pooling = inputs.pool_rows is not None
        if self.lora_batch is not None:
            self.lora_batch.set(inputs.lora_token_slots)
        # Adapters ride in the graphs when they were captured with the LoRA kernels (--enable-lora).
        graphed_loras = inputs.lora_token_slots is None or self.graphs is None or self.graphs.lora_batch is not None
        if (not scoring and not pooling and graphed_loras and self.graphs is not None
                and self.graphs.can_run(inputs.meta, rows.shape[0])):
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta, inputs.lora_token_slots)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if pooling:
            inputs.pooled = pool_rows(hidden, inputs.pool_rows, inputs.pool_offsets)
        if scoring:
            rows = torch.cat([rows, inputs.prompt_logits_indices])
        return self.model.compute_logits(hidden[rows])


def _pack(fields: tuple[np.ndarray, ...], num_seqs: int, width: int, max_q: int, max_k: int,
          decode_only: bool) -> PackedStep:
    header = np.array([num_seqs, width, max_q, max_k, decode_only, *(len(f) for f in fields)], np.int64)
    return PackedStep(header, torch.from_numpy(np.concatenate(fields).astype(np.int32)))


def _logits_rows(items: list, cu: np.ndarray, sampling: np.ndarray) -> np.ndarray:
    """The rows whose logits are sampled: each sampling sequence's last token, and with speculative decoding
    also the rows before it that verify its draft tokens (1 + num_spec_tokens rows, in order)."""
    ends = cu[1:][sampling]
    num_rows = np.fromiter((s.num_spec_tokens for s in items), np.int64, len(items))[sampling] + 1
    if (num_rows == 1).all():
        return ends - 1
    first = np.cumsum(num_rows) - num_rows
    return np.repeat(ends - num_rows - first, num_rows) + np.arange(int(num_rows.sum()))
