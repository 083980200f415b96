"""Tensor-parallel communication: the all-reduces one decode step of a TP replica pays.

Owns: the chain of bytes and seconds for them, as `plan capacity --tp N` shows it.
Never: models overlap with compute (these seconds are a floor added to the step, not hidden
under it), or the all-to-all of expert parallelism.

servelm's tensor-parallel layers (servelm/layers/parallel_linear.py) all-reduce each layer's
attention output and MLP output, [B, hidden] activations each, plus the embedding once:

    bytes per token per layer   = reductions_per_layer x hidden x activation_bytes
                                  (2 under tp attention; 1 under dp attention, MLP only)
    one all-reduce of B tokens  = latency + 2 (tp - 1) / tp x B x hidden x bytes / link
                                  (a ring: every rank sends and receives 2(tp-1)/tp of it)
    per decode step             = (reductions_per_layer x layers + 1) all-reduces

The measured side, on this machine over gloo, comes from `benchmarks/cpu/run_parallel.sh`
(bytes counted by servelm/parallel/group.py against this formula, seconds per call).
"""

from __future__ import annotations

from typing import NamedTuple

from servelm.planner.chain import Chain
from servelm.planner.deployment import Deployment
from servelm.planner.hardware import LINKS
from servelm.planner.units import DTYPE_BYTES
from servelm.planner.units import fmt_num as f

# Per-call latency of a small all-reduce inside one NVLink node: an assumption of the order
# nccl-tests report for kilobyte messages (a few to ~10 us); set --tp-latency-us to a
# measured figure. It dominates at decode sizes: 8 tokens x 8192 x 2 B is 131 kB, 0.3 us of
# NVLink 4 bandwidth.
DEFAULT_LATENCY_S = 10e-6


class TPComm(NamedTuple):
    bytes_per_token_per_layer: float
    allreduces_per_step: int
    step_s_batch_1: float  # all-reduce seconds of one decode step of one sequence
    step_s_batch: float  # ... of `batch` sequences


def reductions_per_layer(d: Deployment) -> int:
    return 1 if d.is_dp_attention else 2


def allreduce_bytes_per_step(hidden_size: int, num_layers: int, num_tokens: int,
                             activation_bytes: float, per_layer: int = 2) -> float:
    """Payload bytes one rank all-reduces in a step of num_tokens (what
    servelm/parallel/group.py counts): per layer and token, then the embedding's once."""
    return (per_layer * num_layers + 1) * num_tokens * hidden_size * activation_bytes


def tp_comm_steps(c: Chain, d: Deployment, batch: int,
                  latency_s: float = DEFAULT_LATENCY_S) -> TPComm:
    """Add the all-reduce chain for a decode step of `batch` sequences (batch 1 too)."""
    m, tp = d.model, d.tp
    act = DTYPE_BYTES[d.compute_dtype]
    per_layer = reductions_per_layer(d)
    nbytes = c.add("tp_allreduce_bytes_per_token_per_layer",
                   "reductions_per_layer x hidden x activation_bytes",
                   f"{per_layer} x {m.hidden_size} x {f(act)}", per_layer * m.hidden_size * act,
                   "B")
    calls = int(c.add("tp_allreduces_per_step", "reductions_per_layer x layers + 1",
                      f"{per_layer} x {m.num_layers} + 1", per_layer * m.num_layers + 1))
    link = LINKS[d.gpu.interconnect]
    ring = 2 * (tp - 1) / tp

    def step_s(name: str, b: int) -> float:
        msg = b * m.hidden_size * act
        return c.add(name, "calls x (latency + 2 (tp-1)/tp x B x hidden x bytes / link)",
                     f"{calls} x ({f(latency_s)} + {f(ring)} x {f(msg)} / {f(link.bandwidth_Bps)})",
                     calls * (latency_s + ring * msg / link.bandwidth_Bps), "s")

    one = step_s("tp_allreduce_s_per_step_batch_1", 1)
    full = step_s(f"tp_allreduce_s_per_step_batch_{batch}", batch)
    c.note(f"tensor parallel: {calls} all-reduces per decode step over {link.name} "
           f"({link.description}); the per-call latency {f(latency_s * 1e6)} us is "
           f"{'set' if latency_s != DEFAULT_LATENCY_S else 'assumed (--tp-latency-us)'} and "
           "dominates at decode sizes. Compare with the step time of `plan decode`.")
    return TPComm(nbytes, calls, one, full)
