"""Deterministic mode's attention (TorchAttentionBackend.set_deterministic): a position's
output is the same bits whether it is computed in a fresh prefill, in any chunk of a chunked
one, or as a decode in a batch with other sequences, and it is attention (it matches the
default path's SDPA to float32 noise)."""

import pytest
import torch

from servelm.attention.forward_batch import ForwardBatch
from servelm.attention.kv_cache import KVCache
from servelm.attention.torch_backend import TorchAttentionBackend
from servelm.config import ModelConfig

H, K, D, BS, LEN = 6, 2, 32, 4, 23
CONFIG = ModelConfig("llama", 32, H * D, 64, 1, H, K, D, 64)


def _qkv(seq: int, pos: int):
    """The q, k, v of a sequence's position: the same in every scenario."""
    g = torch.Generator().manual_seed(seq * 1000 + pos)
    return (torch.randn(H, D, generator=g), torch.randn(K, D, generator=g),
            torch.randn(K, D, generator=g))


def _long(x):
    return torch.tensor(x, dtype=torch.long)


def _step(backend, spans):
    """spans: (seq, table, start, n) each, single-token ones first -> {(seq, pos): [H, D]}."""
    q, k, v, positions, slots, tables, qsl = [], [], [], [], [], [], [0]
    for seq, table, start, n in spans:
        for p in range(start, start + n):
            a, b, c = _qkv(seq, p)
            q.append(a), k.append(b), v.append(c)
            positions.append(p)
            slots.append(table[p // BS] * BS + p % BS)
        tables.append(table)
        qsl.append(qsl[-1] + n)
    width = max(map(len, tables))
    fb = ForwardBatch(
        input_ids=_long([0] * qsl[-1]), positions=_long(positions), slot_mapping=_long(slots),
        block_tables=_long([t + [0] * (width - len(t)) for t in tables]), query_start_loc=qsl,
        context_lens=[s for _, _, s, _ in spans], seq_lens=[s + n for _, _, s, n in spans],
        num_decodes=sum(n == 1 for *_, n in spans), block_size=BS, logits_indices=_long([0]))
    fb.attn_metadata = backend.build_metadata(fb)
    out = backend.forward(0, torch.stack(q), torch.stack(k), torch.stack(v), fb)
    rows = [(seq, p) for seq, _, start, n in spans for p in range(start, start + n)]
    return dict(zip(rows, out))


def _backend(deterministic: bool):
    backend = TorchAttentionBackend(KVCache(CONFIG, 64, BS, torch.float32, torch.device("cpu")),
                                    H, D ** -0.5)
    if deterministic:
        backend.set_deterministic()
    return backend


TABLE = [9, 3, 14, 0, 7, 21]  # blocks of sequence 0, anywhere in the pool
OTHER = [30, 31, 32, 33, 34, 35, 36, 37]  # sequence 1's


def _whole(backend):
    return _step(backend, [(0, TABLE, 0, LEN)])


def _chunked(backend, cuts=(5, 9, 9)):
    out, start = {}, 0
    for n in cuts:
        out.update(_step(backend, [(1, OTHER, 0, 3), (0, TABLE, start, n)] if start == 5 else
                         [(0, TABLE, start, n)]))
        start += n
    return out


def _decoded(backend, prefill=10):
    out = _step(backend, [(0, TABLE, 0, prefill)])
    _step(backend, [(1, OTHER, 0, 12)])
    for p in range(prefill, LEN):  # a decode beside another sequence's decode, first or second
        spans = [(1, OTHER, 12 + p - prefill, 1), (0, TABLE, p, 1)]
        out.update(_step(backend, spans if p % 2 else spans[::-1]))
    return out


def test_a_position_is_the_same_bits_in_prefill_chunks_and_decodes():
    backend = _backend(True)
    whole = _whole(backend)
    assert backend.deterministic_steps == 1  # the per-row path ran
    chunked, decoded = _chunked(_backend(True)), _decoded(_backend(True))
    for p in range(LEN):
        assert torch.equal(whole[(0, p)], chunked[(0, p)]), p
        assert torch.equal(whole[(0, p)], decoded[(0, p)]), p


def test_it_is_the_default_paths_attention():
    det, default = _whole(_backend(True)), _whole(_backend(False))
    for p in range(LEN):
        torch.testing.assert_close(det[(0, p)], default[(0, p)], rtol=1e-5, atol=1e-5)


def test_deterministic_mode_needs_the_cpp_kernel(cpu_kernel_mode):
    cpu_kernel_mode("attention", "torch")
    backend = TorchAttentionBackend(KVCache(CONFIG, 8, BS, torch.float32, torch.device("cpu")),
                                    H, D ** -0.5)
    with pytest.raises(ValueError, match="paged attention kernel"):
        backend.set_deterministic()
