"""The one JSON schema of an offline benchmark result, shared by servelm and the peers.

Owns: RequestTiming (what a backend measured per request), build_result (the arithmetic),
machine_info, git_commit, MemorySampler (peak memory of a process tree), render_table.
Never: imports torch or the servelm engine. Peer scripts load this file by path from their own
virtual environments, so it uses only the standard library.

Definitions (all times in seconds on one monotonic clock):
  elapsed_s     first request submitted -> last request finished
  output_tok_s  num_output_tokens / elapsed_s
  total_tok_s   (num_input_tokens + num_output_tokens) / elapsed_s
  ttft_s        first_token_time - arrival_time, per request (mean and p50)
  decode_tok_s  per request (n_out - 1) / (last_token_time - first_token_time), mean over
                requests; with one request this is the single-stream decode speed
"""

from __future__ import annotations

import os
import platform
import re
import resource
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 1

# Columns of the side-by-side table: (header, key in the result, format).
TABLE_COLUMNS = [
    ("system", "system", "{}"),
    ("reqs", "num_requests", "{:d}"),
    ("in tok", "num_input_tokens", "{:d}"),
    ("out tok", "num_output_tokens", "{:d}"),
    ("prefill run", "num_prefill_tokens_computed", "{:d}"),
    ("seconds", "elapsed_s", "{:.2f}"),
    ("out tok/s", "output_tok_s", "{:.1f}"),
    ("total tok/s", "total_tok_s", "{:.1f}"),
    ("TTFT mean ms", "ttft_mean_ms", "{:.1f}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.1f}"),
    ("decode tok/s", "decode_tok_s", "{:.1f}"),
    ("peak MiB", "peak_memory_mib", "{:.0f}"),
]


@dataclass
class RequestTiming:
    """What a backend measured for one request (time.monotonic seconds)."""

    num_input_tokens: int
    num_output_tokens: int
    arrival_time: float
    first_token_time: float | None
    last_token_time: float | None
    finish_time: float | None = None

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_tok_s(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None:
            return None
        span = self.last_token_time - self.first_token_time
        if self.num_output_tokens < 2 or span <= 0:
            return None
        return (self.num_output_tokens - 1) / span


def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100] (numpy's default method)."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def build_result(*, system: str, model: str, timings: list[RequestTiming], elapsed_s: float,
                 peak_memory_bytes: int | None, command: list[str] | str | None = None,
                 threads: int | None = None, extra: dict[str, Any] | None = None,
                 cwd: str | None = None) -> dict[str, Any]:
    """The result dict from per-request timings and the wall time of the whole run."""
    if not timings:
        raise ValueError("timings must hold at least one request")
    if elapsed_s <= 0:
        raise ValueError(f"elapsed_s must be positive, got {elapsed_s}")
    num_in = sum(t.num_input_tokens for t in timings)
    num_out = sum(t.num_output_tokens for t in timings)
    ttfts = [t.ttft_s for t in timings if t.ttft_s is not None]
    decodes = [t.decode_tok_s for t in timings if t.decode_tok_s is not None]
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "system": system,
        "model": model,
        "command": command if isinstance(command, str) or command is None else " ".join(command),
        "machine": machine_info(threads),
        "commit": git_commit(cwd),
        "num_requests": len(timings),
        "num_input_tokens": num_in,
        "num_output_tokens": num_out,
        "elapsed_s": elapsed_s,
        "output_tok_s": num_out / elapsed_s,
        "total_tok_s": (num_in + num_out) / elapsed_s,
        "ttft_s": {
            "mean": statistics.fmean(ttfts) if ttfts else None,
            "p50": _percentile(ttfts, 50) if ttfts else None,
        },
        "decode_tok_s": statistics.fmean(decodes) if decodes else None,
        "peak_memory_bytes": peak_memory_bytes,
    }
    if extra:
        result.update(extra)
    return result


_SIMD_FLAG = re.compile(r"^(sse4|avx|amx|fma|f16c|bmi|vnni)")


def cpu_flags() -> list[str]:
    """The vector and matrix instruction flags /proc/cpuinfo advertises: what a record's CPU
    class is read from (advertised, which is not the same as usable: cpu_kernels/isa.py)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return sorted(x for x in line.split(":", 1)[1].split()
                                  if _SIMD_FLAG.match(x))
    except OSError:
        pass
    return []


def machine_info(threads: int | None = None) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        num_usable = len(os.sched_getaffinity(0))
    except AttributeError:
        num_usable = os.cpu_count()
    # The 1/5/15-minute load when the result was taken: on 2 shared cores another process
    # changes the numbers several-fold (llama.cpp's spinning threads most of all). It counts
    # the system under test too: read it against the load before the first run.
    load_avg = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": num_usable,
            "threads": threads, "python": platform.python_version(),
            "platform": platform.platform(), "load_avg": load_avg, "cpu_flags": cpu_flags()}


def git_commit(cwd: str | None = None) -> str | None:
    """HEAD of the repository holding this file (or `cwd`); None outside git or before the
    first commit. A dirty tree is marked with a "+dirty" suffix."""
    cwd = cwd or os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=cwd, capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _children(pid: int) -> list[int]:
    kids = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids.extend(int(p) for p in f.read().split())
    except OSError:
        pass
    return kids


def _rss_bytes(pid: int) -> int:
    """Resident set size from /proc/PID/statm: O(1) for the kernel. (smaps_rollup's PSS walks
    every page table under the process's mmap lock, which stalled a multi-GB engine's page
    faults: sampling it 4x a second slowed servelm's run several fold.) A tree's sum counts
    pages shared between processes once per process."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def tree_memory_bytes(pid: int | None = None) -> int:
    """Memory (RSS) of a process and all its descendants (engines that fork workers)."""
    pending, total, seen = [pid or os.getpid()], 0, set()
    while pending:
        p = pending.pop()
        if p in seen:
            continue
        seen.add(p)
        total += _rss_bytes(p)
        pending.extend(_children(p))
    return total


def self_peak_rss_bytes() -> int:
    """This process's high-water RSS (VmHWM). Unlike getrusage's ru_maxrss, it starts afresh
    at exec, so a peer started from a big parent process does not inherit the parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class MemorySampler:
    """Samples the memory (RSS) of this process tree in a thread; `peak_bytes` is the larger
    of the sampled peak and this process's own high-water RSS (which catches short spikes
    that sampling misses). For a one-process system this is its peak RSS; for a system that
    runs workers in child processes (vLLM) it is the peak of the tree's summed RSS."""

    def __init__(self, interval_s: float = 0.25):
        self.interval_s = interval_s
        self.peak_tree_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_tree_bytes = max(self.peak_tree_bytes, tree_memory_bytes())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_tree_bytes = max(self.peak_tree_bytes, tree_memory_bytes())

    @property
    def peak_bytes(self) -> int:
        return max(self_peak_rss_bytes(), self.peak_tree_bytes)


def table_row(result: dict[str, Any]) -> dict[str, Any]:
    """Flatten one result into the table's keys (missing values stay None)."""
    ttft = result.get("ttft_s") or {}
    mem = result.get("peak_memory_bytes")
    row = dict(result)
    row["ttft_mean_ms"] = None if ttft.get("mean") is None else ttft["mean"] * 1e3
    row["ttft_p50_ms"] = None if ttft.get("p50") is None else ttft["p50"] * 1e3
    row["peak_memory_mib"] = None if mem is None else mem / 2**20
    return row


def render_table(results: list[dict[str, Any]]) -> str:
    """A plain-text side-by-side table; a failed run shows its error instead of numbers."""
    header = [h for h, _, _ in TABLE_COLUMNS]
    rows = []
    for result in results:
        if result.get("error"):
            rows.append([str(result.get("system", "?")), f"FAILED: {result['error']}"])
            continue
        flat = table_row(result)
        cells = []
        for _, key, fmt in TABLE_COLUMNS:
            value = flat.get(key)
            cells.append("-" if value is None else fmt.format(value))
        rows.append(cells)
    widths = [len(h) for h in header]
    for cells in rows:
        if len(cells) == len(header):
            widths = [max(w, len(c)) for w, c in zip(widths, cells)]

    def fmt_line(cells: list[str]) -> str:
        if len(cells) != len(header):  # a failure line spans the table
            return f"{cells[0]:<{widths[0]}}  {cells[1]}"
        first = f"{cells[0]:<{widths[0]}}"
        rest = [f"{c:>{w}}" for c, w in zip(cells[1:], widths[1:])]
        return "  ".join([first] + rest)

    lines = [fmt_line(header), "  ".join("-" * w for w in widths)]
    lines.extend(fmt_line(cells) for cells in rows)
    return "\n".join(lines)


def now() -> float:
    return time.monotonic()
