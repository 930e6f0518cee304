"""TritonAttentionBackend == the engine's torch backend (KV write + attention) on engine-shaped batches."""
from __future__ import annotations

import pytest
import torch

import engine.attention.triton as triton_backend
from engine.attention.torch_ref import TorchAttentionBackend
from engine.attention.triton import TritonAttentionBackend
from tests.kernels.paged_cases import DEVICE, EngineBatch, make_engine_batch

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def _batch(pairs: list[tuple[int, int]], block_size: int, seed: int, pad_rows: int = 0) -> EngineBatch:
    return make_engine_batch(pairs, HEADS, KV_HEADS, HEAD_DIM, block_size, seed, pad_rows)


def assert_backends_agree(backend: TritonAttentionBackend, batch: EngineBatch) -> None:
    q, k, v, k_cache, v_cache, meta = batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta
    # The torch backend's batched decode reads whole blocks and masks scores, so it needs finite unused
    # slots; the Triton backend gets the NaN-poisoned cache and must never read those slots.
    kc_ref, vc_ref = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    ref = TorchAttentionBackend().forward(q, k, v, kc_ref, vc_ref, meta, HEAD_DIM ** -0.5)
    assert torch.equal(k_cache.nan_to_num(0.0), kc_ref)  # same slots written, same bits
    assert torch.equal(v_cache.nan_to_num(0.0), vc_ref)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_prefill_and_decode_batch(block_size):
    backend = TritonAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, max_num_seqs=8, device=DEVICE, dtype=torch.float32)
    # fresh prompt, chunk after a cached prefix, prefix-cache hit of whole blocks, two decode rows
    pairs = [(0, 9), (12, 7), (2 * block_size, 3), (5, 1), (33, 1)]
    assert_backends_agree(backend, _batch(pairs, block_size, seed=block_size))


def test_decode_only_batch_with_graph_padding_rows(monkeypatch):
    monkeypatch.setattr(triton_backend, "_num_sms", lambda device: 132)  # H100-like: forces split-KV
    backend = TritonAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, max_num_seqs=8, device=DEVICE, dtype=torch.float32)
    # small batches split the keys (up to 16 ways), batches that fill the GPU on their own do not
    assert backend.num_splits(5) == 16 and backend.num_splits(200) == 1
    assert backend.workspace.shape[0] >= 8 * backend.num_splits(8)
    batch = _batch([(0, 1), (16, 1), (40, 1)], 16, seed=1, pad_rows=2)
    assert batch.meta.is_decode_only
    assert_backends_agree(backend, batch)


def test_backend_checks_its_arguments():
    with pytest.raises(ValueError, match="multiple"):
        TritonAttentionBackend(6, 4, 32, 4, "cpu", torch.float32)
    backend = TritonAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, max_num_seqs=2, device=DEVICE, dtype=torch.float32)
    with pytest.raises(ValueError, match="max_num_seqs"):
        backend.forward(*_batch([(3, 1)] * 3, 16, seed=2).args(1.0))

