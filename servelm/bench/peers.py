"""Offline benchmark of a peer system (llama.cpp, vLLM, HF transformers) on a servelm workload.

A standalone script: it runs in the peer's own virtual environment with only the standard
library, numpy and the peer's library, and loads workloads.py and results.py from this folder
by path. It writes the same JSON schema as `servelm bench offline`.

    /work/peers/llama/bin/python servelm/bench/peers.py --backend llama.cpp --model X.gguf \
        --num-prompts 64 --input-len 32:256 --output-len 128 --threads 2 --out r.json
    python servelm/bench/peers.py --backend llama-server \
        --server-bin /work/peers/llama.cpp/bin/llama-server --model X.gguf ...

Backends: llama.cpp (llama-cpp-python, one request after another: its Python API drives one
sequence), llama-server (llama.cpp's own server started here with one slot per request,
continuous batching, all requests sent at once; this process only needs the standard
library), vllm (LLM.generate, CPU guide settings), hf (one left-padded generate per length).
Every backend: greedy, exactly max_tokens new tokens per request (EOS is ignored), one warm-up
request (its own seed) before the clock starts, all requests "arrive" when the clock starts.
Never: runs two systems at once, or measures anything but the one backend it was given.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from typing import Any, Callable

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_servelm_bench_{name}",
                                                  os.path.join(_HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


workloads = _load("workloads")
results = _load("results")
RequestTiming = results.RequestTiming

WARMUP_SEED_OFFSET = 10_000


def warmup_requests(vocab_size: int, seed: int) -> list:
    return workloads.random_lengths(1, (16, 16), (8, 8), vocab_size, seed + WARMUP_SEED_OFFSET)


# --- llama.cpp ---------------------------------------------------------------------------


def run_llama_cpp(args: argparse.Namespace, requests: list) -> tuple[list, float, dict]:
    """One request after another: llama-cpp-python has no batched offline generate (its
    low-level llama_batch can hold several sequences, but the Python Llama class drives one)."""
    import llama_cpp

    max_len = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    n_ctx = max(512, ((max_len + 16 + 255) // 256) * 256)
    llm = llama_cpp.Llama(model_path=args.model, n_threads=args.threads,
                          n_threads_batch=args.threads, n_ctx=n_ctx, n_batch=512,
                          n_ubatch=512, seed=args.seed, verbose=args.verbose)
    # Llama.generate never stops by itself (EOS included): we take exactly max_tokens.

    def one(req, arrival: float) -> RequestTiming:
        times = []
        gen = llm.generate(req.prompt_token_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                           repeat_penalty=1.0, reset=True)
        for _ in gen:
            times.append(time.monotonic())
            if len(times) == req.max_tokens:
                break
        gen.close()
        return RequestTiming(len(req.prompt_token_ids), len(times), arrival, times[0],
                             times[-1], times[-1])

    for req in warmup_requests(args.vocab_size, args.seed):
        one(req, time.monotonic())
    timings = []
    t0 = time.monotonic()
    for req in _progress(requests, args):
        timings.append(one(req, t0))
    elapsed = time.monotonic() - t0
    extra = {"settings": {"n_threads": args.threads, "n_ctx": n_ctx, "n_batch": 512,
                          "mode": "sequential (no batched offline API)"},
             "peer_version": getattr(llama_cpp, "__version__", None)}
    return timings, elapsed, extra


# --- llama.cpp's own server: parallel slots -----------------------------------------------

LLAMA_SERVER_START_TIMEOUT_S = 300.0


def slot_context(requests: list) -> int:
    """Context of one slot: the longest prompt + output with room for the warm-up request,
    rounded up to 256 tokens."""
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    return max(256, ((longest + 16 + 255) // 256) * 256)


def llama_server_command(args: argparse.Namespace, requests: list, port: int) -> list[str]:
    """llama-server with one slot per concurrent request (at most --max-num-seqs) and
    continuous batching, so the prompts are decoded together as in vLLM and servelm."""
    n_parallel = max(1, min(len(requests), args.max_num_seqs))
    return [args.server_bin, "--model", args.model, "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(n_parallel), "--ctx-size", str(n_parallel * slot_context(requests)),
            "--cont-batching", "--threads", str(args.threads),
            "--threads-batch", str(args.threads), "--batch-size", "2048",
            "--ubatch-size", "512", "--seed", str(args.seed), "--no-webui"] + (
                [] if args.server_log_verbosity is None
                else ["--log-verbosity", str(args.server_log_verbosity)])


def completion_body(req) -> dict:
    """/completion takes the prompt as token ids; greedy (top-k 1 the only sampler, no
    penalties), exactly max_tokens new tokens (ignore_eos). return_tokens puts each token's id
    in its streamed chunk, so the first token is told from an empty chunk."""
    return {"prompt": list(req.prompt_token_ids), "n_predict": req.max_tokens,
            "ignore_eos": True, "stream": True, "return_tokens": True, "samplers": ["top_k"],
            "top_k": 1, "temperature": 0.0, "repeat_penalty": 1.0, "cache_prompt": False}


def parse_sse_line(line: bytes) -> dict | None:
    """One `data: {...}` line of llama-server's event stream -> the chunk (None otherwise)."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == b"[DONE]":
        return None
    return json.loads(payload)


def stream_completion(port: int, req, arrival: float, timeout_s: float) -> RequestTiming:
    """POST one request and read its stream. The first token's time is the arrival of the
    first chunk with a token, the last token's that of the final chunk, and the count is the
    server's own (tokens_predicted): llama-server holds back a token that ends inside a UTF-8
    character and sends it with the next, so chunks undercount."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    n_out, first, last, n_prompt = 0, None, None, None
    try:
        conn.request("POST", "/completion", body=json.dumps(completion_body(req)),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"llama-server answered {resp.status}: {resp.read()[:300]!r}")
        for line in resp:
            chunk = parse_sse_line(line)
            if chunk is None:
                continue
            if "error" in chunk:
                raise RuntimeError(f"llama-server error: {chunk['error']}")
            now = time.monotonic()
            if chunk.get("tokens"):
                n_out += len(chunk["tokens"])
                first = now if first is None else first
                last = now
            if chunk.get("stop"):
                n_prompt = chunk.get("tokens_evaluated")
                n_out = chunk.get("tokens_predicted", n_out)
                last = now if n_out else last
                break
    finally:
        conn.close()
    if n_prompt is not None and n_prompt != len(req.prompt_token_ids):
        raise RuntimeError(f"llama-server evaluated {n_prompt} prompt tokens, "
                           f"sent {len(req.prompt_token_ids)}")
    return RequestTiming(len(req.prompt_token_ids), n_out, arrival, first, last, last)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_reason(returncode: int) -> str:
    """-4 -> "-4 (SIGILL)": a server killed by a signal says which."""
    import signal

    if returncode >= 0:
        return str(returncode)
    try:
        return f"{returncode} ({signal.Signals(-returncode).name})"
    except ValueError:
        return str(returncode)


def wait_healthy(proc, port: int, timeout_s: float) -> None:
    """Poll GET /health until it answers 200 (it answers 503 while the model loads)."""
    import http.client

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {exit_reason(proc.returncode)} "
                               "before it was ready")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            status = conn.getresponse().status
            conn.close()
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"llama-server not healthy after {timeout_s:.0f}s")


def stop_server(proc, grace_s: float = 30.0) -> None:
    """SIGTERM to the server's own process group, SIGKILL if it has not gone in grace_s."""
    import signal
    import subprocess

    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def log_facts(log_text: str) -> dict:
    """What llama-server's log says about the run: its CPU feature line, and the AMX weight
    buffer if it made one (weights repacked for AMX tiles show as an "AMX" buffer). Both are
    logged only from --log-verbosity 4 (setup_peers.sh's smoke run keeps them in the build
    file next to the binary)."""
    lines = log_text.splitlines()
    system_info = next((ln.split("system_info:", 1)[1].strip() for ln in lines
                        if "system_info:" in ln), None)
    amx = [ln.strip() for ln in lines if "AMX" in ln and "buffer" in ln]
    return {"system_info": system_info, "amx_buffer_lines": amx[:3]}


def run_all_at_once(port: int, requests: list, t0: float, timeout_s: float) -> list:
    """Every request in its own thread, all sent at t0: the same arrival as a list of prompts
    handed to servelm's or vLLM's generate."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(requests)) as pool:
        futures = [pool.submit(stream_completion, port, r, t0, timeout_s) for r in requests]
        return [f.result() for f in futures]


def run_llama_server(args: argparse.Namespace, requests: list) -> tuple[list, float, dict]:
    """Start llama-server, warm it up, time the workload sent all at once, stop it. The server
    is a child of this process, so the memory sampler counts it."""
    import subprocess
    import tempfile

    if not args.server_bin:
        raise SystemExit("error: --server-bin: the llama-server binary is required")
    cmd = llama_server_command(args, requests, free_port())
    port = int(cmd[cmd.index("--port") + 1])
    log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
    print(f"[llama-server] {' '.join(cmd)} (log {log.name})", file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(proc, port, LLAMA_SERVER_START_TIMEOUT_S)
        for req in warmup_requests(args.vocab_size, args.seed):
            stream_completion(port, req, time.monotonic(), args.request_timeout)
        t0 = time.monotonic()
        timings = run_all_at_once(port, requests, t0, args.request_timeout)
        elapsed = time.monotonic() - t0
    except BaseException:
        with open(log.name, errors="replace") as f:
            sys.stderr.write("[llama-server] log tail:\n" + f.read()[-3000:] + "\n")
        raise
    finally:
        stop_server(proc)
        log.close()
    with open(log.name, errors="replace") as f:
        facts = log_facts(f.read())
    n_parallel = int(cmd[cmd.index("--parallel") + 1])
    extra = {"settings": {"server_command": cmd, "n_parallel": n_parallel,
                          "n_ctx_per_slot": slot_context(requests), "n_threads": args.threads,
                          "endpoint": "/completion, prompt as token ids, streamed",
                          "mode": "parallel slots, continuous batching", "log": log.name,
                          **facts},
             "peer_version": llama_server_version(args.server_bin),
             "build": llama_server_build(args.server_bin)}
    return timings, elapsed, extra


def llama_server_build(server_bin: str) -> dict | None:
    """How setup_peers.sh built the binary (its AMX choice and why, the CPU features its smoke
    run logged): BINARY.build.json, when there is one."""
    try:
        with open(server_bin + ".build.json") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def llama_server_version(server_bin: str) -> str | None:
    import subprocess

    try:
        out = subprocess.run([server_bin, "--version"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (out.stdout + out.stderr).splitlines()
    return next((ln.strip() for ln in lines if ln.startswith("version")), None)


# --- vLLM --------------------------------------------------------------------------------

TCMALLOC_PATHS = ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                  "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
                  "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4"]


def vllm_preload() -> list[str]:
    """The libraries vLLM's CPU install guide asks to LD_PRELOAD: tcmalloc and Intel's OpenMP
    (shipped in the venv by the intel-openmp wheel). Missing ones are left out."""
    libs = [p for p in TCMALLOC_PATHS if os.path.exists(p)][:1]
    iomp = os.path.join(sys.prefix, "lib", "libiomp5.so")
    if os.path.exists(iomp):
        libs.append(iomp)
    return libs


def maybe_reexec_with_preload(args: argparse.Namespace) -> None:
    """LD_PRELOAD only works from process start: re-run this script once with it set."""
    if args.backend != "vllm" or not args.preload or os.environ.get("_SERVELM_PEER_PRELOADED"):
        return
    libs = vllm_preload()
    if not libs:
        return
    env = dict(os.environ, _SERVELM_PEER_PRELOADED="1")
    env["LD_PRELOAD"] = ":".join(libs + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + sys.argv[1:], env)



def run_vllm(args: argparse.Namespace, requests: list) -> tuple[list, float, dict]:
    # Two OpenMP threads on cores 0..threads-1 and no core held back for the scheduler
    # process (vLLM's default reserves one, which on 2 cores halves the compute).
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vllm
    from vllm import LLM, SamplingParams

    max_len = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, seed=args.seed,
              max_model_len=max(2048, max_len), disable_log_stats=False)

    def params(req):
        return SamplingParams(max_tokens=req.max_tokens, min_tokens=req.max_tokens,
                              ignore_eos=True, temperature=0.0)

    warm = warmup_requests(args.vocab_size, args.seed)
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in warm],
                 [params(r) for r in warm], use_tqdm=False)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    t0 = time.monotonic()
    outs = llm.generate(prompts, [params(r) for r in requests], use_tqdm=args.progress)
    elapsed = time.monotonic() - t0
    timings = []
    for req, out in zip(requests, outs):
        m = out.metrics
        n_out = len(out.outputs[0].token_ids)
        if m is not None and m.first_token_ts:
            # engine-core timestamps are time.monotonic() of another process: one clock
            first, last = m.first_token_ts, m.last_token_ts
        else:
            first = last = None
        timings.append(RequestTiming(len(req.prompt_token_ids), n_out, t0, first, last))
    # the float type vLLM's engine settled on (it may override the requested one)
    config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    extra = {"settings": {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
                          "model_dtype": str(getattr(config, "dtype", None)).removeprefix(
                              "torch."),
                          "omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
                          "kv_cache_gib": os.environ["VLLM_CPU_KVCACHE_SPACE"],
                          "ld_preload": os.environ.get("LD_PRELOAD", "")},
             "peer_version": vllm.__version__}
    return timings, elapsed, extra


# --- HF transformers ---------------------------------------------------------------------


def run_hf(args: argparse.Namespace, requests: list) -> tuple[list, float, dict]:
    """All prompts of one output length in one left-padded generate call (greedy)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model.eval()
    pad_id = model.config.pad_token_id
    if pad_id is None:
        pad_id = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0

    class StepClock(StoppingCriteria):
        """Called once after every generated token: the time of each step."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.monotonic())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def generate(batch: list, arrival: float) -> list[RequestTiming]:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding
            ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids):] = 1
        n_new = batch[0].max_tokens
        clock = StepClock()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new,
                                 min_new_tokens=n_new, do_sample=False, pad_token_id=pad_id,
                                 stopping_criteria=StoppingCriteriaList([clock]))
        n_out = out.shape[1] - width
        return [RequestTiming(len(r.prompt_token_ids), n_out, arrival, clock.times[0],
                              clock.times[-1], clock.times[-1]) for r in batch]

    generate(warmup_requests(args.vocab_size, args.seed), time.monotonic())
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(r.max_tokens, []).append(i)
    batch_size = args.hf_batch_size or len(requests)
    chunks = [idx[s:s + batch_size] for idx in groups.values()
              for s in range(0, len(idx), batch_size)]
    timings: list = [None] * len(requests)
    t0 = time.monotonic()
    for chunk in _progress(chunks, args):
        for i, t in zip(chunk, generate([requests[i] for i in chunk], t0)):
            timings[i] = t
    elapsed = time.monotonic() - t0
    extra = {"settings": {"dtype": args.dtype, "torch_threads": torch.get_num_threads(),
                          "batch_size": batch_size, "padding": "left",
                          "attn_implementation": getattr(model.config, "_attn_implementation",
                                                         None)},
             "peer_version": transformers.__version__}
    return timings, elapsed, extra


BACKENDS: dict[str, Callable] = {"llama.cpp": run_llama_cpp, "llama-server": run_llama_server,
                                 "vllm": run_vllm, "hf": run_hf}


def _progress(items, args):
    if not args.progress:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, file=sys.stderr, desc=args.backend, unit="req" if
                args.backend == "llama.cpp" else "batch")


def load_workload(args: argparse.Namespace) -> list:
    if args.workload:
        with open(args.workload) as f:
            data = json.load(f)
        return [workloads.Request(list(r["prompt_token_ids"]), int(r["max_tokens"]))
                for r in data["requests"]]
    return workloads.random_lengths(args.num_prompts, args.input_len, args.output_len,
                                    args.vocab_size, args.seed)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", required=True, choices=sorted(BACKENDS))
    p.add_argument("--model", required=True,
                   help="GGUF file (llama.cpp, llama-server) or HF dir")
    p.add_argument("--server-bin", help="llama-server: the llama-server binary")
    p.add_argument("--request-timeout", type=float, default=3600.0,
                   help="llama-server: seconds one request may take")
    p.add_argument("--server-log-verbosity", type=int, default=None,
                   help="llama-server: its --log-verbosity (4 logs its CPU features)")
    p.add_argument("--workload", help="JSON from servelm bench (overrides the shape flags)")
    p.add_argument("--num-prompts", type=int, default=1)
    p.add_argument("--input-len", default="128")
    p.add_argument("--output-len", default="128")
    p.add_argument("--vocab-size", type=int, required=True,
                   help="the model's vocabulary (servelm bench passes it): prompt ids and "
                        "the warm-up's are drawn below it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="vllm; llama-server: its most parallel slots")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="vllm, hf: the float type the dequantized model runs in")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="vllm")
    p.add_argument("--no-preload", dest="preload", action="store_false",
                   help="vllm: do not LD_PRELOAD tcmalloc and libiomp5")
    p.add_argument("--hf-batch-size", type=int, default=0, help="hf; 0: all prompts at once")
    p.add_argument("--label", help="system name in the result (default: the backend)")
    p.add_argument("--out", help="write the result JSON here (default: stdout only)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None:
        maybe_reexec_with_preload(args)
    try:
        requests = load_workload(args)
    except workloads.RangeError as e:
        print(f"error: --{e.param.replace('_', '-')}: {e}", file=sys.stderr)
        return 2
    with results.MemorySampler() as mem:
        timings, elapsed, extra = BACKENDS[args.backend](args, requests)
    expected = sum(r.max_tokens for r in requests)
    produced = sum(t.num_output_tokens for t in timings)
    if produced != expected:
        extra["warning"] = f"generated {produced} output tokens, expected {expected}"
    result = results.build_result(
        system=args.label or args.backend, model=args.model, timings=timings,
        elapsed_s=elapsed, peak_memory_bytes=mem.peak_bytes,
        command=[os.path.basename(sys.executable)] + sys.argv, threads=args.threads,
        extra=extra)
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
