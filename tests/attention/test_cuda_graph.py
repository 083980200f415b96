"""CUDA-graph decode: bucketing and padding on the CPU; capture and replay on a GPU.

On the CPU a stand-in graph re-runs the captured function on replay (writing into the
captured output, as a CUDA graph does), so the whole padded path (static buffers, padding
rows that write and read no K/V, fixed split count) is checked against eager decode with the
triton backend under the interpreter. Only the capture itself needs a GPU.
"""

import pytest
import torch

from servelm.attention.forward_batch import ForwardBatch
from servelm.core.runner_state import score_item
from servelm.engine.sequence import Sequence
from servelm.protocol import RequestTimings, SamplingParams
from servelm.runner.cuda_graph import (
    PAD_SLOT,
    CudaGraphRunner,
    GraphedModel,
    StaticDecodeInputs,
    capture_sizes,
    padded_size,
)

# Triton: compiled on a GPU, interpreted on the CPU (conftest). The stand-in graph runs on both.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_capture_sizes_and_bucketing():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(32)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 8, 9, 31, 32)] == [1, 4, 8, 8, 16, 32, 32]
    assert padded_size(33, sizes) is None
    with pytest.raises(ValueError):
        capture_sizes(0)


def _long(values):
    return torch.tensor(values, dtype=torch.long, device=DEVICE)


def _decode_batch(seq_lens, block_size=4, width=None):
    tables = [[10 * b + i for i in range(-(-n // block_size))] for b, n in enumerate(seq_lens)]
    width = width or max(map(len, tables))
    slots = [tables[b][(n - 1) // block_size] * block_size + (n - 1) % block_size
             for b, n in enumerate(seq_lens)]
    return ForwardBatch(
        input_ids=_long([7 + b for b in range(len(seq_lens))]),
        positions=_long([n - 1 for n in seq_lens]), slot_mapping=_long(slots),
        block_tables=_long([r + [0] * (width - len(r)) for r in tables]),
        query_start_loc=list(range(len(seq_lens) + 1)), context_lens=[n - 1 for n in seq_lens],
        seq_lens=list(seq_lens), num_decodes=len(seq_lens), block_size=block_size,
        logits_indices=_long(list(range(len(seq_lens)))))


def test_static_inputs_pad_with_rows_that_touch_no_kv():
    static = StaticDecodeInputs(8, 6, DEVICE)
    static.fill(_decode_batch([9, 2, 5, 6, 7, 1, 3]), 8)  # leaves stale rows behind
    batch = _decode_batch([9, 2, 5])
    static.fill(batch, 4)
    assert static.input_ids[:4].tolist() == [7, 8, 9, 0]
    assert static.slot_mapping[:4].tolist() == batch.slot_mapping.tolist() + [PAD_SLOT]
    assert static.seq_lens[:4].tolist() == [9, 2, 5, 0]
    assert torch.equal(static.block_tables[:3, :3], batch.block_tables.int())


class EagerGraph:
    """CPU stand-in for a CUDA graph: replay re-runs the function into the captured output."""

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self):
        self.out.copy_(self.fn())


def _runner_and_engine(tiny_hf, tiny_engine, max_batch):
    engine = tiny_engine(tiny_hf("llama"), attention_backend="triton", num_blocks=64,
                         device=DEVICE.type)
    runner = engine.runner
    graphs = CudaGraphRunner(runner.model, runner.backend, max_batch=max_batch, max_blocks=8,
                             device=DEVICE, make_graph=EagerGraph)
    return engine, runner, graphs


def _decode_step(engine, prompts):
    """Prefill `prompts` eagerly, then schedule one decode step for all of them."""
    seqs = []
    for i, p in enumerate(prompts):
        seq = Sequence(f"r{i}", i, list(p), SamplingParams(max_tokens=4), RequestTimings(), 4)
        engine.block_manager.allocate(seq, len(p) + 1)
        engine.runner.score([score_item(seq.token_ids, seq.block_table, 0, len(p))])
        seq.token_ids.append(11 + i)  # the token this decode step feeds in
        seqs.append(seq)
    return [score_item(s.token_ids, s.block_table, len(s.token_ids) - 1, 1) for s in seqs]


def test_padded_replay_matches_eager_decode(tiny_hf, tiny_engine):
    engine, runner, graphs = _runner_and_engine(tiny_hf, tiny_engine, max_batch=4)
    assert graphs.maybe_run(_decode_batch([3])) is None  # nothing captured yet
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4]
    step = _decode_step(engine, [[1, 2, 3, 4, 5], [9, 8], [5, 5, 5, 5, 5, 5, 5, 5, 5]])
    fb = runner._build_forward_batch(step)
    kv_before = runner.kv_cache.k.clone()
    graphed = graphs.maybe_run(fb)  # 3 sequences -> the size-4 graph, one padding row
    assert graphed.shape[0] == 3
    kv_after_graph = runner.kv_cache.k.clone()
    written = (kv_after_graph != kv_before).any(dim=(0, 2, 3)).nonzero().flatten()
    assert sorted(written.tolist()) == sorted(fb.slot_mapping.tolist())  # padding wrote nothing
    fb.attn_metadata = runner.backend.build_metadata(fb)
    eager = runner.model(fb.input_ids, fb.positions, fb)
    torch.testing.assert_close(graphed, eager, atol=1e-5, rtol=1e-5)


def test_mixed_or_oversized_batches_fall_back_to_eager(tiny_hf, tiny_engine):
    _, runner, graphs = _runner_and_engine(tiny_hf, tiny_engine, max_batch=2)
    graphs.capture()
    assert graphs.maybe_run(_decode_batch([3, 4, 5])) is None  # more than the largest size
    assert graphs.maybe_run(_decode_batch([3], width=9)) is None  # block table too wide
    mixed = _decode_batch([3, 4])
    mixed.num_decodes = 1
    assert graphs.maybe_run(mixed) is None
    wrapped = GraphedModel(runner.model, graphs)
    fb = _decode_batch([3, 5])
    fb.attn_metadata = runner.backend.build_metadata(fb)
    assert wrapped(fb.input_ids, fb.positions, fb).shape == (2, 64)


def test_torch_backend_is_refused(tiny_hf, tiny_engine):
    engine = tiny_engine(tiny_hf("llama"))
    with pytest.raises(ValueError, match="triton"):
        CudaGraphRunner(engine.runner.model, engine.runner.backend, 4, 8, torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_cuda_graph_greedy_tokens_match_eager(tiny_hf, tiny_engine):
    from servelm.llm import LLM

    hf = tiny_hf("llama")
    prompts = [[1, 2, 3, 4, 5], [9, 8], [5] * 9]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    results = []
    for use_graphs in (False, True):
        engine = tiny_engine(hf, attention_backend="triton", device="cuda")
        runner = engine.runner
        if use_graphs:
            graphs = CudaGraphRunner(runner.model, runner.backend, 4, 16, torch.device("cuda"))
            assert graphs.capture() > 0
            runner.model = GraphedModel(runner.model, graphs)
        outs = LLM(engine=engine).generate(prompts, params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
    assert results[0] == results[1]
