"""Soak test of `servelm serve` (not in CI; the record is in docs/benchmarks.md).

Starts a server (or uses --url with --pid), measures its capacity (closed loop at
--concurrency for --capacity-s seconds, completed requests per second), then sends Poisson
arrivals at --load (default 0.75) of that capacity for --duration seconds, a mix of
streaming and non-streaming completions and chats, of which --cancel-share (0.10) are
cancelled at a random moment and --malformed-share (0.05) are malformed bodies of many kinds.
It samples the server's RSS (its whole process tree) every --sample-s seconds.

Pass criteria, checked at the end and written to soak.json (with a plot soak.png):
    zero 5xx responses (an SSE error event counts as one); after the last request no KV block is held (servelm_kv_blocks_free ==
    servelm_kv_blocks_total, nothing running or waiting); RSS flat after warm-up (the slope of
    a least-squares line over samples after --warmup-s, in MiB per minute, within --max-slope).

    .venv/bin/python benchmarks/soak.py --duration 1800 --out benchmarks/results/soak-$(date -u +%Y%m%dT%H%M%SZ)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

MODEL = "smollm2-135m-instruct"
PROMPTS = ["Tell me a story about a dragon.", "What is the capital of France?",
           "Write a haiku about the sea.", "List three colours.", "Explain gravity briefly."]

# Each is sent as raw bytes: a client error the server must answer with a 4xx, never a 5xx.
MALFORMED = [
    b'{"prompt": "Hi",', b'["Hi"]', b"", b'{"prompt": "Hi", "temperature": -1}',
    b'{"prompt": "Hi", "max_tokens": "ten"}', b'{"prompt": "\\ud800"}',
    b'{"prompt": [1, 2, 1000000000]}', b'{"prompt": "Hi", "stop_token_ids": [-5]}',
    b'{"prompt": "Hi", "cache_salt": "' + b"s" * 300 + b'"}',
    b'{"prompt": ' + json.dumps(["Hi"] * 100).encode() + b"}",
    b'{"prompt": "Hi", "n": 1000}', b'{"prompt": "Hi", "logprobs": 99}',
    b'{"messages": [{"role": "wizard", "content": "x"}]}', b'{"messages": [{"role": "user"}]}',
    b'{"messages": []}', b'{"prompt": "Hi", "seed": 99999999999999999999}',
]


def rss_bytes(pid: int) -> int:
    """RSS of pid and its descendants (an engine core may run in a child process)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
            todo += [int(c) for c in children]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


class Tally:
    def __init__(self):
        self.codes: dict[str, int] = {}
        self.num_cancelled = 0
        self.num_malformed = 0
        self.errors: list[str] = []

    def add(self, code: int | str, detail: str = "") -> None:
        self.codes[str(code)] = self.codes.get(str(code), 0) + 1
        if isinstance(code, int) and code >= 500 and len(self.errors) < 20:
            self.errors.append(f"{code}: {detail[:300]}")

    @property
    def num_5xx(self) -> int:
        return sum(v for k, v in self.codes.items() if k.isdigit() and int(k) >= 500)


def good_body(rng: random.Random) -> tuple[str, dict]:
    stream = rng.random() < 0.5
    common = {"model": MODEL, "max_tokens": rng.randint(8, 48), "stream": stream,
              "temperature": rng.choice([0, 0.7]), "seed": rng.randint(-2**40, 2**40)}
    if rng.random() < 0.3:
        common["cache_salt"] = f"tenant-{rng.randrange(1000)}"
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**common, "messages": [
            {"role": "user", "content": rng.choice(PROMPTS)}]}
    return "/v1/completions", {**common, "prompt": rng.choice(PROMPTS)}


async def one_request(client: httpx.AsyncClient, rng: random.Random, tally: Tally,
                      cancel_share: float, malformed_share: float) -> None:
    u = rng.random()
    if u < malformed_share:
        tally.num_malformed += 1
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        r = await client.post(path, content=rng.choice(MALFORMED),
                              headers={"Content-Type": "application/json"})
        tally.add(r.status_code, r.text)
        return
    path, body = good_body(rng)
    if u >= malformed_share + cancel_share:
        if body["stream"]:
            async with client.stream("POST", path, json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith('data: {"error"'):  # a failure after the 200
                        tally.add(500, line)
                tally.add(r.status_code, "stream")
        else:
            r = await client.post(path, json=body)
            tally.add(r.status_code, r.text)
        return
    # Cancelled at a random moment: a stream after a random number of its events (so always
    # mid-stream), a plain request after a random fraction of a second (mostly before it ends).
    tally.num_cancelled += 1
    if body["stream"]:
        body["max_tokens"] = max(body["max_tokens"], 16)
        keep = rng.randint(1, body["max_tokens"] // 2)
        async with client.stream("POST", path, json=body) as r:
            tally.add(r.status_code, "stream")
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= keep:
                    break  # leaving the block closes the connection mid-stream
        return
    try:
        r = await asyncio.wait_for(client.post(path, json=body), rng.uniform(0.05, 0.8))
        tally.add(r.status_code, r.text)  # finished before its cancel time
    except asyncio.TimeoutError:
        tally.add("cancelled")


async def closed_loop(url: str, concurrency: int, seconds: float) -> float:
    """Completed requests per second with `concurrency` clients, none cancelled or bad."""
    rng, tally = random.Random(1), Tally()
    done = 0
    stop = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def worker() -> None:
            nonlocal done
            while time.monotonic() < stop:
                await one_request(client, rng, tally, 0.0, 0.0)
                done += 1
        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.monotonic() - start)


async def soak(url: str, pid: int, rate: float, args) -> dict:
    rng, tally = random.Random(args.seed), Tally()
    samples: list[tuple[float, int]] = []
    start = time.monotonic()
    end = start + args.duration
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def sampler() -> None:
            while time.monotonic() < end:
                samples.append((time.monotonic() - start, rss_bytes(pid)))
                await asyncio.sleep(args.sample_s)

        async def guarded() -> None:
            try:
                await one_request(client, rng, tally, args.cancel_share, args.malformed_share)
            except httpx.HTTPError as exc:  # a transport failure is not a response
                tally.add(f"transport:{type(exc).__name__}")

        tasks = [asyncio.ensure_future(sampler())]
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if start + t >= end:
                break
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            tasks.append(asyncio.ensure_future(guarded()))
        await asyncio.gather(*tasks)
    return {"tally": tally, "samples": samples}


def rss_slope_mib_per_min(samples, warmup_s: float) -> float | None:
    pts = [(t, r) for t, r in samples if t >= warmup_s]
    if len(pts) < 3:
        return None
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    mr = sum(r for _, r in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    slope = sum((t - mt) * (r - mr) for t, r in pts) / var  # bytes per second
    return slope * 60 / 2**20


def wait_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = (m.get("servelm_kv_blocks_free") == m.get("servelm_kv_blocks_total")
                and m.get("servelm_num_requests_running") == 0
                and m.get("servelm_num_requests_waiting") == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def start_server(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [*shlex.split(args.server_cmd), "serve", args.model, "--port", str(port),
           "--no-log-requests", *args.server_arg]
    proc = subprocess.Popen(cmd, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"server did not start: {' '.join(cmd)}")
        time.sleep(1)


def plot(samples, warmup_s: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([t / 60 for t, _ in samples], [r / 2**20 for _, r in samples])
    ax.axvline(warmup_s / 60, linestyle="--", color="grey", label="end of warm-up")
    ax.set_xlabel("minutes")
    ax.set_ylabel("server RSS (MiB, process tree)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an already running server (then --pid for its RSS)")
    p.add_argument("--pid", type=int)
    p.add_argument("--server-cmd", default=f"{sys.executable} -c 'import sys; "
                   "from servelm.cli import main; sys.exit(main())'",
                   help="how to run the `servelm` CLI (shell words)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra `servelm serve` argument (repeatable)")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--duration", type=float, default=1800.0, help="soak seconds")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="seconds excluded from the RSS slope (default: a sixth of the run)")
    p.add_argument("--capacity-s", type=float, default=60.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--load", type=float, default=0.75, help="share of measured capacity")
    p.add_argument("--cancel-share", type=float, default=0.10)
    p.add_argument("--malformed-share", type=float, default=0.05)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--max-slope", type=float, default=1.0,
                   help="MiB/min of RSS growth after warm-up that still counts as flat")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("/tmp/servelm-soak"))
    args = p.parse_args()
    args.warmup_s = args.duration / 6 if args.warmup_s is None else args.warmup_s
    args.out.mkdir(parents=True, exist_ok=True)

    proc = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
        if pid is None:
            raise SystemExit("--url needs --pid (the server's process, for its RSS)")
    else:
        proc, url = start_server(args)
        pid = proc.pid
    try:
        capacity = asyncio.run(closed_loop(url, args.concurrency, args.capacity_s))
        rate = capacity * args.load
        print(f"[soak] capacity {capacity:.2f} req/s; soaking at {rate:.2f} req/s for "
              f"{args.duration:g}s", file=sys.stderr, flush=True)
        result = asyncio.run(soak(url, pid, rate, args))
        end_metrics = wait_idle(url)
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    tally, samples = result["tally"], result["samples"]
    slope = rss_slope_mib_per_min(samples, args.warmup_s)
    leaked = end_metrics.get("servelm_kv_blocks_total", 0) - end_metrics.get(
        "servelm_kv_blocks_free", 0)
    passed = {"zero_5xx": tally.num_5xx == 0, "zero_leaked_blocks": leaked == 0,
              "rss_flat": slope is not None and abs(slope) <= args.max_slope}
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], check=False,
                            capture_output=True,
                            text=True).stdout.strip()
    record = {
        "command": " ".join(sys.argv), "commit": commit, "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "duration_s": args.duration, "warmup_s": args.warmup_s,
        "capacity_req_s": capacity, "rate_req_s": rate, "codes": tally.codes,
        "num_cancelled": tally.num_cancelled, "num_malformed": tally.num_malformed,
        "num_5xx": tally.num_5xx, "errors_5xx": tally.errors, "leaked_blocks": leaked,
        "rss_mib_first": samples[0][1] / 2**20 if samples else None,
        "rss_mib_last": samples[-1][1] / 2**20 if samples else None,
        "rss_slope_mib_per_min": slope, "rss_samples": samples, "passed": passed,
        "rejected": {k: v for k, v in end_metrics.items()
                     if k.startswith("servelm_requests_rejected_total")},
    }
    (args.out / "soak.json").write_text(json.dumps(record, indent=1))
    plot(samples, args.warmup_s, args.out / "soak.png",
         f"soak: {rate:.2f} req/s ({args.load:.0%} of capacity), {args.duration / 60:g} min")
    print(json.dumps({k: v for k, v in record.items() if k != "rss_samples"}, indent=1))
    return 0 if all(passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
