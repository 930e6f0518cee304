"""The graph runner's buckets, static buffers and padding (on CPU "replay" runs eagerly on them)."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.cuda_graphs import graph_buckets
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.helpers import make_checkpoint, random_prompts


def test_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(5) == [1, 2, 4, 5]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("g"), "qwen3")
    return LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", block_size=4, max_num_seqs=16,
                                  async_scheduling=False))


def decode_inputs(engine, n: int, seed: int):
    """Prefill n prompts, then return the prepared inputs of the following decode-only step."""
    for i, p in enumerate(random_prompts(1000, [3 + 5 * i for i in range(n)], seed=seed)):
        engine.add_request(f"{seed}-{i}", p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    sched = engine.scheduler.schedule()
    assert sched.is_decode_only and len(sched.scheduled) == n
    return sched, engine.runner.prepare(sched)


def finish(engine):
    for rid in list(engine.requests):
        engine.abort_request(rid)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_replay_equals_eager_with_padding_and_stale_rows(engine):
    graphs = engine.runner.graphs
    assert graphs is not None and not graphs.use_graphs  # CPU: same buffers, eager "replay"
    _, big = decode_inputs(engine, 7, seed=1)             # bucket 8 fills rows 0..6
    graphs.run(big.input_ids, big.positions, big.meta)
    finish(engine)
    sched, inputs = decode_inputs(engine, 3, seed=2)      # bucket 4: row 3 is padding over a stale row
    logits = graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
    s = graphs.static
    assert graphs.bucket_for(3) == 4
    assert s.slot_mapping[3].item() == -1 and s.seq_lens[3].item() == 0
    assert s.block_tables[3].abs().sum().item() == 0 and s.input_ids[3].item() == 0
    assert torch.equal(s.seq_lens[:3], inputs.meta.seq_lens)
    # bitwise equal to the eager forward on the padded bucket, and equal to the unpadded eager batch
    padded = graphs._forward(4, inputs.meta.block_tables.shape[1])[:3]
    assert torch.equal(logits, padded)
    eager = engine.model.compute_logits(engine.model(inputs.input_ids, inputs.positions, inputs.meta))
    torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits.argmax(-1), eager.argmax(-1))
    finish(engine)


def test_graph_path_and_eager_path_generate_the_same(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    prompts = random_prompts(1000, [4, 9, 17], seed=3)
    outs = []
    for eager in (False, True):
        eng = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", block_size=4,
                                     enforce_eager=eager))
        assert (eng.runner.graphs is None) == eager
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        tokens = {str(i): [] for i in range(len(prompts))}
        while eng.has_unfinished_requests():
            for d in eng.step():
                tokens[d.request_id] += d.seqs[0].new_token_ids
        outs.append(tokens)
    assert outs[0] == outs[1]
