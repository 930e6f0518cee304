"""This process's place in the tensor-parallel group, and the collectives the model's layers call.

A single-process engine never initialises anything here: rank 0 of a group of 1, and every collective is
the identity, so the model code is the same with and without tensor parallelism.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.models.config import ModelConfig

# A collective that waits longer than this fails instead of hanging (a peer that died or stopped).
COLLECTIVE_TIMEOUT = timedelta(seconds=int(os.environ.get("PAGEDSERVE_TP_TIMEOUT_S", "300")))
# The step channel waits for the next step however long the server stays idle; a dead peer still breaks it
# at once (its sockets close) and workers also watch their parent.
IDLE_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class DistInit:
    """How the ranks meet: torch.distributed's TCP rendezvous at master_addr:master_port."""
    world_size: int
    master_addr: str
    master_port: int
    backend: str                      # "gloo" (CPU) or "nccl" (CUDA)


@dataclass
class _State:
    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None        # the model's collectives (gloo or NCCL)
    cpu_group: dist.ProcessGroup | None = None    # the step channel (gloo: host tensors)


_state = _State()


def tp_rank() -> int:
    return _state.rank


def tp_world_size() -> int:
    return _state.world_size


def cpu_group() -> dist.ProcessGroup | None:
    return _state.cpu_group


def init(rank: int, how: DistInit) -> None:
    """Joins the group (blocks until every rank has joined, or fails after COLLECTIVE_TIMEOUT)."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; shut the previous "
                           "tensor-parallel engine down first (LLM.shutdown()).")
    dist.init_process_group(how.backend, init_method=f"tcp://{how.master_addr}:{how.master_port}", rank=rank,
                            world_size=how.world_size, timeout=COLLECTIVE_TIMEOUT)
    _state.rank, _state.world_size, _state.group = rank, how.world_size, dist.group.WORLD
    # The step channel must outlive idle periods: its own gloo group (host tensors), no short timeout.
    _state.cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _state.rank, _state.world_size, _state.group, _state.cpu_group = 0, 1, None, None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the ranks, in place (row-parallel layers: each rank holds a partial sum)."""
    if _state.world_size > 1:
        dist.all_reduce(x, group=_state.group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] on every rank -> [..., world * n] in rank order (vocab-parallel logits)."""
    if _state.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.world_size)]
    dist.all_gather(parts, x.contiguous(), group=_state.group)
    return torch.cat(parts, dim=-1)


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's value (e.g. KV blocks: every rank must allocate the same number)."""
    if _state.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_state.cpu_group)
    return int(t.item())


def all_reduce_sum(value: int) -> int:
    """The sum of every rank's value (e.g. bytes of weights: each rank holds its slice)."""
    if _state.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=_state.cpu_group)
    return int(t.item())


# -- shapes of one rank's shard ---------------------------------------------------------------------------
def check_divisible(cfg: ModelConfig, tp: int) -> None:
    """ValueError with the reason when the model cannot be split over tp ranks."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}.")
    if cfg.num_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {cfg.num_heads} attention heads; "
                         "choose a divisor of the head count.")
    kv = cfg.num_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(f"tensor_parallel_size {tp} and the model's {kv} KV heads: one must divide the other "
                         "(KV heads are split across ranks, or replicated when there are fewer than ranks).")
    if cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the MLP width {cfg.intermediate_size}.")


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocabulary rows per rank: the vocabulary is padded up to a multiple of tp (the pad is never sampled)."""
    return -(-vocab_size // tp)


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model's shape as one rank of tp sees it (every per-rank size; the vocabulary is this rank's rows)."""
    check_divisible(cfg, tp)
    return replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=max(1, cfg.num_kv_heads // tp),
                   intermediate_size=cfg.intermediate_size // tp, vocab_size=padded_vocab(cfg.vocab_size, tp))


def kv_head_start(num_kv_heads: int, rank: int, tp: int) -> int:
    """First KV head of a rank: a contiguous split, or with fewer heads than ranks, tp / num_kv_heads
    neighbouring ranks share (replicate) one head."""
    return rank * num_kv_heads // tp
