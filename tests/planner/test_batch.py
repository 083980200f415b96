"""`plan batch`: a synchronous job, one document at a time vs batched.

The hand-worked job: 100 documents of 1,000 tokens, 100-token answers, Llama-3.1-8B bf16 on
one H100 (989 TFLOP/s bf16 at prefill MFU 0.5 = 494.5 TFLOP/s; 3.35 TB/s).
  prefill, one doc   (1,000 x 15,009,841,152 + 524,288 x 1,000 x 1,001 / 2) FLOP
                     = (1.5009841152e13 + 2.62406144e11) / 4.945e14 = 0.030884 s
  decode steps       100 - 1 = 99 (the prefill samples the first token), at the mean
                     context 1,000 + 100 / 2 - 1 = 1,049
  decode step, b     (15,009,841,152 weight B + b x (1,049 + 2) x 131,072 KV B) / 3.35e12
                     b = 1: 0.0045217 s; b = 100: 0.0085927 s (memory-bound both)
  one by one         100 x (0.030884 + 99 x 0.0045217) = 47.85 s
  one batch of 100   100 x 0.030884 + 99 x 0.0085927 = 3.939 s -> 12.15x
"""

import json

import pytest

from servelm.planner import cli
from servelm.planner.batch import BatchJob, plan_batch
from servelm.planner.errors import PlanInputError

PREFILL_ONE = (1000 * 15_009_841_152 + 524_288 * 1000 * 1001 / 2) / (989e12 * 0.5)


def decode_step(batch, context=1049):
    return (15_009_841_152 + batch * (context + 2) * 131_072) / 3.35e12


def wave(n):
    return n * PREFILL_ONE + 99 * decode_step(n)


def test_hundred_documents_by_hand(deploy):
    p = plan_batch(deploy(tp=1), BatchJob(100, 1000, 100))
    assert p.per_doc_s == pytest.approx(PREFILL_ONE + 99 * decode_step(1))
    assert p.sequential_time_s == pytest.approx(47.85, abs=0.01)
    assert (p.batch_size, p.num_waves) == (100, 1)
    assert p.batched_time_s == pytest.approx(wave(100)) and p.batched_time_s == \
        pytest.approx(3.939, abs=0.001)
    assert p.speedup == pytest.approx(12.15, abs=0.01)
    # memory: (70e9 - 16,060,522,496) / 131,072 = 411,525 tokens; / 1,100 = 374 documents
    assert p.memory_batch == 374
    # one by one, document i ends at i x per_doc_s: mean (100 + 1) / 2 x 0.4785 = 24.17 s
    assert p.sequential_mean_latency_s == pytest.approx(p.per_doc_s * 50.5)
    assert p.batched_mean_latency_s == pytest.approx(p.batched_time_s)


def test_max_batch_makes_waves(deploy):
    # 100 documents, at most 32 at once: waves of 32, 32, 32 and 4.
    p = plan_batch(deploy(tp=1), BatchJob(100, 1000, 100, max_batch=32))
    assert (p.batch_size, p.num_waves) == (32, 4)
    assert p.batched_time_s == pytest.approx(3 * wave(32) + wave(4))
    # mean latency: 32 documents end at each of w, 2w, 3w, and 4 at 3w + wave(4)
    w = wave(32)
    mean = (32 * (w + 2 * w + 3 * w) + 4 * (3 * w + wave(4))) / 100
    assert p.batched_mean_latency_s == pytest.approx(mean)
    assert not any("memory stops" in n for n in p.notes)


def test_memory_stops_the_batch(deploy):
    # Llama-3.1-70B on TP 4: pool 70e9 - 141,107,412,992 / 4 = 34,723,146,752 B per GPU,
    # / 81,920 B per token per GPU = 423,866 tokens; a document holds 4,000 + 500 = 4,500:
    # 94 at once, so 1,000 documents take ceil(1,000 / 94) = 11 waves.
    p = plan_batch(deploy("Llama-3.1-70B", tp=4), BatchJob(1000, 4000, 500))
    assert (p.memory_batch, p.batch_size, p.num_waves) == (94, 94, 11)
    assert any("memory stops the batch at 94" in n for n in p.notes)
    fp8 = plan_batch(deploy("Llama-3.1-70B", tp=4, kv_dtype="fp8"), BatchJob(1000, 4000, 500))
    assert fp8.memory_batch == 188  # half the bytes per token, twice the documents


def test_dp_attention_batches_per_gpu(deploy):
    # DeepSeek-V3 fp8 on 8 x H200, dp attention: 441,638 tokens per GPU (see
    # test_attention_parallel), a document cannot span GPUs: 8 x floor(441,638 / 1,100).
    d = deploy("DeepSeek-V3", "H200", tp=8, weight_dtype="fp8")
    p = plan_batch(d, BatchJob(10_000, 1000, 100))
    assert p.memory_batch == 8 * (441_638 // 1100) == 3208


def test_a_batch_window_costs_its_length(deploy):
    base = plan_batch(deploy(tp=1), BatchJob(100, 1000, 100))
    assert base.break_even_window_s == pytest.approx(base.sequential_time_s -
                                                     base.batched_time_s)
    w = plan_batch(deploy(tp=1), BatchJob(100, 1000, 100, window_s=60))
    assert w.batched_with_window_s == pytest.approx(60 + base.batched_time_s)
    assert w.batched_mean_latency_s == pytest.approx(60 + base.batched_time_s)
    # 60 s > the 43.9 s break-even: waiting for the batch loses to one by one.
    assert w.batched_with_window_s > w.sequential_time_s


def test_one_token_answers_are_prefill_only(deploy):
    p = plan_batch(deploy(tp=1), BatchJob(10, 1000, 1))
    assert p.per_doc_s == pytest.approx(PREFILL_ONE)
    assert p.batched_time_s == pytest.approx(10 * PREFILL_ONE)


def test_a_document_that_does_not_fit(deploy):
    p = plan_batch(deploy("Llama-3.1-405B", tp=1), BatchJob(10, 1000, 100))
    assert p.batch_size == 0 and p.sequential_time_s == float("inf")
    assert any("does not fit" in n for n in p.notes)


def test_bad_job_names_the_flag(capsys):
    for kw, flag in (({"num_docs": 0}, "--docs"), ({"max_batch": 0}, "--max-batch"),
                     ({"window_s": -1}, "--window")):
        with pytest.raises(PlanInputError, match=flag):
            BatchJob(**{"num_docs": 10, "input_len": 100, "output_len": 10, **kw})
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "batch", "--input-len", "0"])
    assert e.value.code == 2 and "--input-len" in capsys.readouterr().err


def test_cli_json(capsys):
    assert cli.main(["plan", "batch", "--docs", "100", "--input-len", "1000",
                     "--output-len", "100", "--decode-mfu", "0.5", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["batch_size"] == 100 and data["inputs"]["decode_mfu"] == 0.5
    # memory-bound decode: the decode MFU does not move it
    assert data["batched_time_s"] == pytest.approx(wave(100))
