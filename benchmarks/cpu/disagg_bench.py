"""The disaggregation record in docs/disaggregation.md.

1. Long prompts while streams decode, same total cores: `servelm serve --disagg 1:1
   --threads 1` (a prefill and a decode worker, one core each, the router in front) against
   one colocated `servelm serve --threads 2`. STREAMS short requests decode OUTPUT_LEN tokens
   each from t=0; LONG prompts (LONG_LENS tokens) arrive every LONG_EVERY seconds. Per setup:
   the streams' TPOT (per-stream mean) and inter-token gaps p50/p99, the long prompts' TTFT,
   the streams' TTFT, wall time; and whether every request's greedy text is the same in
   both setups. The decode worker's /metrics gives the KV bytes and seconds per transfer.
2. KV transport throughput on loopback: FRAMES frames of one block of the model's KV each
   through tcp and shm (raw, and with the crc32 both roles compute), against this machine's
   memory copy bandwidth (numpy, one buffer copied into another), and `plan disagg`'s
   break-even bandwidth with the measured prefill time of each long prompt.

Writes result.json and disagg.png under --out.

    .venv/bin/python benchmarks/cpu/disagg_bench.py --out benchmarks/results/disagg-<ts>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx
import numpy as np

from servelm.bench.results import git_commit, machine_info

MODEL = ["smollm2-135m-instruct"]  # the served name (--model)
SCALES = {  # streams, output_len, long prompt lengths, seconds between long prompts
    "tiny": (4, 16, (256, 384), 1.0),
    "full": (16, 96, (2048, 3072, 4096), 6.0),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(argv: list[str], timeout: float = 600.0) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "servelm.cli", "serve", *argv,
                             "--port", str(port), "--no-log-requests"],
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {argv} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server {argv} not ready in {timeout} s")


def stop_server(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)  # the router and the workers it started
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(200, 20000, n).tolist()


async def one(client: httpx.AsyncClient, url: str, rid: str, prompt: list[int],
              max_tokens: int, start_at: float, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    sent = time.perf_counter()
    body = {"model": MODEL[0], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times, text = [], []
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{rid}: {chunk['error']}")
            for c in chunk.get("choices", []):
                if c.get("text"):
                    times.append(time.perf_counter())
                    text.append(c["text"])
    return {"id": rid, "sent": sent - t0, "times": [t - t0 for t in times],
            "text": "".join(text), "prompt_len": len(prompt)}


async def workload(url: str, scale: str) -> list[dict]:
    streams, out_len, long_lens, every = SCALES[scale]
    async with httpx.AsyncClient(timeout=600.0) as client:
        t0 = time.perf_counter()
        jobs = [one(client, url, f"s{i}", prompt_ids(64, i), out_len, 0.0, t0)
                for i in range(streams)]
        jobs += [one(client, url, f"long{k}", prompt_ids(n, 1000 + k), 8, 1.0 + k * every, t0)
                 for k, n in enumerate(long_lens)]
        return await asyncio.gather(*jobs)


def summarize(runs: list[dict]) -> dict:
    streams = [r for r in runs if r["id"].startswith("s")]
    longs = [r for r in runs if r["id"].startswith("long")]
    gaps = [b - a for r in streams for a, b in zip(r["times"], r["times"][1:])]
    tpots = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in streams
             if len(r["times"]) > 1]
    return {"stream_tpot_p50_s": float(np.percentile(tpots, 50)),
            "stream_tpot_p99_s": float(np.percentile(tpots, 99)),
            "stream_itl_p50_s": float(np.percentile(gaps, 50)),
            "stream_itl_p99_s": float(np.percentile(gaps, 99)),
            "stream_itl_max_s": max(gaps),
            "stream_ttft_mean_s": statistics.fmean(r["times"][0] - r["sent"] for r in streams),
            "long_ttft_s": {str(r["prompt_len"]): r["times"][0] - r["sent"] for r in longs},
            "wall_s": max(r["times"][-1] for r in runs)}


def kv_metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("servelm_kv_transfer") and " " in line and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def run_setup(name: str, argv: list[str], a) -> dict:
    proc, url = start_server([a.model, *argv])
    try:
        asyncio.run(workload(url, "tiny"))  # warm-up: first-step costs out of the record
        runs = asyncio.run(workload(url, a.scale))
        result = {"setup": name, "argv": argv, **summarize(runs)}
        if "--disagg" in argv:
            decode_url = _decode_worker(proc)
            if decode_url:
                result["decode_kv_metrics"] = kv_metrics(decode_url)
        result["texts"] = {r["id"]: r["text"] for r in runs}
        print(json.dumps({k: v for k, v in result.items() if k != "texts"}), file=sys.stderr)
        return result
    finally:
        stop_server(proc)


def _decode_worker(router_proc) -> str | None:
    """The decode worker's URL: the router's child `serve ... --role decode --port P`."""
    try:
        children = open(f"/proc/{router_proc.pid}/task/{router_proc.pid}/children").read()
    except OSError:
        return None
    for pid in children.split():
        try:
            argv = open(f"/proc/{pid}/cmdline").read().split("\0")
        except OSError:
            continue
        if "decode" in argv and "--port" in argv:
            return f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    return None


# -- transport throughput ---------------------------------------------------------------------

class _Sink:
    def __init__(self, with_crc: bool = False):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.with_crc = with_crc

    def on_message(self, ch, msg, payload):
        if self.with_crc and payload is not None:
            from servelm.disagg.messages import checksum

            checksum(payload)
        self.q.put((ch, msg))

    def on_closed(self, ch, reason):
        self.q.put((ch, None))


def serve_frames(name: str, address: str, block_bytes: int, frames: int, crc: bool) -> None:
    """The sending side, in its own process (as a prefill worker is): listen, and on the
    first message of a connection send `frames` blocks back, then Sent."""
    from servelm.disagg.messages import KVFrame, Sent, checksum
    from servelm.disagg.transport import make_transport

    sink = _Sink()
    listener = make_transport(name).listen(address, sink)
    print(listener.address, flush=True)
    peer, _ = sink.q.get(timeout=60)
    data = os.urandom(block_bytes)
    for i in range(frames):
        peer.send(KVFrame("t", i, 0, checksum(data) if crc else 0), data)
    peer.send(Sent("t", frames))
    sink.q.get(timeout=120)  # the receiver closes when it has everything
    listener.close()


def transport_throughput(name: str, block_bytes: int, frames: int, with_crc: bool) -> float:
    """Bytes per second from a sender process to this one, checksums on both sides when
    with_crc (as the roles compute them)."""
    from servelm.disagg.messages import Sent, KVHello
    from servelm.disagg.transport import make_transport

    address = ("tcp://127.0.0.1:0" if name == "tcp"
               else f"shm:///tmp/servelm-kv-bench-{os.getpid()}.sock")
    child = subprocess.Popen([sys.executable, __file__, "--serve-frames", name, address,
                              str(block_bytes), str(frames), str(int(with_crc))],
                             stdout=subprocess.PIPE, text=True)
    try:
        listening = child.stdout.readline().strip()
        sink = _Sink(with_crc)
        ch = make_transport(name).connect(listening, sink)
        start = time.perf_counter()
        ch.send(KVHello(1, "decode", block_bytes))
        n = 0
        while True:
            _, msg = sink.q.get(timeout=120)
            if msg is None:
                raise RuntimeError(f"{name} channel closed after {n} frames")
            if isinstance(msg, Sent):
                break
            n += 1
        elapsed = time.perf_counter() - start
        ch.close()
        child.wait(60)
    finally:
        if child.poll() is None:
            child.kill()
    return block_bytes * n / elapsed


def memory_bandwidth(nbytes: int = 256 * 2**20) -> float:
    """Bytes copied per second by one core (numpy copy, best of 5)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def block_nbytes(model: str, block_size: int = 16) -> int:
    from servelm.config import ModelConfig  # noqa: F401
    from servelm.cost import kv_bytes_per_token
    from servelm.loader import load_model_config, resolve_model

    config = load_model_config(resolve_model(model))
    return int(kv_bytes_per_token(config, 4) * block_size)  # float32 KV (the CPU default)


def break_even(result: dict, kv_bytes_per_token: float) -> dict:
    """`plan disagg`'s break-even (KV bytes of the prompt / its prefill time) with this
    machine's measured prefill time (the colocated long prompt's TTFT) in place of the
    planner's model, and each transport's transfer time over that prefill time (below 1:
    the transfer hides behind the prefill it overlaps)."""
    colocated = result["runs"][0]["long_ttft_s"]
    out = {}
    for n, ttft in colocated.items():
        nbytes = int(n) * kv_bytes_per_token
        out[n] = {"kv_bytes": nbytes, "prefill_s": ttft, "break_even_Bps": nbytes / ttft,
                  "transfer_over_prefill": {k: nbytes / bps / ttft
                                            for k, bps in result["transport"]["Bps"].items()}}
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    runs = result["runs"]
    keys = [("stream_tpot_p50_s", "TPOT p50"), ("stream_tpot_p99_s", "TPOT p99"),
            ("stream_itl_p99_s", "gap p99")]
    x = np.arange(len(keys))
    for i, r in enumerate(runs):
        ax1.bar(x + i * 0.4, [r[k] * 1e3 for k, _ in keys], 0.4, label=r["setup"])
    ax1.set_xticks(x + 0.2, [n for _, n in keys])
    ax1.set_ylabel("ms")
    ax1.legend()
    ax1.set_title("decode streams while long prompts arrive")
    tp = result["transport"]
    names = list(tp["Bps"])
    ax2.bar(names + ["memcpy"], [tp["Bps"][n] / 1e9 for n in names]
            + [tp["memory_copy_Bps"] / 1e9])
    ax2.set_ylabel("GB/s")
    ax2.set_title(f"KV frames of {tp['block_bytes'] / 1e6:.2f} MB on loopback")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-frames":  # transport_throughput's child
        name, address, nbytes, frames, crc = sys.argv[2:7]
        serve_frames(name, address, int(nbytes), int(frames), crc == "1")
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--scale", choices=sorted(SCALES), default="full")
    p.add_argument("--frames", type=int, default=2000)
    p.add_argument("--kv-transport", default="tcp")
    a = p.parse_args()
    MODEL[0] = a.model
    result = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]),
              "machine": machine_info(2), "commit": git_commit(), "model": a.model,
              "workload": dict(zip(("streams", "output_len", "long_lens", "long_every_s"),
                                   SCALES[a.scale]))}
    result["runs"] = [
        run_setup("colocated, 2 threads", ["--threads", "2"], a),
        run_setup("disagg 1:1, 1 thread each",
                  ["--disagg", "1:1", "--threads", "1", "--kv-transport", a.kv_transport,
                   "--kv-lease-s", "300"], a)]  # a long queue must not end in fallbacks
    texts = [r.pop("texts") for r in result["runs"]]
    result["greedy_identical"] = texts[0] == texts[1]
    result["greedy_differing"] = sorted(k for k in texts[0] if texts[0][k] != texts[1].get(k))
    nbytes = block_nbytes(a.model)
    result["transport"] = {"block_bytes": nbytes, "frames": a.frames,
                           "memory_copy_Bps": memory_bandwidth(), "Bps": {}}
    for name in ("tcp", "shm"):
        for crc in (False, True):
            key = name + (" + crc32" if crc else "")
            result["transport"]["Bps"][key] = transport_throughput(name, nbytes, a.frames, crc)
            print(f"{key}: {result['transport']['Bps'][key] / 1e9:.2f} GB/s", file=sys.stderr)
    result["break_even"] = break_even(result, nbytes / 16)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(a.out, "disagg.png"))
    print(os.path.join(a.out, "result.json"))


if __name__ == "__main__":
    main()
