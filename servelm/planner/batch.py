"""`servelm plan batch`: a synchronous batch job's time, one document at a time vs batched.

Owns: the job's arithmetic over the prefill and decode step models (prefill.py, decode.py):
one document's prefill plus its decode steps, times the number of documents; and for the
batch, the largest batch memory allows (KV of every document's full length at once, see
`plan capacity`), the waves of that size, each a batched prefill and decode steps at that
batch; mean latency either way, and the longest batch window (time spent collecting
documents before the batch starts) that still finishes sooner than one by one.
Never: models queueing, unequal lengths or chunked-prefill interleaving; all documents are
the same shape, so continuous batching runs the same waves.

Steps of one document: its prefill samples the first token; each of the output_len - 1
decode steps after it feeds one token with context input_len + k - 1 cached (k = 1, 2, ..),
so the decode steps' mean context is input_len + output_len / 2 - 1, and within one roof
(memory or compute) a step's time is linear in its context, so the sum is
(output_len - 1) x step(mean context).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from servelm.planner.capacity import memory_steps
from servelm.planner.chain import Chain, PlanResult
from servelm.planner.decode import step_time
from servelm.planner.deployment import Deployment
from servelm.planner.errors import require_non_negative, require_positive
from servelm.planner.prefill import batch_prefill_time
from servelm.planner.units import fmt_num as f


@dataclass(frozen=True)
class BatchJob:
    num_docs: int
    input_len: int
    output_len: int
    max_batch: int | None = None  # the engine's max_num_seqs, or the user's cap
    window_s: float = 0.0  # collecting documents before the batch starts

    def __post_init__(self) -> None:
        require_positive("--docs", self.num_docs)
        require_positive("--input-len", self.input_len)
        require_positive("--output-len", self.output_len)
        if self.max_batch is not None:
            require_positive("--max-batch", self.max_batch)
        require_non_negative("--window", self.window_s)

    @property
    def num_decode_steps(self) -> int:
        return self.output_len - 1

    @property
    def mean_decode_context(self) -> float:
        return self.input_len + self.output_len / 2 - 1


class Wave(NamedTuple):
    num_seqs: int
    prefill_s: float
    decode_step_s: float
    time_s: float


def wave(d: Deployment, job: BatchJob, num_seqs: int) -> Wave:
    """num_seqs documents prefilled together, then decoded together to the end."""
    pre = batch_prefill_time(d, num_seqs, job.input_len, d.calibration.prefill_mfu).time_s
    step = step_time(d, num_seqs, job.mean_decode_context).step_s if job.num_decode_steps else 0
    return Wave(num_seqs, pre, step, pre + job.num_decode_steps * step)


@dataclass(frozen=True)
class BatchPlan(PlanResult):
    command = "batch"
    per_doc_s: float
    sequential_time_s: float
    memory_batch: int
    batch_size: int
    num_waves: int
    batched_time_s: float
    speedup: float
    sequential_mean_latency_s: float
    batched_mean_latency_s: float
    break_even_window_s: float
    batched_with_window_s: float


def _wave_steps(c: Chain, d: Deployment, job: BatchJob, w: Wave, label: str) -> None:
    p = batch_prefill_time(d, w.num_seqs, job.input_len, d.calibration.prefill_mfu)
    c.add(f"{label}_prefill_s", "max((docs_in_wave x input_len x 2 x active_matmul_params + "
          "docs_in_wave x attention_flops(input_len)) / effective_flops, weight_read_s)",
          f"docs_in_wave = {w.num_seqs}: max(({f(p.linear_flops)} + {f(p.attention_flops)}) / "
          f"{f(p.effective_flops)}, {f(p.weight_read_s)})", w.prefill_s, "s")
    if job.num_decode_steps:
        s = step_time(d, w.num_seqs, job.mean_decode_context)
        oh = d.calibration.step_overhead_s
        c.add(f"{label}_decode_step_s", f"max(memory, compute) + overhead of a decode step at "
              f"batch {w.num_seqs}, context {f(job.mean_decode_context)} (see `plan decode`)",
              f"max({f(s.memory_s)}, {f(s.compute_s)})" + (f" + {oh}" if oh else ""),
              w.decode_step_s, "s")
    c.add(f"{label}_s", f"{label}_prefill_s + decode_steps x {label}_decode_step_s",
          f"{f(w.prefill_s)} + {job.num_decode_steps} x {f(w.decode_step_s)}", w.time_s, "s")


def _sequential(c: Chain, d: Deployment, job: BatchJob) -> Wave:
    c.add("decode_steps", "output_len - 1 (the prefill step samples the first token)",
          f"{job.output_len} - 1", job.num_decode_steps, "steps")
    c.add("mean_decode_context", "input_len + output_len / 2 - 1 (step time is linear in "
          "context, so the mean step stands for them all)",
          f"{job.input_len} + {job.output_len} / 2 - 1", job.mean_decode_context, "tokens")
    one = wave(d, job, 1)
    _wave_steps(c, d, job, one, "per_doc")
    c.add("sequential_time_s", "docs x per_doc_s", f"{job.num_docs} x {f(one.time_s)}",
          job.num_docs * one.time_s, "s")
    return one


def _batch_size(c: Chain, d: Deployment, job: BatchJob) -> tuple[int, int]:
    memory_steps(c, d)
    full = job.input_len + job.output_len
    per = ("tp x floor(kv_tokens_per_gpu / (input_len + output_len)) (a document cannot span "
           "GPUs)" if d.is_dp_attention else
           "floor(kv_tokens_per_replica / (input_len + output_len))")
    subst = (f"{d.tp} x floor({f(d.kv_tokens_per_gpu)} / {full})" if d.is_dp_attention
             else f"floor({f(d.kv_tokens_per_replica)} / {full})")
    mem = int(c.add("memory_batch", per + ": documents whose whole KV fits at once", subst,
                    d.sequences_per_replica(full), "docs"))
    caps = [job.num_docs, mem] + ([job.max_batch] if job.max_batch else [])
    names = "docs, memory_batch" + (", max_batch" if job.max_batch else "")
    size = int(c.add("batch_size", f"min({names})", f"min({', '.join(map(str, caps))})",
                     min(caps), "docs"))
    return mem, size


def plan_batch(d: Deployment, job: BatchJob) -> BatchPlan:
    c = Chain()
    one = _sequential(c, d, job)
    seq_s = job.num_docs * one.time_s
    mem, size = _batch_size(c, d, job)
    if size == 0:
        c.note("one document's KV (input_len + output_len tokens) does not fit: raise --tp, "
               "use --kv-dtype fp8 or a larger GPU.")
        return _result(d, job, c, math.inf, one, mem, 0, 0, math.inf, math.inf)
    waves = int(c.add("num_waves", "ceil(docs / batch_size)", f"ceil({job.num_docs} / {size})",
                      math.ceil(job.num_docs / size), "waves"))
    full = wave(d, job, size)
    _wave_steps(c, d, job, full, "wave")
    last_n = job.num_docs - (waves - 1) * size
    last = full if last_n == size else wave(d, job, last_n)
    if last_n != size:
        _wave_steps(c, d, job, last, "last_wave")
        total = c.add("batched_time_s", "(num_waves - 1) x wave_s + last_wave_s",
                      f"{waves - 1} x {f(full.time_s)} + {f(last.time_s)}",
                      (waves - 1) * full.time_s + last.time_s, "s")
    else:
        total = c.add("batched_time_s", "num_waves x wave_s", f"{waves} x {f(full.time_s)}",
                      waves * full.time_s, "s")
    c.add("speedup", "sequential_time_s / batched_time_s", f"{f(seq_s)} / {f(total)}",
          seq_s / total, "x")
    # mean latency: document i of the sequential job ends at i x per_doc_s; a wave's
    # documents all end with their wave.
    ends = [(w + 1) * full.time_s for w in range(waves - 1)] + [total]
    sizes = [size] * (waves - 1) + [last_n]
    batched_lat = sum(n * e for n, e in zip(sizes, ends)) / job.num_docs
    _latency_steps(c, job, one, waves, size, full, batched_lat)
    if mem < min(job.num_docs, job.max_batch or job.num_docs):
        c.note(f"memory stops the batch at {mem} documents ({job.input_len + job.output_len} "
               "KV tokens each): more would need more GPUs, --kv-dtype fp8 or shorter outputs.")
    c.note("the activation reserve (--reserve-gb) is assumed to cover a prefill of "
           f"{size * job.input_len:,} tokens; an engine chunks it into steps of "
           "max_num_batched_tokens, the same FLOPs.")
    return _result(d, job, c, seq_s, one, mem, size, waves, total, batched_lat)


def _latency_steps(c: Chain, job: BatchJob, one: Wave, waves: int, size: int, full: Wave,
                   batched_lat: float) -> None:
    n = job.num_docs
    c.add("sequential_mean_latency_s", "per_doc_s x (docs + 1) / 2 (document i ends at i x "
          "per_doc_s)", f"{f(one.time_s)} x ({n} + 1) / 2", one.time_s * (n + 1) / 2, "s")
    subst = f"{job.window_s} + " + (f"{f(full.time_s)}" if waves == 1 else
                                    f"sum over {waves} waves of docs_in_wave x its end / {n}")
    c.add("batched_mean_latency_s", "window + mean end of each document's wave", subst,
          job.window_s + batched_lat, "s")


def _result(d: Deployment, job: BatchJob, c: Chain, seq_s: float, one: Wave, mem: int,
            size: int, waves: int, total: float, batched_lat: float) -> BatchPlan:
    """seq_s: inf when one document does not fit (then neither way runs)."""
    if math.isinf(seq_s):
        total = batched_lat = math.inf
    be = c.add("break_even_window_s", "sequential_time_s - batched_time_s (a longer batch "
               "window finishes the job later than one by one)", f"{f(seq_s)} - {f(total)}",
               seq_s - total if not math.isinf(total) else 0.0, "s")
    with_window = job.window_s + total
    if job.window_s:
        c.add("batched_with_window_s", "window + batched_time_s",
              f"{job.window_s} + {f(total)}", with_window, "s")
    return BatchPlan(
        inputs={**d.inputs(), "docs": job.num_docs, "input_len": job.input_len,
                "output_len": job.output_len,
                **({"max_batch": job.max_batch} if job.max_batch else {}),
                "window_s": job.window_s, "prefill_mfu": d.calibration.prefill_mfu,
                "decode_mfu": d.calibration.decode_mfu},
        steps=tuple(c.steps), notes=tuple(c.notes),
        per_doc_s=one.time_s, sequential_time_s=seq_s, memory_batch=mem, batch_size=size,
        num_waves=waves, batched_time_s=total,
        speedup=seq_s / total if not math.isinf(total) else 0.0,
        sequential_mean_latency_s=(one.time_s * (job.num_docs + 1) / 2
                                   if not math.isinf(seq_s) else math.inf),
        batched_mean_latency_s=job.window_s + batched_lat, break_even_window_s=be,
        batched_with_window_s=with_window,
    )
