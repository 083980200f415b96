"""Generate docs/choosing.md: which engine for which workload, from the benchmark records.

Owns: the page. Its measured half is the newest record of each kind on each CPU class under
benchmarks/results/ (benchmarks/choosing_records.py finds them and derives the class from the
CPU facts each record stores); every figure names its record, every row names its CPU class,
and each "what reverses the choice" is a crossover computed from a record's own sweep, or
"no crossover measured" where the record has none. Its published half quotes the cited
sources below (GPU figures; none of those engines' GPU paths runs here).
Never: compares figures measured on two CPU classes, or writes a reversal that no record
measured. Regenerate after recording a benchmark:

    .venv/bin/python benchmarks/choosing.py           # writes docs/choosing.md
    .venv/bin/python benchmarks/choosing.py --check   # exit 1 if the doc is stale

tests/docs/test_choosing.py fails when the committed doc differs from this output.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as a script or loaded by path from the tests
    sys.path.insert(0, str(HERE))

from choosing_records import (  # noqa: E402
    Crossing, Record, cpu_facts, crossings, find_records, leader_throughout, newest)

ROOT = HERE.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "choosing.md"

# A record's `system` -> the engine it is; best-vs-best peers by their configuration key.
NAMES = {"servelm": "servelm", "vllm": "vLLM-CPU", "llama.cpp": "llama.cpp",
         "hf": "HF transformers", "servelm (no prefix cache)": "servelm"}
BVB_ENGINE = {"vllm": "vLLM-CPU", "vllm-bf16": "vLLM-CPU", "llama-server": "llama.cpp",
              "llama.cpp": "llama.cpp"}  # every other key is a servelm configuration

WORKLOADS = ["single stream", "batch (64 prompts)", "long prompts", "load sweep",
             "shared prefixes", "multi-turn history (KV tiers)", "many adapters",
             "speculative decoding", "weight format", "structured output"]

# The published choice on a GPU, workload by workload, as the sources below state it.
GPU_CHOICE = [
    ("single stream", "TensorRT-LLM for the lowest TTFT at moderate load; vLLM / SGLang when "
     "the model changes often"),
    ("batch", "TensorRT-LLM for the highest throughput of one pinned model; vLLM at "
     "saturation in another run; an engine build pays off only for a model that stays"),
    ("shared prefixes", "SGLang (RadixAttention); in one 2026 run vLLM's prefix caching "
     "gained as much"),
    ("many adapters", "vLLM / SGLang (S-LoRA-style batching of adapters)"),
    ("structured output", "all three GPU engines share XGrammar"),
]

# Published figures, each as its source states it (GPU; none of these engines' GPU paths
# runs on this machine). Keep the quotes exact and the URLs to the page they came from.
PUBLISHED = [
    ("vLLM", "vLLM 0.6.0 vs 0.5.3 on ShareGPT: 2.7x throughput and 5x faster TPOT for Llama 8B "
     "on 1xH100; 1.8x throughput and 2x less TPOT for Llama 70B on 4xH100",
     "https://blog.vllm.ai/2024/09/05/perf-update.html"),
    ("TensorRT-LLM, vLLM, SGLang", "Llama 3.3 70B FP8 on one H100 SXM, 50 concurrent requests: "
     "TensorRT-LLM 2,100 tok/s, SGLang 1,920, vLLM 1,850; TTFT p50 at 10 requests 105 / 112 / "
     "120 ms; cold start about 28 min for TensorRT-LLM (engine build) against about 58-62 s",
     "https://www.spheron.network/blog/vllm-vs-tensorrt-llm-vs-sglang-benchmarks"),
    ("TensorRT-LLM, vLLM, SGLang", "Llama-3.1-8B on one H100: TensorRT-LLM 235 ms TTFT at "
     "concurrency 32 against vLLM 514 ms; vLLM 5,333 tok/s at saturation; SGLang within a few "
     "percent of vLLM; shared-prefix caching about 2.7x throughput at a 90% hit rate for both",
     "https://runinfra.ai/news/vllm-vs-sglang-vs-tensorrt-llm-benchmark"),
    ("SGLang", "RadixAttention (prefix reuse across requests): up to 6.4x throughput over vLLM "
     "on tasks with common prefixes",
     "https://aimpact.prandi.net/en/events/2024-05-02-sglang-v01/"),
    ("S-LoRA (the multi-adapter design vLLM and SGLang follow)", "thousands of LoRA adapters on "
     "one GPU; up to 4x the throughput of vLLM with naive LoRA support",
     "https://paperswithcode.com/paper/s-lora-serving-thousands-of-concurrent-lora"),
    ("XGrammar", "the default structured-output backend of vLLM, SGLang and TensorRT-LLM: "
     "token masks computed on the CPU while the GPU runs the step",
     "https://llm-inference-books.bitcru.sh/inference-study-guides/xgrammar"),
]


INTRO = """\
servelm, vLLM-CPU, llama.cpp and HF transformers as measured on CPUs in this project's records,
workload by workload, and what vLLM, SGLang and TensorRT-LLM publish for GPUs. Each measured
figure is from the newest record of its kind on its CPU class and names that record; the class
is derived from the CPU facts the record stores (its instruction-set flags where it has them).
Figures of different CPU classes are never compared with each other: the kernels that run
differ with the instruction set, so a row's numbers are read against that row's class only.
"What reverses the choice" is computed from the record's own points (the batch size, load,
history length or rows where one series overtakes another, to the resolution of the points
measured); a record without a sweep says "no crossover measured"."""


class Row(NamedTuple):
    """One row of the by-workload table: every figure in it is from records of one class."""

    workload: str
    cpu_class: str
    measured: str
    reverses: str


class Point(NamedTuple):
    engine: str
    config: str
    value: float | None


class Part(NamedTuple):
    """What one kind of record adds to the page: table rows and a measured section."""

    rows: list[Row]
    section: str


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _x(x: float) -> str:
    return f"{x:g}"


def _cite(*records: Record) -> str:
    return ", ".join(f"`{r.name}`" for r in records)


def _join(names: Sequence[str]) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else "".join(names)


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _cfg(p: Point) -> str:
    return f" ({p.config})" if p.config else ""


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


# --- crossovers, as sentences -------------------------------------------------------------

def _sentences(found: Iterable[Crossing], unit: str) -> str:
    """Crossings as sentences, those that overtake one series over one span together."""
    groups: dict[tuple[str, float, float], list[str]] = {}
    for c in found:
        groups.setdefault((c.before, c.x_before, c.x_after), []).append(c.after)
    out = []
    for (before, lo, hi), after in groups.items():
        out.append(f"{_join(after)} overtake{'s' if len(after) == 1 else ''} {before} between "
                   f"{_x(lo)} and {_x(hi)} {unit}")
    return "; ".join(out)


def describe(xs: Sequence[float], series: Mapping[str, Sequence[float | None]], unit: str,
             higher_is_better: bool = True) -> str:
    """Every crossing among `series` along `xs`, or "no crossover measured" and why."""
    if len(xs) < 2:
        return f"no crossover measured (one point: {_x(xs[0])} {unit})" if xs else \
            "no crossover measured (no points)"
    found = crossings(xs, series, higher_is_better)
    if found:
        return _sentences(found, unit)
    lead = leader_throughout(series, higher_is_better)
    return (f"no crossover measured over {_x(xs[0])}-{_x(xs[-1])} {unit}"
            + (f": {lead} leads throughout" if lead else ""))


def lead_change(xs: Sequence[float], series: Mapping[str, Sequence[float | None]], unit: str,
                higher_is_better: bool = True) -> str:
    """The crossings of the leader at the first point and of the leader at the last (in a
    field of many settings, where the reorderings further back do not change the choice)."""
    pick = max if higher_is_better else min

    def leader_at(i: int) -> str | None:
        have = {k: v[i] for k, v in series.items() if v[i] is not None}
        return pick(have, key=have.get) if have else None

    if len(xs) < 2:
        return describe(xs, series, unit, higher_is_better)
    first, last = leader_at(0), leader_at(len(xs) - 1)
    if first is not None and last is not None and first != last:
        return describe(xs, {first: series[first], last: series[last]}, unit, higher_is_better)
    found = [c for c in crossings(xs, series, higher_is_better) if first in (c.before, c.after)]
    if found:
        return _sentences(found, unit)
    return f"no crossover measured over {_x(xs[0])}-{_x(xs[-1])} {unit}: {first} leads throughout"


# --- points and standings -----------------------------------------------------------------

def best_by_engine(points: Iterable[Point]) -> dict[str, Point]:
    """Each engine's fastest configuration among `points`."""
    out: dict[str, Point] = {}
    for p in points:
        if p.value is not None and (p.engine not in out or p.value > out[p.engine].value):
            out[p.engine] = p
    return out


def standing(points: Iterable[Point], unit: str) -> str:
    """The leading engine (at its best configuration) and how far ahead of the next one."""
    best = sorted(best_by_engine(points).values(), key=lambda p: -p.value)
    if not best:
        return "(no result)"
    top = best[0]
    text = f"**{top.engine}**{_cfg(top)} {_f(top.value)} {unit}"
    if len(best) > 1:
        nxt = best[1]
        text += (f", {_ratio(top.value, nxt.value)} the next engine, {nxt.engine}{_cfg(nxt)} "
                 f"{_f(nxt.value)}")
    return text


def _row_config(row: dict[str, Any]) -> str:
    """What a result ran: its weight file, quantization or float type, as recorded."""
    settings = row.get("settings") or {}
    if str(row.get("model", "")).endswith(".gguf"):
        return Path(row["model"]).name
    if row.get("system") == "servelm (no prefix cache)":
        return "prefix cache off"
    parts = [settings.get("quantization"), settings.get("dtype")]
    if settings.get("kv_cache_dtype") not in (None, "auto"):
        parts.append(f"{settings['kv_cache_dtype']} KV")
    return ", ".join(str(p) for p in parts if p and p != "auto")


def offline_points(rec: Record, metric: str = "output_tok_s") -> list[Point]:
    return [Point(NAMES.get(r["system"], r["system"]), _row_config(r), r.get(metric))
            for r in rec.rows()]


def engine_series(points_by_x: Sequence[list[Point]]) -> dict[str, list[float | None]]:
    """{engine: its best value at each x} from the points measured at each x."""
    best = [best_by_engine(points) for points in points_by_x]
    engines = sorted({e for b in best for e in b})
    return {e: [b[e].value if e in b else None for b in best] for e in engines}


# --- best vs best (each engine's fastest configuration) -----------------------------------

def _plain(label: str, engine: str) -> str:
    """A best-vs-best system label as a configuration of its engine, without nested
    brackets: 'servelm gguf, int8 activations (bfloat16)' -> 'gguf, int8 activations,
    bfloat16'."""
    label = label[len(engine):] if label.startswith(engine) else label
    parts = label.strip().replace(" (", ", ").replace("(", "").replace(")", "").split(", ")
    return ", ".join(dict.fromkeys(parts))  # 'bfloat16 (bfloat16)' says it once


def bvb_points(rec: Record, workload: str, metric: str) -> list[Point]:
    """One point a system of the record, in its order (None where the system failed)."""
    out = []
    for s in rec.data[0]["systems"]:
        engine = BVB_ENGINE.get(s["key"], "servelm")
        config = _plain(s["system"], engine if engine != "servelm" else "servelm ")
        out.append(Point(engine, config, None if s[workload]["error"] else s[workload][metric]))
    return out


def _bvb_sizes(rec: Record) -> list[float]:
    loads = rec.data[0]["workloads"]
    return [loads["single"]["num_prompts"], loads["batch"]["num_prompts"]]


def bvb_rows(rec: Record) -> list[Row]:
    xs = _bvb_sizes(rec)
    out_by_x = [bvb_points(rec, "single", "output_tok_s"), bvb_points(rec, "batch", "output_tok_s")]
    forms = {f"servelm {s['key']}": [s["single"]["output_tok_s"], s["batch"]["output_tok_s"]]
             for s in rec.data[0]["systems"] if s["key"] not in BVB_ENGINE}
    batch = out_by_x[1]
    default = next((p for p, s in zip(batch, rec.data[0]["systems"]) if s["key"] == "default"),
                   None)
    peers = best_by_engine(p for p in batch if p.engine != "servelm")
    top_peer = max(peers.values(), key=lambda p: p.value) if peers else None
    note = ""
    if default and default.value and top_peer and best_by_engine(batch)["servelm"] != default:
        note = (f"; servelm {default.config} {_f(default.value)} = "
                f"{_ratio(default.value, top_peer.value)} {top_peer.engine}")
    return [
        Row("single stream", rec.cpu_class,
            f"{standing(bvb_points(rec, 'single', 'decode_tok_s'), 'decode tok/s')} "
            f"({_cite(rec)})",
            "servelm's fastest form, by output tok/s: "
            f"{lead_change(xs, forms, 'prompts')} ({_cite(rec)})"),
        Row("batch (64 prompts)", rec.cpu_class,
            f"{standing(batch, 'output tok/s')}{note} ({_cite(rec)})",
            f"engines by output tok/s: {describe(xs, engine_series(out_by_x), 'prompts')} "
            f"({_cite(rec)})"),
    ]


def bvb_section(rec: Record) -> str:
    summary = rec.data[0]
    loads = summary["workloads"]
    lines = [f"#### {rec.cpu_class}: `{rec.name}`", "",
             f"| system | {loads['batch']['num_prompts']} prompts: output tok/s | peak MiB | "
             "1 prompt: decode tok/s | 1 prompt: output tok/s |", "|---|---|---|---|---|"]
    for s in summary["systems"]:
        b, one = s["batch"], s["single"]
        lines.append(f"| {s['system']} | {'FAILED' if b['error'] else _f(b['output_tok_s'])} | "
                     f"{_f(b['peak_mib'], 0)} | "
                     f"{'FAILED' if one['error'] else _f(one['decode_tok_s'])} | "
                     f"{_f(one['output_tok_s'])} |")
    lines.append("")
    for e in summary["ratios"]:
        if e.get("ratio") is None:
            lines.append(f"- {e['workload']} {e['metric']}: not measured ({e['missing']})")
            continue
        lines.append(f"- {e['workload']} {e['metric']}: servelm {e['servelm']} "
                     f"{e['servelm_value']} / {e['peer']} {e['peer_value']} = "
                     f"**{e['ratio']:.2f}x** (bar {e['bar']}x)")
    machine = summary["machine"]
    lines += ["", f"{_n(summary.get('rounds') or 1, 'round')}, each figure the median round; "
              f"CPU `{machine.get('cpu')}`, {machine.get('threads')} threads; commit "
              f"{', '.join(c[:7] for c in summary.get('commits', [])) or '?'}; "
              f"`{summary['command']}`"]
    return "\n".join(lines)


def best_vs_best(recs: list[Record]) -> Part:
    return Part([row for rec in recs for row in bvb_rows(rec)],
                "### Best vs best: each engine's fastest configuration on the CPU\n\n"
                "Two workloads, 1 prompt and 64 prompts, every system run in turn on one "
                "machine (benchmarks/cpu/run_best_vs_best.sh).\n\n"
                + "\n\n".join(bvb_section(r) for r in recs))


# --- offline single / batch, and the same GGUF file ---------------------------------------

def offline_table(rec: Record) -> str:
    rows = rec.rows()
    base = next((r["output_tok_s"] for r in rows if r["system"] == "servelm"), None)
    lines = ["| engine | ran | output tok/s | vs servelm | TTFT p50 | peak memory |",
             "|---|---|---|---|---|---|"]
    for r, p in zip(rows, offline_points(rec)):
        ttft = (r.get("ttft_s") or {}).get("p50")
        mem = r.get("peak_memory_bytes")
        lines.append(f"| {p.engine} | {p.config or '-'} | {_f(p.value)} | "
                     f"{_ratio(p.value, base)} | {_f(ttft, 3)} s | "
                     f"{_f(mem / 2**20, 0) + ' MiB' if mem else '-'} |")
    first = rows[0]
    lines += ["", f"{rec.cpu_class}: `{rec.name}` (CPU `{first['machine']['cpu']}`, "
              f"{first['machine']['usable_cores']} cores, model {first['model']}): "
              f"`{first['command'].split(' --peer-python')[0]}`"]
    return "\n".join(lines)


def offline(singles: list[Record], batches: list[Record], gguf: list[Record]) -> Part:
    rows = []
    for rec in singles:
        same_file = next((g for g in gguf if g.cpu_class == rec.cpu_class), None)
        if same_file is None:
            reverses = "no same-file record on this class: no crossover measured"
        else:
            lead = max(best_by_engine(offline_points(rec)).values(), key=lambda p: p.value)
            there = best_by_engine(offline_points(same_file))
            turn = max(there.values(), key=lambda p: p.value)
            verb = "flips" if turn.engine != lead.engine else "holds"
            reverses = (f"the weight format: on one GGUF file for both the order {verb}: "
                        f"{standing(offline_points(same_file), 'output tok/s')} "
                        f"({_cite(same_file)})")
        rows.append(Row("single stream", rec.cpu_class,
                        f"{standing(offline_points(rec), 'output tok/s')} ({_cite(rec)})",
                        reverses))
    for rec in batches:
        single = next((s for s in singles if s.cpu_class == rec.cpu_class), None)
        if single is None:
            reverses = "no single-stream record on this class: no crossover measured"
        else:
            xs = [single.rows()[0]["num_requests"], rec.rows()[0]["num_requests"]]
            series = engine_series([offline_points(single), offline_points(rec)])
            reverses = (f"engines by output tok/s: {describe(xs, series, 'prompts')} "
                        f"({_cite(single, rec)})")
        rows.append(Row("batch (64 prompts)", rec.cpu_class,
                        f"{standing(offline_points(rec), 'output tok/s')} ({_cite(rec)})",
                        reverses))
    sections = [("Single stream", singles), ("Single stream, one GGUF file for both engines",
                                              gguf), ("Batch: 64 prompts at once", batches)]
    text = "\n\n".join(f"### {title}\n\n" + "\n\n".join(offline_table(r) for r in recs)
                       for title, recs in sections if recs)
    return Part(rows, text)


# --- servelm's weight formats -------------------------------------------------------------

def quant(singles: list[Record], batches: list[Record]) -> Part:
    rows, sections = [], []
    for klass in _classes(singles + batches):
        one = {_method(r.rows()[0]): r for r in singles if r.cpu_class == klass}
        many = {_method(r.rows()[0]): r for r in batches if r.cpu_class == klass}
        methods = sorted(set(one) | set(many))
        lines = [f"#### {klass}", "", "| servelm, weights | 1 prompt: output tok/s | record | "
                 "64 prompts: output tok/s | record |", "|---|---|---|---|---|"]
        series = {}
        for m in methods:
            a = one[m].rows()[0]["output_tok_s"] if m in one else None
            b = many[m].rows()[0]["output_tok_s"] if m in many else None
            series[m] = [a, b]
            lines.append(f"| {m} | {_f(a)} | {_cite(one[m]) if m in one else '-'} | {_f(b)} | "
                         f"{_cite(many[m]) if m in many else '-'} |")
        sections.append("\n".join(lines))
        at_one = [Point("servelm", m, v[0]) for m, v in series.items() if v[0]]
        top = max(at_one, key=lambda p: p.value)
        low = min(at_one, key=lambda p: p.value)
        leads = {m for m, r in many.items()
                 if r.rows()[0]["output_tok_s"] == max(v[1] or 0 for v in series.values())}
        rows.append(Row("weight format", klass,
                        f"1 prompt: servelm **{top.config}** {_f(top.value)} output tok/s, "
                        f"{_ratio(top.value, low.value)} the slowest ({low.config}) "
                        f"({_cite(one[top.config], one[low.config])})",
                        f"servelm's fastest weights by output tok/s: "
                        f"{lead_change([1, 64], series, 'prompts')} "
                        f"({_cite(*(one[m] for m in {top.config} & one.keys()))}, "
                        f"{_cite(*(many[m] for m in sorted(leads)))}; every method's newest "
                        "record is in the table below)"))
    return Part(rows, "### servelm's weight formats (servelm alone, no peer)\n\n"
                + "\n\n".join(sections))


def _method(row: dict[str, Any]) -> str:
    """A servelm result's weight form as its settings record it."""
    settings = row.get("settings") or {}
    kv = settings.get("kv_cache_dtype")
    return (settings.get("quantization") or "float weights") + \
        (f", {kv} KV cache" if kv not in (None, "auto") else "")


def mixed_crossover(recs: list[Record]) -> Part:
    rows, sections = [], []
    for rec in recs:
        cases = rec.data[0]["cases"]
        xs = [c["rows"] for c in cases]
        series = {"int4 codes": [c["int4_ms"] for c in cases],
                  "bf16": [c["bf16_ms"] for c in cases]}
        lines = [f"#### {rec.cpu_class}: `{rec.name}`", "",
                 "| rows | int4 ms | bf16 ms | int4 / bf16 |", "|---|---|---|---|"]
        lines += [f"| {c['rows']} | {_f(c['int4_ms'], 2)} | {_f(c['bf16_ms'], 2)} | "
                  f"{c['int4_over_bf16']:.2f} |" for c in cases]
        lines += ["", f"`{rec.data[0]['command']}` (time a pass of {rec.data[0]['layers']} "
                  f"layers' linears of shapes {rec.data[0]['shapes']}, {rec.data[0]['rounds']} "
                  "rounds)"]
        sections.append("\n".join(lines))
        rows.append(Row("weight format", rec.cpu_class,
                        f"one row: int4 codes {_f(cases[0]['int4_ms'], 2)} ms against bf16 "
                        f"{_f(cases[0]['bf16_ms'], 2)} ms a pass of the linears ({_cite(rec)})",
                        f"time a pass (lower wins): {describe(xs, series, 'rows', False)} "
                        f"({_cite(rec)})"))
    return Part(rows, "### int4 codes against bf16 weights by rows in the step\n\n"
                + "\n\n".join(sections))


# --- over HTTP: document prompts, and a load sweep ----------------------------------------

def _in_flight(r: dict[str, Any]) -> int:
    """Requests in flight at once: the closed loop's concurrency, or all of them for an
    unbounded arrival rate."""
    load = r["load"]
    return load.get("concurrency") or (r["num_requests"] if load.get("request_rate") == "inf"
                                       else 0)


def documents(recs: list[Record]) -> Part:
    rows, sections = [], []
    for rec in recs:
        results = sorted(rec.rows(), key=lambda r: (_in_flight(r), r["system"]))
        xs = sorted({_in_flight(r) for r in results})
        engines = sorted({NAMES.get(r["system"], r["system"]) for r in results})
        at = {(NAMES.get(r["system"], r["system"]), _in_flight(r)): r for r in results}

        def series(metric: Callable[[dict], float]) -> dict[str, list[float | None]]:
            return {e: [metric(at[e, x]) if (e, x) in at else None for x in xs]
                    for e in engines}

        ttft = series(lambda r: r["ttft_ms"]["p50"])
        lines = ["| engine | in flight | TTFT p50 | TTFT p99 | TPOT p50 | output tok/s | "
                 "goodput |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {NAMES.get(r['system'], r['system'])} | {_in_flight(r)} | "
                  f"{_f(r['ttft_ms']['p50'], 0)} ms | {_f(r['ttft_ms']['p99'], 0)} ms | "
                  f"{_f(r['tpot_ms']['p50'], 0)} ms | {_f(r['output_tok_s'])} | "
                  f"{_f(100 * r['goodput'], 0)}% |" for r in results]
        # servelm's count of the prompt tokens: a peer's usage may count them otherwise
        r0 = next((r for r in results if r["system"] == "servelm"), results[0])
        per_request = r0["num_input_tokens"] // r0["num_requests"]
        lines += ["", f"{rec.cpu_class}: `{rec.name}` ({per_request} prompt tokens a request "
                  f"on average as {r0['system']} counts them, SLO TTFT "
                  f"{r0['slo']['ttft_ms']:g} ms / "
                  f"TPOT {r0['slo']['tpot_ms']:g} ms): `{r0['command'].split(' --base-url')[0]} "
                  "... --workload documents`"]
        sections.append("\n".join(lines))
        first = {e: v[0] for e, v in ttft.items() if v[0] is not None}
        lead = min(first, key=first.get)
        rows.append(Row(
            "long prompts", rec.cpu_class,
            f"documents over HTTP, {_n(xs[0], 'request')} in flight: **{lead}** has the lowest "
            f"TTFT p50, {_f(first[lead], 0)} ms ({_cite(rec)})",
            f"TTFT p50: {describe(xs, ttft, 'requests in flight', False)}; output tok/s: "
            f"{describe(xs, series(lambda r: r['output_tok_s']), 'requests in flight')} "
            f"({_cite(rec)})"))
    return Part(rows, "### Document prompts over HTTP\n\n" + "\n\n".join(sections))


def sweep(recs: list[Record]) -> Part:
    rows, sections = [], []
    for rec in recs:
        results = sorted(rec.rows(), key=lambda r: r.get("system", "servelm"))
        name = {id(r): NAMES.get(r.get("system", "servelm"), r.get("system")) for r in results}
        xs = results[0]["summary"]["rates"]
        ttft, meets = {}, []
        lines = ["| engine | highest rate meeting the goodput target | TTFT p50 at each rate |",
                 "|---|---|---|"]
        for r in results:
            s = r["summary"]
            by_rate = {p["request_rate"]: p for p in s["points"]}
            ttft[name[id(r)]] = [by_rate[x]["ttft_p50_ms"] if x in by_rate else None for x in xs]
            best = s["max_rate_meeting_target"]
            meets.append(f"{name[id(r)]} {_x(best) + ' req/s' if best is not None else 'none'}")
            lines.append(f"| {name[id(r)]} | {meets[-1].split(' ', 1)[1]} | "
                         + ", ".join(f"{_f(v, 0)}" for v in ttft[name[id(r)]]) + " ms |")
        target = results[0]["summary"]["goodput_target"]
        lines += ["", f"{rec.cpu_class}: `{rec.name}` (Poisson arrivals at {xs} req/s, "
                  f"goodput target {100 * target:g}% of requests inside the SLO)."]
        sections.append("\n".join(lines))
        rows.append(Row("load sweep", rec.cpu_class,
                        f"highest rate with {100 * target:g}% goodput (of {_x(xs[-1])} req/s "
                        f"tried): {'; '.join(meets)} ({_cite(rec)})",
                        f"TTFT p50: {describe(xs, ttft, 'req/s', False)} ({_cite(rec)})"))
    return Part(rows, "### Load sweep (Poisson arrivals, goodput against the SLO)\n\n"
                + "\n\n".join(sections))


# --- servelm alone: prefix cache, KV tiers, long context, adapters, drafts ----------------

def shared_prefix(recs: list[Record]) -> Part:
    rows = []
    for rec in recs:
        by = {r["system"]: r for r in rec.rows()}
        on, off = by.get("servelm"), by.get("servelm (no prefix cache)")
        hit = on["num_prefix_cache_hit_tokens"] / on["num_input_tokens"] if on else None
        gain = _ratio(on and on["output_tok_s"], off and off["output_tok_s"])
        rows.append(Row("shared prefixes", rec.cpu_class,
                        f"servelm alone: the prefix cache gives {gain} its own output tok/s "
                        f"({_f(on and on['output_tok_s'])} against "
                        f"{_f(off and off['output_tok_s'])}) ({_cite(rec)})",
                        f"no crossover measured (one hit rate: "
                        f"{_f(hit and 100 * hit, 0)}% of prompt tokens) ({_cite(rec)})"))
    return Part(rows, "### Shared prefixes (no peer in this run: servelm against itself)\n\n"
                + "\n\n".join(offline_table(r) for r in recs))


def kv_tiers(recs: list[Record]) -> Part:
    rows, sections = [], []
    for rec in recs:
        data = rec.data[0]
        ttfts: dict[str, dict[int, list[float]]] = {}
        for r in data["rows"]:
            ttfts.setdefault(r["mode"], {}).setdefault(r["history_tokens"], []).append(r["ttft_s"])
        xs = sorted({x for by in ttfts.values() for x in by})
        mean = {m: [sum(by[x]) / len(by[x]) if x in by else None for x in xs]
                for m, by in ttfts.items()}
        lines = ["| history tokens | " + " | ".join(f"{m} TTFT s" for m in mean) + " |",
                 "|---" * (len(mean) + 1) + "|"]
        lines += [f"| {x} | " + " | ".join(_f(v[i], 3) for v in mean.values()) + " |"
                  for i, x in enumerate(xs)]
        lines += ["", f"{rec.cpu_class}: `{rec.name}`: `{data['command']}` (mean of "
                  f"{data['args']['num_convs']} conversations a point)"]
        sections.append("\n".join(lines))
        rows.append(_kv_row(rec, xs, mean))
    return Part(rows, "### Multi-turn history: KV reloaded from host or disk against "
                "recomputed\n\n" + "\n\n".join(sections))


KV_MODES = {"host": "host reload", "disk": "disk reload",
            "cost": "the cost model's choice of reload or recompute"}


def _kv_row(rec: Record, xs: list[int], mean: dict[str, list[float | None]]) -> Row:
    base = mean.get("recompute")
    tiers = [m for m in mean if m != "recompute"]
    if not base or not tiers:
        return Row("multi-turn history (KV tiers)", rec.cpu_class,
                   f"(no recompute baseline or no tier) ({_cite(rec)})", "no crossover measured")
    last = {m: mean[m][-1] for m in tiers if mean[m][-1] is not None}
    best = min(last, key=last.get)
    crossed = [c for m in tiers for c in crossings(xs, {KV_MODES.get(m, m): mean[m],
                                                        "recompute": base}, False)]
    held = [KV_MODES.get(m, m) for m in tiers
            if leader_throughout({m: mean[m], "recompute": base}, False) == m]
    turns = [_sentences(crossed, "history tokens")] if crossed else []
    if held:
        turns.append(f"no crossover measured over {xs[0]}-{xs[-1]} history tokens: "
                     f"{_join(held)} beat{'s' if len(held) == 1 else ''} recompute "
                     "at every length")
    return Row("multi-turn history (KV tiers)", rec.cpu_class,
               f"servelm alone: at {xs[-1]} history tokens, {KV_MODES.get(best, best)} "
               f"{_f(last[best], 3)} s TTFT against recompute {_f(base[-1], 3)} s "
               f"({_ratio(base[-1], last[best])} faster) ({_cite(rec)})",
               f"{'; '.join(turns)} ({_cite(rec)})")


def long_context(recs: list[Record]) -> Part:
    rows, sections = [], []
    for rec in recs:
        data = rec.data[0]
        lines = ["| context tokens | TTFT s | decode step ms | longest stall of the other "
                 "streams s |", "|---|---|---|---|"]
        lines += [f"| {r['context_tokens']} | {_f(r['ttft_s'], 3)} | "
                  f"{_f(1e3 * r['decode_step_s'], 2)} | {_f(r['stall_max_gap_s'], 3)} |"
                  for r in data["rows"]]
        lines += ["", f"{rec.cpu_class}: `{rec.name}` (model: {data['model']}; "
                  f"{data['args']['num_streams']} streams sharing the steps, chunk budget "
                  f"{data['args']['budget']} tokens): `{data['command']}`"]
        sections.append("\n".join(lines))
        top = data["rows"][-1]
        rows.append(Row("long prompts", rec.cpu_class,
                        f"servelm alone, a tiny model: {top['context_tokens']} tokens of context "
                        f"take {_f(top['ttft_s'], 2)} s to the first token and stall the other "
                        f"streams up to {_f(top['stall_max_gap_s'], 2)} s ({_cite(rec)})",
                        f"no crossover measured (one engine, one setting: no second series to "
                        f"cross) ({_cite(rec)})"))
    return Part(rows, "### Long context (servelm alone)\n\n" + "\n\n".join(sections))


def lora(recs: list[Record]) -> Part:
    rows, sections = [], []
    for rec in recs:
        data = rec.data[0]
        cases = data["rows"]
        base = next(c["output_tok_s"] for c in cases if not c["lora"] and not c["eager"])
        lines = ["| adapters | slots | output tok/s | vs no LoRA | adapter loads | evictions |",
                 "|---|---|---|---|---|---|"]
        lines += [f"| {c['adapters'] if c['lora'] else 'no LoRA' + (' (eager)' * c['eager'])} "
                  f"| {c['slots'] or '-'} | {_f(c['output_tok_s'])} | "
                  f"{_ratio(c['output_tok_s'], base)} | {c.get('loads', '-')} | "
                  f"{c.get('evictions', '-')} |" for c in cases]
        lines += ["", f"{rec.cpu_class}: `{rec.name}` (CPU `{data['cpu_model']}`, rank "
                  f"{data['rank']}, {data['num_requests']} requests): `{data['command']}`"]
        sections.append("\n".join(lines))
        used = [c for c in cases if c["lora"] and c["adapters"]]
        low = min(used, key=lambda c: c["output_tok_s"])
        high = max(used, key=lambda c: c["output_tok_s"])
        rows.append(Row(
            "many adapters", rec.cpu_class,
            f"servelm alone (no peer ran adapters): {_ratio(high['output_tok_s'], base)} the "
            f"base model's output tok/s with {_n(high['adapters'], 'adapter')} in "
            f"{_n(high['slots'], 'slot')}, {_ratio(low['output_tok_s'], base)} with "
            f"{_n(low['adapters'], 'adapter')} in {_n(low['slots'], 'slot')} ({_cite(rec)})",
            "no crossover measured: every case with an adapter ran "
            + ("below" if high["output_tok_s"] < base else "at or above")
            + f" the base model (what a merged adapter costs), and no peer ran ({_cite(rec)})"))
    return Part(rows, "### Many adapters (multi-LoRA, servelm alone)\n\n"
                + "\n\n".join(sections))


def spec(recs: list[Record]) -> Part:
    rows, sections = [], []
    for rec in recs:
        data = rec.data[0]
        runs = data["runs"]
        xs = sorted({r["batch"] for r in runs})
        tasks = sorted({r["task"] for r in runs})
        label = lambda r: r["method"] if r["method"] == "off" else f"{r['method']} {r['mode']}"
        tok = {(t, label(r), r["batch"]): r["output_tok_s"] for t in tasks for r in runs
               if r["task"] == t}
        methods = sorted({label(r) for r in runs}, key=lambda m: (m != "off", m))
        lines = ["| task | method | " + " | ".join(f"batch {x}" for x in xs) + " |",
                 "|---" * (len(xs) + 2) + "|"]
        leads, turns = [], []
        for t in tasks:
            for m in methods:
                lines.append(f"| {t} | {m} | " + " | ".join(_f(tok.get((t, m, x))) for x in xs)
                             + " |")
            best = max((m for m in methods if m != "off"), key=lambda m: tok[t, m, xs[0]])
            leads.append(f"{t}: {best} {_ratio(tok[t, best, xs[0]], tok[t, 'off', xs[0]])} "
                         "off")
            series = {best: [tok.get((t, best, x)) for x in xs],
                      "off": [tok.get((t, "off", x)) for x in xs]}
            turns.append(f"{t}: {describe(xs, series, 'sequences', True)}")
        lines += ["", f"{rec.cpu_class}: `{rec.name}` (output tok/s; "
                  f"{data['num_speculative_tokens']} draft tokens, {data['output_len']} output "
                  f"tokens): `{' '.join(data['command'][:4])} ...`"]
        sections.append("\n".join(lines))
        rows.append(Row("speculative decoding", rec.cpu_class,
                        f"servelm alone, one sequence, best drafter against none: "
                        f"{'; '.join(leads)} ({_cite(rec)})",
                        f"{'; '.join(turns)} ({_cite(rec)})"))
    return Part(rows, "### Speculative decoding (servelm alone, output tok/s)\n\n"
                + "\n\n".join(sections))


# --- the page -----------------------------------------------------------------------------

def _classes(recs: Iterable[Record]) -> list[str]:
    """The CPU classes of `recs`, the one with the newest record first."""
    newest_of: dict[str, str] = {}
    for r in recs:
        newest_of[r.cpu_class] = max(newest_of.get(r.cpu_class, ""), r.stamp)
    return sorted(newest_of, key=lambda k: (newest_of[k], k), reverse=True)


def _class_basis(rec: Record) -> str:
    name, flags = cpu_facts(rec.data[0])
    if not flags:
        return f"`{name}`, no instruction-set flags recorded"
    shown = [f for f in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512_vp2intersect",
                         "avx_vnni", "avx512f", "avx2") if f in flags]
    return f"`{name}` with {', '.join(shown)}" + ("" if "avx512f" in flags else "; no avx512f")


def classes_table(recs: list[Record]) -> str:
    lines = ["| CPU class | what the records store | kinds whose newest record is on it |",
             "|---|---|---|"]
    for klass in _classes(recs):
        mine = sorted((r for r in recs if r.cpu_class == klass), key=lambda r: r.stamp)
        kinds = sorted({r.kind for r in mine})
        lines.append(f"| {klass} | {_class_basis(mine[-1])} | {', '.join(kinds)} |")
    return "\n".join(lines)


def workload_table(rows: list[Row], order: list[str]) -> str:
    rank = {k: i for i, k in enumerate(order)}
    rows = sorted(rows, key=lambda r: (WORKLOADS.index(r.workload), rank.get(r.cpu_class, -1)))
    lines = ["| workload | CPU class | measured here (record) | what reverses the choice "
             "(computed from the record's sweep) |", "|---|---|---|---|"]
    lines += [f"| {r.workload} | {r.cpu_class} | {r.measured} | {r.reverses} |" for r in rows]
    return "\n".join(lines)


def render(results: Path = RESULTS) -> str:
    latest = newest(find_records(results))

    def of(kind: str) -> list[Record]:
        return sorted((r for (k, _, _), r in latest.items() if k == kind),
                      key=lambda r: (r.stamp, r.variant), reverse=True)

    makers: list[tuple[Callable[..., Part], tuple[str, ...]]] = [
        (best_vs_best, ("best-vs-best",)),
        (offline, ("offline-single", "offline-batch64", "gguf-same-file")),
        (documents, ("serve-documents",)), (sweep, ("serve-sweep",)),
        (shared_prefix, ("shared-prefix",)), (kv_tiers, ("kv-tiers",)),
        (long_context, ("long-context",)), (lora, ("lora",)), (spec, ("spec",)),
        (quant, ("quant-single", "quant-batch64")), (mixed_crossover, ("mixed-crossover",))]
    parts = [make(*(of(k) for k in kinds)) for make, kinds in makers
             if any(of(k) for k in kinds)]
    rows = [row for part in parts for row in part.rows]
    rows.append(Row("structured output", "-", "not measured here (no record)",
                    "no crossover measured"))
    gpu = "\n".join(f"| {w} | {text} |" for w, text in GPU_CHOICE)
    published = "\n".join(f"- **{who}**: {what}. <{url}>" for who, what, url in PUBLISHED)
    measured = "\n\n".join(part.section for part in parts)
    return f"""# Choosing an engine

<!-- Generated by benchmarks/choosing.py from benchmarks/results/ and the cited sources; do
not edit by hand: rerun the script (tests/docs/test_choosing.py checks it is current). -->

{INTRO}

## CPU classes in the records

{classes_table(list(latest.values()))}

## By workload (CPU, measured)

{workload_table(rows, _classes(latest.values()))}

## On a GPU (published, not measured here)

SGLang and TensorRT-LLM do not run on these machines (no GPU); these are the sources' own
words, listed under "Published elsewhere" below.

| workload | published choice |
|---|---|
{gpu}

## Measured here

{measured}

## Published elsewhere (GPU)

{published}
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/choosing.md is stale")
    p.add_argument("--results", type=Path, default=RESULTS,
                   help="the folder of benchmark records to read")
    args = p.parse_args(argv)
    if not args.results.is_dir():
        p.error(f"--results: no such folder: {args.results}")
    text = render(args.results)
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print("docs/choosing.md is stale: run benchmarks/choosing.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
