"""Generate docs/choosing.md: servelm, vLLM, SGLang, TensorRT-LLM and llama.cpp side by side.

The measured half comes from the benchmark records in benchmarks/results/ (the newest record
of each kind; every figure names its file), the published half from the cited sources below
(each figure is quoted from the page at its URL). Regenerate after recording a benchmark:

    .venv/bin/python benchmarks/choosing.py           # writes docs/choosing.md
    .venv/bin/python benchmarks/choosing.py --check   # exit 1 if the doc is stale

tests/docs/test_choosing.py fails when the committed doc differs from this output.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "choosing.md"

NAMES = {"servelm": "servelm", "vllm": "vLLM-CPU", "llama.cpp": "llama.cpp", "hf": "HF transformers",
         "servelm (no prefix cache)": "servelm, prefix cache off"}

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


def _latest(pattern: str) -> Path | None:
    """The newest record matching `pattern` (timestamped names sort by time)."""
    files = sorted(p for p in glob.glob(str(RESULTS / pattern))
                   if re.search(r"\d{8}T\d{6}Z\.json$", p))
    return Path(files[-1]) if files else None


def _load(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    return data if isinstance(data, list) else [data]


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _ttft_s(row: dict) -> float | None:
    t = row.get("ttft_s")
    if isinstance(t, dict):
        return t.get("p50")
    t = row.get("ttft_ms")
    return t["p50"] / 1000 if isinstance(t, dict) and t.get("p50") is not None else None


def offline_table(path: Path) -> tuple[str, dict[str, float]]:
    rows = _load(path)
    base = next((r["output_tok_s"] for r in rows if r["system"] == "servelm"), None)
    lines = ["| engine | output tok/s | vs servelm | TTFT p50 | peak memory |",
             "|---|---|---|---|---|"]
    for r in rows:
        ratio = r["output_tok_s"] / base if base else None
        mem = r.get("peak_memory_bytes")
        lines.append(f"| {NAMES.get(r['system'], r['system'])} | {_f(r['output_tok_s'])} | "
                     f"{_f(ratio, 2)}x | {_f(_ttft_s(r), 3)} s | "
                     f"{_f(mem / 2**20, 0) + ' MiB' if mem else '-'} |")
    first = rows[0]
    lines += ["", f"Record `{path.name}` ({first['machine']['cpu']}, "
              f"{first['machine']['usable_cores']} cores, model {first['model']}): "
              f"`{first['command'].split(' --peer-python')[0]}`"]
    return "\n".join(lines), {r["system"]: r["output_tok_s"] for r in rows}


def serve_documents() -> tuple[str, dict[str, dict[str, dict]]]:
    path = _latest("serve-documents-batch-servelm-*.json")
    if path is None:
        return "(no record)", {}
    stamp = path.name.rsplit("-", 1)[1]
    out: dict[str, dict[str, dict]] = {}
    lines = ["| engine | load | TTFT p50 | TTFT p99 | TPOT p50 | output tok/s | goodput |",
             "|---|---|---|---|---|---|---|"]
    for mode in ("sequential", "batch"):
        for f in sorted(RESULTS.glob(f"serve-documents-{mode}-*-{stamp}")):
            r = _load(f)[0]
            out.setdefault(mode, {})[r["system"]] = r
            load = "one at a time" if mode == "sequential" else \
                f"{r['num_requests']} at once"
            lines.append(f"| {NAMES.get(r['system'], r['system'])} | {load} | "
                         f"{_f(r['ttft_ms']['p50'], 0)} ms | {_f(r['ttft_ms']['p99'], 0)} ms | "
                         f"{_f(r['tpot_ms']['p50'], 0)} ms | {_f(r['output_tok_s'])} | "
                         f"{_f(100 * r['goodput'], 0)}% |")
    r = out["sequential"]["servelm"]
    lines += ["", f"Records `serve-documents-*-{stamp}` ({r['num_input_tokens'] // r['num_requests']}"
              f" prompt tokens a request on average, SLO TTFT {r['slo']['ttft_ms']:g} ms / TPOT "
              f"{r['slo']['tpot_ms']:g} ms): `{r['command'].split(' --base-url')[0]} ... "
              f"--workload documents`"]
    return "\n".join(lines), out


def serve_sweep() -> str:
    path = _latest("serve-sweep-servelm-*.json")
    if path is None:
        return "(no record)"
    stamp = path.name.rsplit("-", 1)[1]
    lines = ["| engine | highest rate meeting 90% goodput | first rate below it |",
             "|---|---|---|"]
    for f in sorted(RESULTS.glob(f"serve-sweep-*-{stamp}")):
        r = _load(f)[0]
        s = r["summary"]
        best = s["max_rate_meeting_target"]
        lines.append(f"| {NAMES.get(r['system'], r['system'])} | "
                     f"{_f(best, 2) + ' req/s' if best is not None else 'none of ' + str(s['rates'])} | "
                     f"{_f(s['first_rate_below_target'], 2) + ' req/s' if s['first_rate_below_target'] else 'none up to ' + _f(max(s['rates']), 2)} |")
    lines += ["", f"Records `serve-sweep-*-{stamp}` (rates {s['rates']} req/s)."]
    return "\n".join(lines)


def shared_prefix() -> tuple[str, float | None]:
    path = _latest("offline-shared-prefix-2*.json")
    if path is None:
        return "(no record)", None
    table, tok = offline_table(path)
    on, off = tok.get("servelm"), tok.get("servelm (no prefix cache)")
    return table, (on / off if on and off else None)


def _winner(tok: dict[str, float]) -> str:
    return NAMES.get(max(tok, key=tok.get), max(tok, key=tok.get))


def render() -> str:
    single, single_tok = offline_table(_latest("offline-single-2*.json"))
    gguf, gguf_tok = offline_table(_latest("quant-single-gguf-vs-llama.cpp-*.json"))
    batch, batch_tok = offline_table(_latest("offline-batch64-2*.json"))
    batch_rows = {r["system"]: r for r in _load(_latest("offline-batch64-2*.json"))}
    mem_ratio = (batch_rows["vllm"]["peak_memory_bytes"] / batch_rows["servelm"]["peak_memory_bytes"]
                 if {"vllm", "servelm"} <= batch_rows.keys() else None)
    docs, docs_rows = serve_documents()
    prefix, prefix_gain = shared_prefix()
    sweep = serve_sweep()
    seq = docs_rows.get("sequential", {})
    fastest_doc_ttft = min(seq, key=lambda k: seq[k]["ttft_ms"]["p50"]) if seq else None
    published = "\n".join(f"- **{who}**: {what}. <{url}>" for who, what, url in PUBLISHED)
    sgl_trt = ("SGLang and TensorRT-LLM do not run here (no GPU); their column is the "
               "published one.")
    choice = [
        "| workload | here (CPU, measured) | GPU (published) | what reverses the choice |",
        "|---|---|---|---|",
        f"| single stream | {_winner(single_tok)} (fp32 weights); {_winner(gguf_tok)} with "
        "GGUF weights | TensorRT-LLM for the lowest TTFT at moderate load; vLLM / SGLang "
        "when the model changes often | the weight format: llama.cpp reads its Q4_1 GGUF "
        "while servelm's default path reads float32, and a decode step on 2 cores is "
        "bandwidth-bound, so the engine reading the fewest weight bytes wins; on the same GGUF "
        "file the order flips |",
        f"| batch (64 prompts) | {_winner(batch_tok)} | TensorRT-LLM for the highest "
        "throughput of one pinned model; vLLM at saturation in another run | batch size and "
        "memory: llama.cpp serves requests one after another here; vLLM-CPU takes "
        f"{_f(mem_ratio, 1)}x servelm's peak memory; an engine build (TensorRT-LLM) pays off only for a model that "
        "stays |",
        f"| long prompts (documents) | {NAMES.get(fastest_doc_ttft, fastest_doc_ttft)} has the "
        "lowest TTFT one at a time | no published figure collected here | the chunk "
        "budget: a long prompt stalls the streams sharing its steps (`servelm doctor` names "
        "it); all-at-once load turns TTFT into queueing for every engine |",
        f"| shared prefixes | servelm ({_f(prefix_gain, 1)}x its own throughput with the prefix "
        "cache on) | SGLang (RadixAttention); in one 2026 run vLLM's prefix caching gained as "
        "much | the hit rate: unique prompts get nothing from any prefix cache, and a "
        "pool too small for the shared prefix thrashes it |",
        "| many adapters | not measured here: servelm's multi-LoRA has no record yet | vLLM / "
        "SGLang (S-LoRA-style batching of adapters) | the number of distinct adapters per "
        "batch and their rank; one adapter is best merged into the weights |",
        "| structured output | not measured here | all three GPU engines share XGrammar | "
        "grammar compile time for a schema seen once; the mask cost per step is hidden only "
        "while the step is longer than the mask |",
    ]
    return f"""# Choosing an engine

<!-- Generated by benchmarks/choosing.py from benchmarks/results/ and the cited sources; do
not edit by hand: rerun the script (tests/docs/test_choosing.py checks it is current). -->

servelm, vLLM, SGLang, TensorRT-LLM and llama.cpp, workload by workload. Where a peer runs on
this machine (CPU: vLLM-CPU, llama.cpp, HF transformers) the figures are servelm's own
same-run measurements, each naming its record; elsewhere they are published numbers, quoted
with their source. {sgl_trt} Numbers from different machines, models and dates are not
comparable with each other; only the rows of one table are.

## By workload

{chr(10).join(choice)}

## Measured here

### Single stream (fp32 weights; llama.cpp runs its Q4_1 GGUF)

{single}

### Single stream, GGUF weights (servelm and llama.cpp on the same file)

{gguf}

### Batch: 64 prompts at once

{batch}

### Document prompts over HTTP

{docs}

### Shared prefixes (no peer in this run: servelm against itself)

{prefix}

### Load sweep (Poisson arrivals, goodput against the SLO)

{sweep}

## Published elsewhere (GPU)

{published}
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/choosing.md is stale")
    args = p.parse_args(argv)
    text = render()
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
