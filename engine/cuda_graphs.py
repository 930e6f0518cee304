"""Decode-only steps replayed from CUDA graphs captured per batch-size bucket.

Every graph input lives in a static buffer sized for the largest bucket. A batch of n decodes is
copied into the first n rows; rows n..bucket are padding (slot -1: no KV write; seq_len 0: attention
returns 0; block table of the null block), so stale rows of a previous, larger batch never leak in.
On CPU the same buffers, buckets and padding are used and "replay" simply calls the function on
them eagerly, so the logic real graphs depend on is exercised without a GPU.

With LoRA adapters, each row's adapter slot is one more static input (-1: the base model, and the padding):
the graphs hold the batched LoRA kernels, so decode steps with adapters replay too.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionMetadata
from engine.lora.layers import LoRABatch
from engine.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_batch (max_batch itself always included)."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_batch]
    buckets += list(range(16, max_batch, 8))
    return sorted(set(buckets + [max_batch]))


@dataclass
class _StaticInputs:
    input_ids: torch.Tensor     # [max_bs]
    positions: torch.Tensor     # [max_bs]
    slot_mapping: torch.Tensor  # [max_bs]
    seq_lens: torch.Tensor      # [max_bs]
    cu_seqlens_q: torch.Tensor  # [max_bs + 1] = arange: every row is one query token
    block_tables: torch.Tensor  # [max_bs, max_blocks_per_seq]
    lora_slots: torch.Tensor    # [max_bs]: each row's LoRA slot, -1 for none


class GraphRunner:
    def __init__(self, model: LlamaForCausalLM, max_batch: int, max_model_len: int, block_size: int,
                 device: torch.device, use_graphs: bool) -> None:
        self.model, self.device = model, device
        self.buckets = graph_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.max_model_len = max_model_len
        self.use_graphs = use_graphs and device.type == "cuda"
        max_blocks = -(-max_model_len // block_size)
        i32 = dict(dtype=torch.int32, device=device)
        self.static = _StaticInputs(
            input_ids=torch.zeros(self.max_batch, **i32), positions=torch.zeros(self.max_batch, **i32),
            slot_mapping=torch.full((self.max_batch,), -1, **i32), seq_lens=torch.zeros(self.max_batch, **i32),
            cu_seqlens_q=torch.arange(self.max_batch + 1, **i32),
            block_tables=torch.zeros(self.max_batch, max_blocks, **i32),
            lora_slots=torch.full((self.max_batch,), -1, **i32))
        self.lora_batch: LoRABatch | None = None    # set with --enable-lora, before capture
        self.logits: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def bucket_for(self, num_seqs: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_seqs)]

    def can_run(self, meta: AttentionMetadata, num_sampling_rows: int) -> bool:
        num_seqs = meta.seq_lens.shape[0]
        return (meta.is_decode_only and num_seqs <= self.max_batch and num_sampling_rows == num_seqs
                and meta.block_tables.shape[1] <= self.static.block_tables.shape[1])

    def _meta(self, bs: int, width: int | None) -> AttentionMetadata:
        s = self.static
        return AttentionMetadata(slot_mapping=s.slot_mapping[:bs], block_tables=s.block_tables[:bs, :width],
                                 seq_lens=s.seq_lens[:bs], cu_seqlens_q=s.cu_seqlens_q[:bs + 1],
                                 max_seqlen_q=1, max_seqlen_k=self.max_model_len, is_decode_only=True)

    @torch.inference_mode()
    def _forward(self, bs: int, width: int | None = None) -> torch.Tensor:
        """width: block-table columns to pass (None = all, as captured; eager CPU runs pass the live width)."""
        s = self.static
        if self.lora_batch is not None:
            self.lora_batch.set(s.lora_slots[:bs])
        hidden = self.model(s.input_ids[:bs], s.positions[:bs], self._meta(bs, width))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm every bucket eagerly (compiles Triton kernels), then capture largest first into one pool."""
        if not self.use_graphs:
            return
        for bs in self.buckets:
            self._forward(bs)
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bs] = self._forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured %d CUDA graphs for decode batch sizes %s", len(self.graphs), self.buckets)

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             lora_slots: torch.Tensor | None = None) -> int:
        """Copy a decode batch into the static buffers and pad up to its bucket; returns the bucket."""
        n = input_ids.shape[0]
        bs = self.bucket_for(n)
        s = self.static
        width = meta.block_tables.shape[1]
        s.input_ids[:n].copy_(input_ids)
        s.positions[:n].copy_(positions)
        s.slot_mapping[:n].copy_(meta.slot_mapping)
        s.seq_lens[:n].copy_(meta.seq_lens)
        s.block_tables[:n, :width].copy_(meta.block_tables)
        if lora_slots is not None:
            s.lora_slots[:n].copy_(lora_slots)
        else:
            s.lora_slots[:n].fill_(-1)
        s.lora_slots[n:bs].fill_(-1)
        # padding rows: no KV write, empty attention, null block, token 0
        s.input_ids[n:bs].zero_()
        s.positions[n:bs].zero_()
        s.slot_mapping[n:bs].fill_(-1)
        s.seq_lens[n:bs].zero_()
        s.block_tables[n:bs].zero_()
        return bs

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n, vocab] of a decode-only batch of n sequences (lora_slots: each one's adapter slot)."""
        n = input_ids.shape[0]
        bs = self.load(input_ids, positions, meta, lora_slots)
        if bs in self.graphs:
            self.graphs[bs].replay()
            return self.logits[bs][:n]
        return self._forward(bs, meta.block_tables.shape[1])[:n]
