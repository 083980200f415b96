"""RooflineCostModel: a step's time on a GPU type from the planner's roofline, so that
`servelm sim` can run a deployment this machine does not have (a 70B model on H100s) with
the numbers `servelm plan` uses.

Owns: step time from a StepShape and a planner Deployment (model, GPU, tp, dtypes,
calibration factors), and the replica it implies (KV blocks from the planner's KV pool).
Never: re-derives hardware or model figures: bytes and FLOPs are servelm.cost.step_cost,
peaks and bandwidths the Deployment's, as in planner/decode.py and planner/prefill.py.

    memory_s  = (weights read once for the step's tokens + KV read by decodes + KV written)
                / (tp x HBM bandwidth x bandwidth_fraction)
    compute_s = decode FLOPs / (tp x peak x decode_mfu) + prefill FLOPs / (tp x peak x prefill_mfu)
    step_s    = max(memory_s, compute_s) + step_overhead_s

A pure decode step is `servelm plan decode`'s step_time exactly; a lone prompt is `plan
prefill`'s time (within the KV writes it adds and the embedding table it does not read). A
mixed step (chunked prefill riding with decodes) overlaps the decodes' memory time with the
chunk's compute time, where `plan fleet` adds prefill time and decode time per request.
"""

from __future__ import annotations

from typing import Any

from servelm.cost import (attention_flops_per_pair, layer_matmul_flops_per_token,
                          lm_head_flops_per_token, step_cost, weight_bytes_read_per_step)
from servelm.engine.step_cost_model import StepShape


class RooflineCostModel:
    def __init__(self, deployment, block_size: int = 16):
        d = self.deployment = deployment
        self.name = f"roofline-{d.model.name}-{d.gpu.name}-tp{d.tp}"
        cal = d.calibration
        self._bw = d.tp * d.gpu.hbm_bandwidth_Bps * cal.bandwidth_fraction
        self._decode_flops = d.tp * d.peak_flops * cal.decode_mfu
        self._prefill_flops = d.tp * d.peak_flops * cal.prefill_mfu
        self._extra_weight_bytes = (d.attention_copies - 1) * d.attention_weight_bytes
        # step_cost's per-model factors, taken once: predict() runs for every simulated step
        # and repeats step_cost's arithmetic in its order (the same float results).
        m = d.model
        self._per_token_flops = layer_matmul_flops_per_token(m)
        self._per_logit_flops = lm_head_flops_per_token(m)
        self._per_pair_flops = attention_flops_per_pair(m)
        self._weights: dict[int, float] = {}  # tokens in the step -> weight bytes read
        self._kv = d.kv_bytes_per_token  # (a property that derives it on every read)
        self._kv_copies = d.kv_copies
        self._overhead_s = cal.step_overhead_s
        self.fit: dict[str, Any] = {
            "source": "roofline (servelm plan)", "deployment": d.inputs(),
            "bandwidth_fraction": cal.bandwidth_fraction, "decode_mfu": cal.decode_mfu,
            "prefill_mfu": cal.prefill_mfu, "step_overhead_s": cal.step_overhead_s,
            "engine": {"num_blocks": d.kv_tokens_per_replica // block_size,
                       "block_size": block_size, "vocab_size": d.model.vocab_size}}

    def predict(self, shape: StepShape) -> float:
        return self.step_time(*shape)

    def step_time(self, num_seqs: int, num_decode_tokens: int, num_decode_context_tokens: int,
                  num_prefill_tokens: int, num_prefill_pairs: int) -> float:
        """servelm.cost.step_cost for the decode rows and for the prefill rows, combined as
        the module doc says. A decode row of a sequence at position p reads p + 1 keys: its
        context tokens are also its attention pairs (as plan decode counts them)."""
        kv = self._kv
        num_tokens = num_decode_tokens + num_prefill_tokens
        weights = self._weights.get(num_tokens)
        if weights is None:  # MoE: the experts touched depend on the tokens
            d = self.deployment
            weights = self._weights[num_tokens] = weight_bytes_read_per_step(
                d.model, num_tokens, d.bytes_per_param) + self._extra_weight_bytes
        a, b, c = self._per_token_flops, self._per_logit_flops, self._per_pair_flops
        dec_flops = float(num_decode_tokens * a + num_decode_tokens * b
                          + num_decode_context_tokens * c)
        pre_flops = float(num_prefill_tokens * a + num_prefill_tokens * b
                          + num_prefill_pairs * c)
        dec_kv = kv * (num_decode_context_tokens + num_decode_tokens)
        pre_kv = kv * (0 + num_prefill_tokens)
        memory_s = (weights + (dec_kv + pre_kv) * self._kv_copies) / self._bw
        compute_s = dec_flops / self._decode_flops + pre_flops / self._prefill_flops
        return max(memory_s, compute_s) + self._overhead_s


def roofline_from_args(args) -> RooflineCostModel:
    """`servelm sim --gpu ...`: the Deployment `servelm plan` builds from the same flags.
    Bad values raise PlanInputError (a ValueError) naming the flag."""
    import dataclasses

    from servelm.planner.calibration import load_calibration
    from servelm.planner.deployment import Deployment, auto_tp
    from servelm.planner.hardware import get_accelerator
    from servelm.planner.model_catalog import resolve_model

    model = resolve_model(args.model)
    gpu = get_accelerator(args.gpu)
    tp = args.tp if args.tp is not None else auto_tp(model, gpu, args.weight_dtype,
                                                     args.mem_util)
    cal = load_calibration(args.calibration)
    changes = {k: v for k, v in (("prefill_mfu", args.prefill_mfu),
                                 ("decode_mfu", args.decode_mfu)) if v is not None}
    if changes:
        cal = dataclasses.replace(cal, **changes)
    d = Deployment(model, gpu, tp=tp, weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype,
                   mem_util=args.mem_util, calibration=cal)
    return RooflineCostModel(d, args.block_size or 16)


__all__ = ["RooflineCostModel", "roofline_from_args"]
