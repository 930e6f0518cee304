"""Scheduler: budgets, chunked prefill, mixed steps, preemption order, abort."""
from __future__ import annotations

from engine.block_manager import BlockManager
from engine.request import Request, SeqStatus, Sequence
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

BS = 4


def make_seq(n_tokens: int, seq_id: int) -> Sequence:
    tokens = [100 + seq_id] * n_tokens
    req = Request(f"r{seq_id}", tokens, SamplingParams(), max_tokens=64)
    seq = Sequence(seq_id, req, 0, list(tokens), n_tokens)
    req.seqs.append(seq)
    return seq


def complete(sched_out) -> None:
    """Pretend the model ran: advance computed tokens and append a token to sampling sequences."""
    for item in sched_out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        if item.samples:
            item.seq.token_ids.append(1)


def make(num_blocks=64, max_seqs=8, budget=16):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=False)
    return bm, Scheduler(bm, max_seqs, budget)


def test_token_budget_chunks_long_prompt_and_mixes_with_decodes():
    bm, s = make(budget=16)
    a = make_seq(10, 0)
    s.add(a)
    out = s.schedule()
    assert [(i.seq.seq_id, i.num_new_tokens, i.samples) for i in out.scheduled] == [(0, 10, True)]
    complete(out)
    b = make_seq(40, 1)
    s.add(b)
    out = s.schedule()      # a decodes (1 token), b gets the remaining 15 as a first chunk
    assert [(i.seq.seq_id, i.num_new_tokens, i.samples) for i in out.scheduled] == [(0, 1, True), (1, 15, False)]
    assert not out.is_decode_only and out.num_tokens == 16
    complete(out)
    out = s.schedule()
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(0, 1), (1, 15)]
    complete(out)
    out = s.schedule()
    assert [(i.seq.seq_id, i.num_new_tokens, i.samples) for i in out.scheduled] == [(0, 1, True), (1, 10, True)]


def test_sequence_budget_limits_admission():
    bm, s = make(max_seqs=2, budget=100)
    for i in range(3):
        s.add(make_seq(3, i))
    out = s.schedule()
    assert [i.seq.seq_id for i in out.scheduled] == [0, 1]
    assert len(s.waiting) == 1


def test_preempts_most_recent_when_blocks_run_out():
    bm, s = make(num_blocks=5, budget=100)   # 4 usable blocks
    a, b = make_seq(4, 0), make_seq(4, 1)
    s.add(a)
    s.add(b)
    complete(s.schedule())                    # each holds 1 full block, each now has 5 tokens
    complete(s.schedule())
    for _ in range(4):                        # position 8 needs a third block each: 6 > 4
        complete(s.schedule())
    assert s.num_preemptions >= 1
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert s.waiting[0] is b and a.status is SeqStatus.RUNNING
    assert bm.num_free_blocks == 4 - len(a.block_table)


def test_abort_waiting_and_running_frees_blocks():
    bm, s = make(budget=100)
    a, b = make_seq(9, 0), make_seq(5, 1)
    s.add(a)
    complete(s.schedule())
    s.add(b)
    s.finish(a, "abort")
    s.finish(b, "abort")
    assert not s.running and not s.waiting
    assert bm.num_free_blocks == bm.num_usable_blocks
    s.finish(a, "abort")                     # idempotent
    assert bm.num_free_blocks == bm.num_usable_blocks
