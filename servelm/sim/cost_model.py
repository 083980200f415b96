"""StepCostModel: how long one engine step takes, from its shape.

Owns: the features of a step (from its StepDescription alone, so a measured step and a
simulated one are described the same way), a linear model over them with a name, a JSON
file format, and the least-squares fit with its error.
Never: imports torch; the measurements come from `servelm bench calibrate`.

    step_s = base_s + per_seq_s * seqs + per_decode_token_s * decode_tokens
           + per_decode_context_s * decode_context_tokens        (KV read by decodes)
           + per_prefill_token_s * prefill_tokens                  (weights x new tokens)
           + per_prefill_pair_s * prefill_attention_pairs          (causal attention)

Decode is memory-bound (weights once per step, KV per context token); prefill is
compute-bound (per token, and per attention pair): a handful of coefficients covers both.

One part is per request, not per step: `arrival_s`, a request's time from reaching the
server to the engine's queue (the front end's parsing, tokenizing and hop into the engine),
measured by a served-step trace (servelm/sim/step_trace.py); the simulator admits each
request that long after it arrives. 0 for a model fitted to a lone engine's steps.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from servelm.core.contract import StepDescription
from servelm.cost import attention_pairs

FEATURES = ("base_s", "per_seq_s", "per_decode_token_s", "per_decode_context_s",
            "per_prefill_token_s", "per_prefill_pair_s")


class StepShape(NamedTuple):
    num_seqs: int
    num_decode_tokens: int
    num_decode_context_tokens: int
    num_prefill_tokens: int
    num_prefill_pairs: int

    def vector(self) -> list[float]:
        return [1.0, self.num_seqs, self.num_decode_tokens, self.num_decode_context_tokens,
                self.num_prefill_tokens, self.num_prefill_pairs]


def step_shape(step: StepDescription) -> StepShape:
    """A one-token step of a sequence is a decode row (as the CPU decode stack runs it);
    anything longer is a prefill chunk (speculative verifications included)."""
    seqs = dec = dec_ctx = pre = pairs = 0
    for s in step.seqs:
        seqs += 1
        n = s.num_new_tokens
        if n == 1:
            dec += 1
            dec_ctx += s.start + 1
        else:
            pre += n
            pairs += attention_pairs(s.start, n)
    return StepShape(seqs, dec, dec_ctx, pre, pairs)


@dataclass
class StepCostModel:
    name: str
    base_s: float = 0.0
    per_seq_s: float = 0.0
    per_decode_token_s: float = 0.0
    per_decode_context_s: float = 0.0
    per_prefill_token_s: float = 0.0
    per_prefill_pair_s: float = 0.0
    arrival_s: float = 0.0  # per request: reaching the server -> the engine's queue
    fit: dict = field(default_factory=dict)  # how it was made: samples, error, machine

    def predict(self, shape: StepShape) -> float:
        return self.step_time(*shape)

    def step_time(self, num_seqs: int, num_decode_tokens: int, num_decode_context_tokens: int,
                  num_prefill_tokens: int, num_prefill_pairs: int) -> float:
        """predict() over the shape's fields (the SLO scheduling policy's step-time model);
        summed in FEATURES order, as a dot product with StepShape.vector() would."""
        return float(self.base_s * 1.0 + self.per_seq_s * num_seqs
                     + self.per_decode_token_s * num_decode_tokens
                     + self.per_decode_context_s * num_decode_context_tokens
                     + self.per_prefill_token_s * num_prefill_tokens
                     + self.per_prefill_pair_s * num_prefill_pairs)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"kind": "step-cost-model", **asdict(self)},
                                         indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        data = json.loads(Path(path).read_text())
        if data.pop("kind", None) != "step-cost-model":
            raise ValueError(f"{path} is not a step cost model (servelm bench calibrate)")
        return cls(**data)


def fit_cost_model(name: str, shapes: list[StepShape], seconds: list[float]) -> StepCostModel:
    """Non-negative least squares (a coefficient that comes out negative is dropped and the
    rest refitted), with the fit's error on the samples it was fitted on."""
    if len(shapes) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} measured steps, got {len(shapes)}")
    x = np.array([s.vector() for s in shapes], dtype=np.float64)
    y = np.array(seconds, dtype=np.float64)
    active = list(range(len(FEATURES)))
    # Relative error matters (a 1 ms decode and a 300 ms prefill both count): weight by 1/y.
    w = 1.0 / np.maximum(y, 1e-6)
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = np.zeros(len(FEATURES))
    full[active] = np.maximum(coef, 0.0)
    pred = x @ full
    rel = np.abs(pred - y) / np.maximum(y, 1e-9)
    model = StepCostModel(name, **dict(zip(FEATURES, full.tolist())))
    model.fit = {"num_samples": len(y), "mean_abs_rel_error": float(rel.mean()),
                 "p90_abs_rel_error": float(np.percentile(rel, 90)),
                 "total_s_measured": float(y.sum()), "total_s_predicted": float(pred.sum())}
    return model


__all__ = ["FEATURES", "StepCostModel", "StepShape", "fit_cost_model", "step_shape"]
