"""StepCostModel: how long one engine step takes, from its shape.

Owns: the features of a step (from its StepDescription alone, so a measured step and a
simulated one are described the same way), the model over them in one of two forms with a
name, a JSON file format, the weighted least-squares fit of either form, and the fit's error
by the kind of step.
Never: imports torch; the measurements come from `servelm bench calibrate`.

Form "linear" (every file written before the form existed):

    step_s = base_s + per_seq_s * seqs + per_decode_token_s * decode_tokens
           + per_decode_context_s * decode_context_tokens        (KV read by decodes)
           + per_prefill_token_s * prefill_tokens                  (weights x new tokens)
           + per_prefill_pair_s * prefill_attention_pairs          (causal attention)

Form "roofline": a step is bound either by what it reads or by what it computes, not by
their sum:

    memory_s  = per_seq_s * seqs + per_decode_token_s * decode_tokens
              + per_decode_context_s * decode_context_tokens
    compute_s = prefill_step_s + per_prefill_token_s * (prefill_tokens + decode_tokens)
              + per_prefill_pair_s * prefill_attention_pairs     (0 without a prefill chunk)
    step_s    = base_s + max(memory_s, compute_s)

A decode-only step is the linear form's (memory-bound: the weights once a step, KV per
context token). A step with a prefill chunk runs its decode rows in the same GEMMs as the
chunk's tokens: they cost a token's compute each, and their weight and KV reads hide under
the chunk's compute, where the linear form adds a decode step's cost on top of the chunk's.
`prefill_step_s` is the fixed cost of a step that carries a chunk (on the CPU such a step
runs the model eagerly, an all-decode step the C++ decode stack).

One part is per request, not per step: `arrival_s`, a request's time from reaching the
server to the engine's queue (the front end's parsing, tokenizing and hop into the engine),
measured by a served-step trace (servelm/engine/step_trace.py); the simulator admits each
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

FORMS = ("linear", "roofline")
VERSION = 2  # the file format: 1 had no `form` and `prefill_step_s` (it reads as linear)
FEATURES = ("base_s", "per_seq_s", "per_decode_token_s", "per_decode_context_s",
            "per_prefill_token_s", "per_prefill_pair_s")
ROOFLINE_FEATURES = (*FEATURES, "prefill_step_s")
# The kinds of step a fit's error is reported by: what TPOT is made of (decode only), a
# request alone on an idle engine (prefill only), TTFT nearer the knee (prefill beside
# decodes).
STEP_CLASSES = ("decode only", "prefill only", "prefill beside decodes")


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


def step_class(shape: StepShape) -> str:
    """Which of STEP_CLASSES a step is."""
    if shape.num_prefill_tokens == 0:
        return STEP_CLASSES[0]
    return STEP_CLASSES[1] if shape.num_decode_tokens == 0 else STEP_CLASSES[2]


@dataclass
class StepCostModel:
    name: str
    base_s: float = 0.0
    per_seq_s: float = 0.0
    per_decode_token_s: float = 0.0
    per_decode_context_s: float = 0.0
    per_prefill_token_s: float = 0.0
    per_prefill_pair_s: float = 0.0
    prefill_step_s: float = 0.0  # roofline form: the fixed compute of a step with a chunk
    arrival_s: float = 0.0  # per request: reaching the server -> the engine's queue
    fit: dict = field(default_factory=dict)  # how it was made: samples, error, machine
    form: str = "linear"  # one of FORMS (the module docstring)

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"form: one of {', '.join(FORMS)}, got {self.form!r}")
        if self.form == "linear" and self.prefill_step_s:
            raise ValueError("prefill_step_s: only the roofline form has it")
        self._is_roofline = self.form == "roofline"

    def predict(self, shape: StepShape) -> float:
        return self.step_time(*shape)

    def step_time(self, num_seqs: int, num_decode_tokens: int, num_decode_context_tokens: int,
                  num_prefill_tokens: int, num_prefill_pairs: int) -> float:
        """predict() over the shape's fields (the SLO scheduling policy's step-time model).
        The linear form is summed in FEATURES order, as a dot product with
        StepShape.vector() would."""
        if self._is_roofline:
            memory = (self.per_seq_s * num_seqs + self.per_decode_token_s * num_decode_tokens
                      + self.per_decode_context_s * num_decode_context_tokens)
            if num_prefill_tokens:
                compute = (self.prefill_step_s + self.per_prefill_token_s
                           * (num_prefill_tokens + num_decode_tokens)
                           + self.per_prefill_pair_s * num_prefill_pairs)
                if compute > memory:
                    return float(self.base_s + compute)
            return float(self.base_s + memory)
        return float(self.base_s * 1.0 + self.per_seq_s * num_seqs
                     + self.per_decode_token_s * num_decode_tokens
                     + self.per_decode_context_s * num_decode_context_tokens
                     + self.per_prefill_token_s * num_prefill_tokens
                     + self.per_prefill_pair_s * num_prefill_pairs)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"kind": "step-cost-model", "version": VERSION,
                                          **asdict(self)}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        """A file of any version: one without `form` (version 1) is the linear form."""
        data = json.loads(Path(path).read_text())
        if data.pop("kind", None) != "step-cost-model":
            raise ValueError(f"{path} is not a step cost model (servelm bench calibrate)")
        version = data.pop("version", 1)
        if not isinstance(version, int) or not 1 <= version <= VERSION:
            raise ValueError(f"{path}: step cost model version {version!r}; this servelm "
                             f"reads versions 1 to {VERSION}")
        return cls(**data)


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients: a coefficient that comes out negative
    is dropped and the rest refitted."""
    active = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = np.zeros(x.shape[1])
    full[active] = np.maximum(coef, 0.0)
    return full


def _fit_linear(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> dict[str, float]:
    return dict(zip(FEATURES, _nnls(x * w[:, None], y * w).tolist()))


# The roofline form's two sides as linear features of a step (x: StepShape.vector() rows):
# a step bound by memory has base + the memory side, one bound by compute base + the
# compute side (ROOFLINE_FEATURES order).
def _memory_side(x: np.ndarray) -> np.ndarray:
    z = np.zeros((len(x), len(ROOFLINE_FEATURES)))
    z[:, :4] = x[:, :4]
    return z


def _compute_side(x: np.ndarray) -> np.ndarray:
    z = np.zeros((len(x), len(ROOFLINE_FEATURES)))
    has_chunk = x[:, 4] > 0
    z[:, 0] = 1.0
    z[:, 4] = np.where(has_chunk, x[:, 4] + x[:, 2], 0.0)
    z[:, 5] = np.where(has_chunk, x[:, 5], 0.0)
    z[:, 6] = has_chunk
    return z


_ROOFLINE_ROUNDS = 50


def _fit_roofline(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> dict[str, float]:
    """base + max(memory, compute) by alternating: say which side binds each step, fit both
    sides' coefficients to the steps as assigned (one least-squares fit, non-negative),
    reassign each step to the side that predicts more, until no step moves. Started from
    two assignments (every step with a chunk compute-bound; only the chunk-bearing steps
    the linear form puts above the decode side), the better fit kept."""
    mem, comp = _memory_side(x), _compute_side(x)
    has_chunk = x[:, 4] > 0
    lin = _nnls(x * w[:, None], y * w)
    starts = [has_chunk, has_chunk & (x[:, 4:] @ lin[4:] > x[:, 1:4] @ lin[1:4])]
    best, best_loss = None, np.inf
    for bound in starts:
        for _ in range(_ROOFLINE_ROUNDS):
            z = np.where(bound[:, None], comp, mem)
            coef = _nnls(z * w[:, None], y * w)
            now = has_chunk & (comp[:, 1:] @ coef[1:] > mem[:, 1:] @ coef[1:])
            if (now == bound).all():
                break
            bound = now
        pred = coef[0] + np.maximum(mem[:, 1:] @ coef[1:], comp[:, 1:] @ coef[1:])
        loss = float((((pred - y) * w) ** 2).sum())
        if loss < best_loss:
            best, best_loss = coef, loss
    return dict(zip(ROOFLINE_FEATURES, best.tolist()))


_REWEIGHT_ROUNDS = 4  # refits with weights from the prediction (converged by the third)


def _predicted(x: np.ndarray, coef: dict[str, float], form: str) -> np.ndarray:
    if form == "linear":
        return x @ np.array([coef[f] for f in FEATURES])
    c = np.array([coef[f] for f in ROOFLINE_FEATURES])
    return c[0] + np.maximum(_memory_side(x)[:, 1:] @ c[1:], _compute_side(x)[:, 1:] @ c[1:])


def fit_cost_model(name: str, shapes: list[StepShape], seconds: list[float],
                   form: str = "linear") -> StepCostModel:
    """Least squares of the relative error (a 1 ms decode and a 300 ms prefill count alike),
    coefficients non-negative, with the fit's error on the samples it was fitted on: in
    all and by step class.

    Relative to the prediction, not to the measurement: the first fit weights each step by
    1 / its measured time, the refits by 1 / its predicted time. Weights from the
    measurement favour the fast samples of a shape (a slow step weighs less than a fast
    one of the same shape), so with step times skewed by a few slow ones that fit runs
    below their mean: 5% low in total on a served CPU calibration, and a simulator sums
    step times, so the queue at the knee came out short. Weights from the prediction
    estimate the mean (the quasi-likelihood of a gamma-distributed step time)."""
    if form not in FORMS:
        raise ValueError(f"form: one of {', '.join(FORMS)}, got {form!r}")
    num = len(FEATURES) if form == "linear" else len(ROOFLINE_FEATURES)
    if len(shapes) < num:
        raise ValueError(f"need at least {num} measured steps, got {len(shapes)}")
    x = np.array([s.vector() for s in shapes], dtype=np.float64)
    y = np.array(seconds, dtype=np.float64)
    w = 1.0 / np.maximum(y, 1e-6)
    for _ in range(1 + _REWEIGHT_ROUNDS):
        coef = _fit_linear(x, y, w) if form == "linear" else _fit_roofline(x, y, w)
        pred = _predicted(x, coef, form)
        w = 1.0 / np.maximum(pred, 1e-6)
    model = StepCostModel(name, form=form, **coef)
    rel = np.abs(pred - y) / np.maximum(y, 1e-9)
    model.fit = {"num_samples": len(y), "mean_abs_rel_error": float(rel.mean()),
                 "p90_abs_rel_error": float(np.percentile(rel, 90)),
                 "total_s_measured": float(y.sum()), "total_s_predicted": float(pred.sum()),
                 "by_class": _class_errors([step_class(s) for s in shapes], pred, y)}
    return model


def step_class_errors(model, shapes: list[StepShape], seconds: list[float]) -> dict:
    """Per step class present: steps, measured mean, the signed relative error's median and
    mean |error|, and total predicted / measured (any model with predict())."""
    pred = np.array([model.predict(s) for s in shapes], dtype=np.float64)
    return _class_errors([step_class(s) for s in shapes], pred,
                         np.array(seconds, dtype=np.float64))


def _class_errors(classes: list[str], pred: np.ndarray, y: np.ndarray) -> dict:
    out = {}
    kinds = np.array(classes)
    for name in STEP_CLASSES:
        sel = kinds == name
        if not sel.any():
            continue
        err = (pred[sel] - y[sel]) / np.maximum(y[sel], 1e-9)
        out[name] = {"n": int(sel.sum()), "measured_mean_s": float(y[sel].mean()),
                     "error_p50": float(np.median(err)),
                     "mean_abs_error": float(np.abs(err).mean()),
                     "total_ratio": float(pred[sel].sum() / y[sel].sum())}
    return out


__all__ = ["FEATURES", "FORMS", "ROOFLINE_FEATURES", "STEP_CLASSES", "StepCostModel",
           "StepShape", "fit_cost_model", "step_class", "step_class_errors", "step_shape"]
