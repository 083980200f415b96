"""Returning turns of conversations whose histories no longer fit the device pool: TTFT
with the KV tiers (host memory, disk) reloading each history against recomputing it, per
history length, and the crossover against `servelm plan offload`'s.

For each history length L: --num-convs conversations each prefill an L-token history (turn
1; all lengths' histories together are larger than the device pool), other prompts then
push the last of them out, and each conversation returns with its history + 16 new tokens,
one at a time (so TTFT is the reload or the recompute, not queueing). Modes: "recompute" (no tiers), "host" (--kv-host-memory-gb,
reload always), "disk" (--kv-disk-dir only, reload always; reads go through the page
cache) and "cost" (host + disk, the engine's own reload-or-recompute decision). Each
returning turn's cache explain (tokens per tier, decision, estimated reload and recompute
seconds) is kept in the JSON.

    .venv/bin/python benchmarks/cpu/kv_tiers_multiturn.py --lengths 128,512,2048 \
        --out-dir benchmarks/results/kv-tiers-multiturn-$(date -u +%Y%m%dT%H%M%SZ)
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from servelm.bench.results import git_commit, machine_info
from servelm.config import EngineArgs
from servelm.engine.kv_connector import find_connector
from servelm.engine_builder import build_engine
from servelm.kv_tiers.tiers import KVTiers
from servelm.protocol import EngineRequest, SamplingParams

MODES = ("recompute", "host", "disk", "cost")


def _engine(model: str, mode: str, pool_bytes: int, threads: int, disk_dir: str):
    kw = {}
    if mode in ("host", "cost"):
        kw.update(kv_host_memory_gb=2.0)
    if mode in ("disk", "cost"):
        kw.update(kv_disk_dir=disk_dir, kv_disk_gb=4.0)
    if mode in ("host", "disk"):
        kw.update(kv_reload_policy="always")
    return build_engine(EngineArgs(model=model, kv_cache_memory=pool_bytes, num_threads=threads,
                                   max_num_batched_tokens=2048, **kw))


def _tiers(engine) -> KVTiers | None:
    return find_connector(engine.kv_connector, KVTiers)


def _one(engine, rid: str, prompt: list[int], max_tokens: int):
    engine.add_request(EngineRequest(rid, prompt, SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    timings = None
    while engine.has_unfinished:
        for d in engine.step():
            if d.timings is not None:
                timings = d.timings
    return timings


def run_mode(engine, args, mode: str, lengths: list[int]) -> list[dict]:
    """Turn 1 of every conversation (all lengths), one flush of the pool, then every
    returning turn: the histories together are larger than the pool, and the flush pushes
    out the last of them."""
    pool_tokens = engine.block_manager.num_blocks * engine.block_manager.block_size
    rng = random.Random(0)
    vocab = engine.vocab_size

    def tokens(n):
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    convs = [(n, tokens(n)) for n in lengths for _ in range(args.num_convs)]
    for i, (_, h) in enumerate(convs):
        _one(engine, f"t1-{i}", h, 1)
    flushed = 0
    while flushed < pool_tokens + pool_tokens // 4:
        n = min(2048, pool_tokens // 2)
        _one(engine, f"flush-{flushed}", tokens(n), 1)
        flushed += n
    if _tiers(engine) is not None:
        _tiers(engine).io.drain()
    rows = []
    for i, (n, h) in enumerate(convs):
        prompt = h + tokens(16)
        t = _one(engine, f"t2-{i}", prompt, args.output_len)
        rows.append({"mode": mode, "history_tokens": n, "prompt_tokens": len(prompt),
                     "ttft_s": t.ttft_s, "num_cached_tokens": t.num_cached_tokens,
                     "cache_explain": t.cache_explain})
        print(f"{mode:9s} L={n:5d}: TTFT {t.ttft_s * 1e3:.1f} ms "
              f"{(t.cache_explain or {}).get('decision', '')}", flush=True)
    if _tiers(engine) is not None:
        rows[-1]["tier_stats"] = _tiers(engine).stats()
    return rows


def planner_crossover(model: str, tiers_bw: dict[str, float]) -> dict:
    """`servelm plan offload` at its defaults and with this run's measured bandwidths."""
    out = {}
    for tier, flag in (("dram", "--dram-bw"), ("nvme", "--disk-bw")):
        base = [sys.executable, "-m", "servelm.cli", "plan", "offload", "--model", model,
                "--kv-dtype", "fp32", "--tier", tier, "--tokens", "1024", "--json"]
        measured = tiers_bw.get({"dram": "host", "nvme": "disk"}[tier])
        for label, extra in (("default", []), ("measured_bw", [flag, f"{measured / 1e9:.6f}"]
                                                if measured else None)):
            if extra is None:
                continue
            res = subprocess.run(base + extra, capture_output=True, text=True, check=False)
            if res.returncode == 0:
                plan = json.loads(res.stdout)
                out[f"{tier}_{label}"] = {k: plan.get(k) for k in (
                    "crossover_tokens", "tier_bandwidth_Bps", "reload_time_s",
                    "recompute_time_s", "inputs")}
            else:
                out[f"{tier}_{label}"] = {"error": res.stderr.strip()[-300:]}
    return out


def measured_crossover(rows: list[dict]) -> dict:
    """Per tier: the shortest history whose mean returning TTFT beats recompute's."""
    mean = {}
    for r in rows:
        mean.setdefault((r["mode"], r["history_tokens"]), []).append(r["ttft_s"])
    mean = {k: sum(v) / len(v) for k, v in mean.items()}
    lengths = sorted({r["history_tokens"] for r in rows})
    out = {}
    for mode in ("host", "disk"):
        wins = [n for n in lengths if (mode, n) in mean and ("recompute", n) in mean
                and mean[(mode, n)] < mean[("recompute", n)]]
        out[mode] = {"first_winning_history_tokens": wins[0] if wins else None,
                     "mean_ttft_s": {n: mean.get((mode, n)) for n in lengths},
                     "recompute_mean_ttft_s": {n: mean.get(("recompute", n)) for n in lengths}}
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode in MODES:
        pts = {}
        for r in rows:
            if r["mode"] == mode:
                pts.setdefault(r["history_tokens"], []).append(r["ttft_s"] * 1e3)
        if pts:
            xs = sorted(pts)
            ax.plot(xs, [sum(pts[x]) / len(pts[x]) for x in xs], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("history tokens (returning turn: history + 16)")
    ax.set_ylabel("TTFT of the returning turn (ms)")
    ax.set_title("KV tiers: reload vs recompute")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--planner-model", default="SmolLM2-135M")
    p.add_argument("--lengths", default="128,256,512,1024,2048")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--num-convs", type=int, default=2)
    p.add_argument("--output-len", type=int, default=2)
    p.add_argument("--pool-bytes", type=int, default=160 * 2**20)  # ~4k tokens of this model
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out-dir", required=True)
    args = p.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    rows = []
    for mode in args.modes.split(","):  # one engine per mode; histories differ per length
        disk_dir = tempfile.mkdtemp(prefix="servelm-kv-bench-")
        try:
            engine = _engine(args.model, mode, args.pool_bytes, args.threads, disk_dir)
            rows += run_mode(engine, args, mode, [int(x) for x in args.lengths.split(",")])
            if _tiers(engine) is not None:
                _tiers(engine).close()
        finally:
            shutil.rmtree(disk_dir, ignore_errors=True)
    bw = {}
    for r in rows:
        for tier in ("host", "disk"):
            b = (r.get("tier_stats") or {}).get(tier, {}).get("bandwidth_Bps")
            if b:
                bw[tier] = b
    result = {"kind": "kv-tiers-multiturn", "command": " ".join(sys.argv),
              "machine": machine_info(args.threads), "commit": git_commit(),
              "wall_s": time.time() - start, "args": vars(args), "rows": rows,
              "measured_bandwidth_Bps": bw, "measured_crossover": measured_crossover(rows),
              "planner": planner_crossover(args.planner_model, bw)}
    (out_dir / "result.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    plot(rows, out_dir / "ttft.png")
    print(json.dumps(result["measured_crossover"], indent=1, default=str))
    print(f"wrote {out_dir}/result.json, ttft.png in {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
