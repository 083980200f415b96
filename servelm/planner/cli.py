"""`servelm plan ...`: argparse wiring for the planner subcommands.

Owns: `add_parser(subparsers)` (registers `plan` and its subcommands, sets func=handler),
flag parsing and validation (bad values exit 2 with the flag named), building a Deployment
from flags, and printing text or `--json`.
Never: computes planner numbers; each subcommand calls one pure plan_* function.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

from servelm.planner.batch import BatchJob, plan_batch
from servelm.planner.calibration import BANDWIDTH_FLAGS, Calibration, load_calibration
from servelm.planner.capacity import plan_capacity
from servelm.planner.chain import PlanResult
from servelm.planner.coldstart import plan_coldstart
from servelm.planner.decode import plan_decode
from servelm.planner.deployment import ATTENTION_PARALLEL, Deployment, auto_tp
from servelm.planner.disagg import plan_disagg
from servelm.planner.errors import PlanInputError
from servelm.planner.fleet import Workload, plan_fleet
from servelm.planner.hardware import (
    ACCELERATORS,
    DEFAULT_GPU,
    LINKS,
    TIERS,
    get_accelerator,
    get_link,
    get_tier,
)
from servelm.planner.kv import plan_kv
from servelm.planner.model_catalog import catalog_names, resolve_model
from servelm.planner.offload import plan_offload
from servelm.planner.prefill import plan_prefill
from servelm.planner.report import render_json, render_text
from servelm.planner.speculative import plan_spec
from servelm.planner.units import DTYPE_BYTES, KV_DTYPES
from servelm.planner.weights import plan_weights


def _checked(kind: type, test: Callable[[float], bool], what: str) -> Callable[[str], float]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}")
        if not test(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


pos_int = _checked(int, lambda v: v > 0, "a positive integer")
pos_float = _checked(float, lambda v: v > 0, "positive")
non_neg_float = _checked(float, lambda v: v >= 0, ">= 0")
fraction = _checked(float, lambda v: 0 < v <= 1, "in (0, 1]")
acceptance = _checked(float, lambda v: 0 <= v <= 1, "in [0, 1]")


def _model_flags(p: argparse.ArgumentParser, kv: bool = True, weights: bool = True) -> None:
    p.add_argument("--model", default="Llama-3.1-8B",
                   help=f"built-in ({', '.join(catalog_names())}), HF repo id of a built-in, "
                        "a config.json, a model directory or a .gguf file")
    if weights:
        p.add_argument("--weight-dtype", default="bf16", choices=list(DTYPE_BYTES))
    if kv:
        p.add_argument("--kv-dtype", default="bf16", choices=list(KV_DTYPES))
    p.add_argument("--json", action="store_true", help="print stable JSON fields")


_AUTO_TP = "default: smallest power of two whose weight shard leaves room for KV"


def _attention_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attention-parallel", choices=ATTENTION_PARALLEL, default=None,
                   help="attention across the replica's --tp GPUs: tp splits heads (and "
                        "their KV) across them; dp gives each GPU whole requests and a copy "
                        "of the attention weights, the MLPs/experts still split (default: "
                        "dp for MLA models, whose latent TP cannot split; else tp)")


def _memory_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mem-util", type=fraction, default=0.9,
                   help="fraction of GPU memory the engine may use (default 0.9)")
    p.add_argument("--reserve-gb", type=non_neg_float, default=2.0,
                   help="activation/workspace reserve per GPU, decimal GB (default 2)")


def _hw_flags(p: argparse.ArgumentParser, tp_default: str = _AUTO_TP) -> None:
    _model_flags(p)
    p.add_argument("--gpu", default=DEFAULT_GPU, help=f"one of {', '.join(ACCELERATORS)}")
    p.add_argument("--tp", type=pos_int, default=None,
                   help=f"GPUs per replica ({tp_default})")
    _attention_flag(p)
    p.add_argument("--mem-util", type=fraction, default=0.9,
                   help="fraction of GPU memory the engine may use (default 0.9)")
    p.add_argument("--reserve-gb", type=non_neg_float, default=2.0,
                   help="activation/workspace reserve per GPU, decimal GB (default 2)")
    p.add_argument("--calibration", metavar="FILE", default=None,
                   help="JSON Calibration (bandwidth_fraction, prefill_mfu, decode_mfu, "
                        "step_overhead_s, ...), e.g. from `servelm bench`")


_BANDWIDTH_HELP = {
    "--dram-bw": "host DRAM (the dram tier), GB/s (default: the catalog's ddr5)",
    "--disk-bw": "local disk (the nvme tier), GB/s (default: the catalog's nvme)",
    "--network-bw": "remote store (the network tier), GB/s (default: nic-400g)",
    "--pcie-bw": "each GPU's host link, GB/s (default: the GPU's PCIe)",
    "--link-bw": "the --link's bandwidth per GPU, one way, GB/s (default: the catalog's)",
}


def _bandwidth_flags(p: argparse.ArgumentParser, *flags: str) -> None:
    """Bandwidths in decimal GB/s; each overrides --calibration's key of the same meaning."""
    for flag in flags:
        p.add_argument(flag, type=pos_float, default=None, metavar="GBPS",
                       help=_BANDWIDTH_HELP[flag] + "; overrides --calibration")


_TIER_BANDWIDTH_FLAGS = ("--dram-bw", "--disk-bw", "--network-bw", "--pcie-bw")


def _slo_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ttft", type=pos_float, default=1.0, help="TTFT budget/SLO, s")
    p.add_argument("--tpot", type=pos_float, default=0.05, help="TPOT SLO, s per token")


def _mfu_flag(p: argparse.ArgumentParser, default_doc: str) -> None:
    p.add_argument("--mfu", type=fraction, default=None,
                   help=f"model FLOPs utilisation (default: calibration, else {default_doc})")


def _phase_mfu_flags(p: argparse.ArgumentParser) -> None:
    """For commands that run both phases: one flag per phase, never one for both."""
    p.add_argument("--prefill-mfu", type=fraction, default=None,
                   help="MFU of prefill GEMMs (default: calibration.prefill_mfu, else 0.5)")
    p.add_argument("--decode-mfu", type=fraction, default=None,
                   help="MFU of decode steps (default: calibration.decode_mfu, else 1.0: "
                        "a lower bound)")


def _register(sub, name: str, helptext: str, fn: Callable) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=helptext, description=helptext)
    p.set_defaults(plan_fn=fn)
    return p


# ---------------------------------------------------------------- flags -> plan_* calls


def _calibration(args: argparse.Namespace) -> Calibration:
    """--calibration FILE, then the bandwidth flags (GB/s) over the file's keys."""
    cal = load_calibration(args.calibration)
    changes = {}
    for key, flag in BANDWIDTH_FLAGS.items():
        gbps = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if gbps is not None:
            changes[key] = gbps * 1e9
    return dataclasses.replace(cal, **changes) if changes else cal


def _deployment(args: argparse.Namespace, default_tp: int | None = None) -> Deployment:
    model = resolve_model(args.model)
    gpu = get_accelerator(args.gpu)
    ap = args.attention_parallel
    tp = args.tp or default_tp or auto_tp(model, gpu, args.weight_dtype, args.mem_util,
                                          args.reserve_gb, attention_parallel=ap)
    return Deployment(model, gpu, tp=tp, weight_dtype=args.weight_dtype,
                      kv_dtype=args.kv_dtype, mem_util=args.mem_util,
                      reserve_gb=args.reserve_gb, calibration=_calibration(args),
                      attention_parallel=ap)


def _run_kv(a):
    if a.gpu is None:
        return plan_kv(resolve_model(a.model), a.kv_dtype, a.context, tp=a.tp,
                       attention_parallel=a.attention_parallel)
    d = Deployment(resolve_model(a.model), get_accelerator(a.gpu), tp=a.tp,
                   weight_dtype=a.weight_dtype, kv_dtype=a.kv_dtype, mem_util=a.mem_util,
                   reserve_gb=a.reserve_gb, attention_parallel=a.attention_parallel)
    return plan_kv(d.model, d.kv_dtype, a.context, cards=d)


def _run_weights(a):
    return plan_weights(resolve_model(a.model), a.weight_dtype)


def _run_capacity(a):
    latency = None if a.tp_latency_us is None else a.tp_latency_us * 1e-6
    return plan_capacity(_deployment(a, default_tp=a.num_gpus), a.num_gpus, a.context, latency)


def _with_mfu(d: Deployment, *, prefill_mfu: float | None = None,
              decode_mfu: float | None = None) -> Deployment:
    """An MFU flag overrides the calibration's figure for that phase only."""
    changes = {k: v for k, v in (("prefill_mfu", prefill_mfu), ("decode_mfu", decode_mfu))
               if v is not None}
    if not changes:
        return d
    return dataclasses.replace(d, calibration=dataclasses.replace(d.calibration, **changes))


def _decode_deployment(a) -> Deployment:
    """decode and spec: --mfu is the decode MFU."""
    return _with_mfu(_deployment(a), decode_mfu=a.mfu)


def _run_decode(a):
    return plan_decode(_decode_deployment(a), a.batch, a.context)


def _run_prefill(a):
    return plan_prefill(_deployment(a), a.tokens, mfu=a.mfu, ttft_s=a.ttft, batch=a.batch,
                        context=a.context, tpot_s=a.tpot)


def _run_spec(a):
    return plan_spec(_decode_deployment(a), a.acceptance, a.draft_len, batch=a.batch,
                     context=a.context, draft_cost=a.draft_cost)


def _run_disagg(a):
    return plan_disagg(_deployment(a), a.input_len, get_link(a.link), mfu=a.mfu)


def _run_offload(a):
    return plan_offload(_deployment(a), a.tokens, get_tier(a.tier), mfu=a.mfu)


def _run_coldstart(a):
    plan = plan_coldstart(_deployment(a), get_tier(a.tier))
    if a.measured is None:
        return plan
    import json

    from servelm.planner.coldstart import compare_coldstart, measured_stages

    try:
        record = json.loads(Path(a.measured).read_text())
    except (OSError, ValueError) as exc:
        raise PlanInputError("--measured", f"cannot read {a.measured}: {exc}") from None
    try:
        return compare_coldstart(plan, *measured_stages(record, a.measured_run))
    except ValueError as exc:
        raise PlanInputError("--measured", str(exc).removeprefix("--measured: ")) from None


def _run_fleet(a):
    w = Workload(a.rps, a.input_len, a.output_len, a.ttft, a.tpot, a.max_load)
    d = _with_mfu(_deployment(a), prefill_mfu=a.prefill_mfu, decode_mfu=a.decode_mfu)
    return plan_fleet(d, w, tp_fixed=a.tp is not None)


def _run_batch(a):
    job = BatchJob(a.docs, a.input_len, a.output_len, a.max_batch, a.window)
    return plan_batch(_with_mfu(_deployment(a), prefill_mfu=a.prefill_mfu,
                                decode_mfu=a.decode_mfu), job)


def _print_catalog(as_json: bool) -> None:
    import json

    from servelm.cost import count_params
    from servelm.planner.model_catalog import builtin_model

    models = {n: {"attention": builtin_model(n).attention_kind,
                  "total_params": count_params(builtin_model(n)).total,
                  "source": builtin_model(n).source} for n in catalog_names()}
    gpus = {n: {"memory_bytes": g.memory_bytes, "hbm_bandwidth_Bps": g.hbm_bandwidth_Bps,
                "bf16_flops": g.bf16_flops, "fp8_flops": g.fp8_flops,
                "interconnect": g.interconnect, "sources": g.sources}
            for n, g in ACCELERATORS.items()}
    links = {n: {"bandwidth_Bps": link.bandwidth_Bps, "source": link.source}
             for n, link in LINKS.items()}
    tiers = {n: {"storage": t.storage, "description": t.description} for n, t in TIERS.items()}
    data = {"models": models, "gpus": gpus, "links": links, "tiers": tiers}
    if as_json:
        print(json.dumps(data, indent=2))
        return
    for section, rows in data.items():
        print(f"{section}:")
        for name, row in rows.items():
            src = row.get("source") or next(iter(row.get("sources", {}).values()), "")
            print(f"  {name:16} {src}")


# ---------------------------------------------------------------- parser


def _add_sizing_subcommands(sub) -> None:
    """kv, weights, capacity, decode, prefill: sizes and times of one replica."""
    p = _register(sub, "kv", "KV bytes per token/request, vs MHA/GQA/MQA/MLA layouts", _run_kv)
    _model_flags(p)
    p.add_argument("--context", type=pos_int, default=8192)
    p.add_argument("--tp", type=pos_int, default=1,
                   help="GPUs sharing one replica: shows the cache per GPU and per replica")
    _attention_flag(p)
    p.add_argument("--gpu", default=None, help=f"one of {', '.join(ACCELERATORS)}: go on to "
                   "the weights per GPU and the replica's KV token pool (default: none)")
    _memory_flags(p)

    p = _register(sub, "weights", "parameter count (total/active) and bytes per dtype",
                  _run_weights)
    _model_flags(p, kv=False)

    p = _register(sub, "capacity", "concurrent users at a context on N GPUs", _run_capacity)
    _hw_flags(p, tp_default="default: --num-gpus, one replica")
    p.add_argument("--num-gpus", type=pos_int, default=8)
    p.add_argument("--context", type=pos_int, default=8192)
    p.add_argument("--tp-latency-us", type=non_neg_float, default=None, metavar="US",
                   help="one tensor-parallel all-reduce's fixed cost, microseconds (default: "
                        "an assumed 10 us inside an NVLink node; measure with "
                        "benchmarks/cpu/run_parallel.sh's kind of record on the real link)")

    p = _register(sub, "decode", "decode step-time lower bound, ridge batch, tokens/s",
                  _run_decode)
    _hw_flags(p)
    p.add_argument("--batch", type=pos_int, default=32)
    p.add_argument("--context", type=pos_int, default=2048)
    _mfu_flag(p, "1.0 (decode MFU, peak: a lower bound)")

    p = _register(sub, "prefill", "prefill time, TTFT budget, decode stall, chunk size",
                  _run_prefill)
    _hw_flags(p)
    p.add_argument("--tokens", type=pos_int, default=8192, help="prompt tokens")
    p.add_argument("--batch", type=pos_int, default=32, help="active decode streams")
    p.add_argument("--context", type=pos_int, default=2048, help="their context length")
    _slo_flags(p)
    _mfu_flag(p, "0.5 (prefill MFU)")


def _add_what_if_subcommands(sub) -> None:
    """spec, disagg, offload, coldstart, fleet: questions about a serving design."""
    p = _register(sub, "spec", "speculative decoding: tokens/step, speedup, break-even batch",
                  _run_spec)
    _hw_flags(p)
    p.add_argument("--acceptance", type=acceptance, default=0.7)
    p.add_argument("--draft-len", type=pos_int, default=4)
    p.add_argument("--draft-cost", type=non_neg_float, default=0.05,
                   help="one draft step / one target step (default 0.05; 0 for n-gram)")
    p.add_argument("--batch", type=pos_int, default=1)
    p.add_argument("--context", type=pos_int, default=2048)
    _mfu_flag(p, "1.0 (decode MFU, peak: a lower bound)")

    p = _register(sub, "disagg", "KV shipped per request, transfer time, break-even link",
                  _run_disagg)
    _hw_flags(p)
    p.add_argument("--input-len", type=pos_int, default=8192)
    p.add_argument("--link", default="nic-400g", help=f"one of {', '.join(LINKS)}")
    _bandwidth_flags(p, "--link-bw")
    _mfu_flag(p, "0.5 (prefill MFU)")

    p = _register(sub, "offload", "reload a cached prefix from DRAM/NVMe vs recompute it",
                  _run_offload)
    _hw_flags(p)
    p.add_argument("--tokens", type=pos_int, default=8192, help="cached prefix tokens")
    p.add_argument("--tier", default="dram", help=f"one of {', '.join(TIERS)}")
    _bandwidth_flags(p, *_TIER_BANDWIDTH_FLAGS)
    _mfu_flag(p, "0.5 (prefill MFU)")

    p = _register(sub, "coldstart", "where a new replica's start-up seconds go",
                  _run_coldstart)
    _hw_flags(p)
    p.add_argument("--tier", default="nvme", help=f"weights source: {', '.join(TIERS)}")
    _bandwidth_flags(p, *_TIER_BANDWIDTH_FLAGS)
    p.add_argument("--measured", default=None, metavar="FILE",
                   help="a `servelm bench coldstart` JSON: its measured stages next to the "
                        "planned ones")
    p.add_argument("--measured-run", choices=("warm_median", "cold"), default="warm_median",
                   help="with --measured: the warm runs' median or the cold-cache run")

    p = _register(sub, "fleet", "GPUs and replicas for a request rate and SLOs", _run_fleet)
    _hw_flags(p)
    p.add_argument("--rps", type=pos_float, default=10.0, help="requests per second")
    p.add_argument("--input-len", type=pos_int, default=2000)
    p.add_argument("--output-len", type=pos_int, default=300)
    _slo_flags(p)
    p.add_argument("--max-load", type=fraction, default=0.8,
                   help="target utilisation of each replica, headroom for queueing")
    _phase_mfu_flags(p)

    p = sub.add_parser("catalog", help="list built-in models, GPUs, links, tiers and sources")
    p.add_argument("--json", action="store_true")
    p.set_defaults(plan_fn=None)


def _add_job_subcommands(sub) -> None:
    """batch: a whole job's time on one replica."""
    p = _register(sub, "batch", "a batch job: one document at a time vs batched, where "
                  "memory stops the batch, what a batch window costs", _run_batch)
    _hw_flags(p)
    p.add_argument("--docs", type=pos_int, default=100, help="documents in the job")
    p.add_argument("--input-len", type=pos_int, default=1000, help="tokens per document")
    p.add_argument("--output-len", type=pos_int, default=100, help="tokens per answer")
    p.add_argument("--max-batch", type=pos_int, default=None,
                   help="cap on documents at once, e.g. the engine's max_num_seqs (default: "
                        "what memory allows)")
    p.add_argument("--window", type=non_neg_float, default=0.0,
                   help="seconds spent collecting documents before the batch starts")
    _phase_mfu_flags(p)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `plan` on the top-level `servelm` subparsers; sets func=handler."""
    plan = subparsers.add_parser(
        "plan", help="capacity planner: serving arithmetic with the work shown",
        description="Capacity planner. Every subcommand prints its formula chain with the "
                    "numbers plugged in; --json prints stable fields (docs/planner.md).")
    sub = plan.add_subparsers(dest="plan_command", metavar="SUBCOMMAND")
    sub.required = True
    _add_sizing_subcommands(sub)
    _add_what_if_subcommands(sub)
    _add_job_subcommands(sub)
    plan.set_defaults(func=handler)
    return plan


def handler(args: argparse.Namespace) -> int:
    """Run one plan subcommand; bad input -> message naming the flag on stderr, exit 2."""
    try:
        if args.plan_command == "catalog":
            _print_catalog(args.json)
            return 0
        result: PlanResult = args.plan_fn(args)
    except PlanInputError as e:
        print(f"servelm plan {args.plan_command}: error: {e}", file=sys.stderr)
        return 2
    print(render_json(result) if args.json else render_text(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="servelm")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
