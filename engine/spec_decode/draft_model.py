"""Method draft_model: a smaller model with the target's vocabulary proposes k tokens per sequence, one decode
step at a time, over a paged KV cache of its own that the target's block tables index.

The draft's cache mirrors the target's: every target step runs through the draft too (same tokens, positions
and slots, copy-on-write copies included), so whatever KV the target holds (prefix-cache hits, recomputed
sequences) the draft holds as well, and a draft position rejected by the target is written again by the next
step like the target's. The proposal steps add the KV of the new tokens; the verify step then writes those
positions again with the same tokens.

A draft token of a sampled row is drawn from the draft's distribution at the row's temperature (q), kept for
the rejection sampler; greedy rows take the draft's argmax (q is then not needed).
"""
from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import torch

from engine.executor import PLACEHOLDER
from engine.model_runner import StepInputs
from engine.request import Sequence
from engine.runner_setup import ModelPlan, build_runner, plan_model
from engine.sampler import gumbel_argmax
from engine.scheduler import ScheduledSeq
from engine.spec_decode.config import SpeculativeConfig

log = logging.getLogger(__name__)
_FLAG = "--speculative-config"


class DraftModel:
    def __init__(self, spec: SpeculativeConfig, target: ModelPlan, num_blocks: int, vocab_size: int,
                 target_vocab: dict[str, int], device: torch.device) -> None:
        cfg = target.config
        if cfg.tensor_parallel_size > 1:
            raise ValueError(f"{_FLAG}: method draft_model runs with tensor_parallel_size 1 only.")
        draft_cfg = replace(cfg, model=spec.model, speculative_config=None, enable_lora=False, lora_modules=(),
                            max_model_len=target.max_model_len, num_kv_blocks=num_blocks, enforce_eager=True,
                            dtype=cfg.dtype)
        try:
            self.plan = plan_model(draft_cfg)
            built = build_runner(self.plan, device)
        except (ValueError, OSError) as e:
            raise ValueError(f"{_FLAG}: the draft model {spec.model!r} cannot be used: {e}") from None
        draft_vocab = built.loaded.tokenizer.get_vocab() if built.loaded.tokenizer is not None else None
        if self.plan.model_config.vocab_size != vocab_size or (draft_vocab is not None and draft_vocab != target_vocab):
            raise ValueError(f"{_FLAG}: the draft model {spec.model!r} has another vocabulary "
                             f"({self.plan.model_config.vocab_size} tokens) than the target ({vocab_size}); a draft "
                             "model must share the target's tokenizer.")
        self.runner, self.device = built.runner, device
        self.generator = torch.Generator(device=device).manual_seed(cfg.seed + 1)
        self.probs: dict[int, torch.Tensor] = {}     # seq_id -> [k, V] the distributions its drafts came from
        log.info("speculative decoding: draft model %s (%.1f MB of weights), %d tokens per step", spec.model,
                 built.model_weight_bytes / 1e6, spec.num_speculative_tokens)

    @torch.inference_mode()
    def mirror(self, inputs: StepInputs, block_copies: list[tuple[int, int]]) -> None:
        """Runs the target's step through the draft so that its cache holds the same positions."""
        self.runner.copy_blocks(block_copies)
        self.runner.model(inputs.input_ids, inputs.positions, inputs.meta)

    @torch.inference_mode()
    def propose(self, items: list[ScheduledSeq]) -> None:
        """Replaces the placeholder drafts of the scheduled sequences (num_spec_tokens each) by the draft
        model's tokens, k decode steps for the batch."""
        self.probs = {}
        seqs = [i.seq for i in items]
        k = np.array([i.num_spec_tokens for i in items])
        width = max(len(s.block_table) for s in seqs)
        block_tables = np.zeros((len(seqs), width), np.int64)
        for row, seq in enumerate(seqs):
            block_tables[row, :len(seq.block_table)] = seq.block_table
        tokens = np.array([s.token_ids[-1] for s in seqs], np.int64)
        start = np.array([s.num_tokens - 1 for s in seqs], np.int64)
        temperature = torch.tensor([s.params.temperature for s in seqs], device=self.device)
        greedy = [s.params.greedy for s in seqs]
        drafts = np.zeros((len(seqs), int(k.max())), np.int64)
        all_probs = None if all(greedy) else torch.zeros(len(seqs), int(k.max()), self.runner.model.config.vocab_size,
                                                             device=self.device)
        rows = np.arange(len(seqs))
        for j in range(int(k.max())):
            rows = rows[k[rows] > j]             # sequences still proposing
            inputs = self.runner.decode_inputs(tokens[rows], start[rows] + j, block_tables[rows])
            logits = self.runner.forward(inputs).float()
            picked, probs = self._pick(logits, temperature[rows], [greedy[r] for r in rows], [seqs[r] for r in rows])
            tokens[rows] = drafts[rows, j] = picked
            if probs is not None:
                all_probs[torch.from_numpy(rows).to(self.device), j] = probs
        for row, seq in enumerate(seqs):
            seq.spec_token_ids = drafts[row, :k[row]].tolist()
            if not greedy[row]:
                self.probs[seq.seq_id] = all_probs[row, :k[row]]

    def _pick(self, logits: torch.Tensor, temperature: torch.Tensor, greedy: list[bool], seqs: list[Sequence]
              ) -> tuple[np.ndarray, torch.Tensor | None]:
        if all(greedy):
            return logits.argmax(-1).numpy(force=True), None
        x = logits / temperature.clamp_min(1e-5).unsqueeze(1)
        probs = x.softmax(-1)
        uniform = torch.empty_like(x).uniform_(generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.generator is not None and not greedy[i]:
                uniform[i].uniform_(generator=seq.generator)
        picked = torch.where(torch.tensor(greedy, device=x.device), logits.argmax(-1), gumbel_argmax(x, uniform))
        return picked.numpy(force=True), probs

    def probs_rows(self, rows: list[Sequence], drafts: list[list[int]]) -> torch.Tensor:
        """[R, V] the draft distribution of every verify row (the DraftTensors layout; rows: the sequence of each
        row), zeros where no draft is verified."""
        out = torch.zeros(len(rows), self.runner.model.config.vocab_size, device=self.device)
        row = 0
        for tokens in drafts:
            probs = self.probs.get(rows[row].seq_id)
            if tokens and probs is not None:
                out[row:row + len(tokens)] = probs[:len(tokens)]
            row += len(tokens) + 1
        return out


def placeholder_drafts(k: int) -> list[int]:
    """What a draft_model sequence asks the scheduler for before the draft runs (filled by DraftModel.propose)."""
    return [PLACEHOLDER] * k
