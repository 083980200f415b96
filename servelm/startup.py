"""Start-up, stage by stage: where a replica's seconds go before it can serve.

A process keeps one StartupTimer; the code that does each stage wraps it in `stage(name)`
(or calls `add(name, seconds)` for time measured elsewhere). The engine core reports its
stages to the front end in the Ready message, the front end adds its own, and the result is
logged in one line, exported on /metrics (`servelm_startup_stage_seconds{stage}`) and kept in
`servelm bench coldstart`'s JSON. `servelm plan coldstart --measured FILE` lays the same
names next to its estimate.

Stages (seconds):
    interpreter     process start to servelm's first line (the Python interpreter)
    imports         torch and servelm's own modules
    config          the model's config (GGUF metadata: from the index cache after one start)
    tokenizer       the tokenizer
    weights_read    checkpoint tensors read, dequantized and placed in the model
                    (from the prepared-weights cache after one start)
    weights_pack    float weights reordered for oneDNN's GEMM (PackedLinear), float32 ones
                    for the panel GEMM too, bfloat16 ones for the AMX tiles too or for the
                    dot-product GEMM instead (layers/linear.py)
    weights_cache   writing the prepared-weights cache (first start only)
    kernels         loading servelm's C++ op library (building it: first start on a machine)
    kv_alloc        the KV cache's memory
    graph_capture   CUDA graphs (GPU only)
    warmup          one short request through the engine (first kernel calls, first
                    oneDNN primitives)
    engine_other    the rest of building the engine
  with the engine core in its own process (the default), the front end adds:
    frontend_start  front end: process start to spawning the core (interpreter, imports)
    core_spawn      front end: spawn to Ready, less the core's own stages (process creation,
                    the handshake)
    frontend_ready  front end: Ready to listening (the HTTP app, uvicorn start; its own
                    tokenizer and imports run while the core builds)
  so that the stages sum to `ready_s`, process start to the first moment /health answers.
A stage run in `stage(name)` that takes longer than servelm.slow_step.SLOW_AFTER_S says what
it is doing (STAGE_DOING), so that a slow first start never looks like a hang.
Never: times anything itself beyond the wall clock around a stage.
"""

from __future__ import annotations

import contextlib
import os
import time

from servelm.slow_step import say_if_slow

# In the order they happen (with the engine core in its own process, frontend_start first).
STAGES = ("frontend_start", "interpreter", "imports", "config", "tokenizer", "kernels",
          "weights_read", "weights_cache", "weights_pack", "kv_alloc", "graph_capture",
          "warmup", "engine_other", "core_spawn", "frontend_ready")

# What a stage is doing, said when it is slow (servelm/slow_step.py). The kernels stage is
# not here: servelm/cpu_kernels says what its build does itself.
STAGE_DOING = {
    "config": "reading the model's config",
    "tokenizer": "building the tokenizer",
    "weights_read": "reading the checkpoint's weights (a first start dequantizes them; later "
                    "ones read the prepared-weights cache)",
    "weights_pack": "packing the weights for the CPU matrix multiplies",
    "kv_alloc": "allocating the KV cache",
    "graph_capture": "capturing CUDA graphs",
    "warmup": "warming up (one short request through the engine)",
}


def process_start_time() -> float | None:
    """This process's start as a time.time() value (Linux /proc), or None."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat, counted after the comm field
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        ticks = os.sysconf("SC_CLK_TCK")
        return time.time() - uptime + start_ticks / ticks
    except (OSError, ValueError, IndexError):
        return None


class StartupTimer:
    def __init__(self) -> None:
        self.stages: dict[str, float] = {}
        self.notes: dict[str, str] = {}

    def add(self, name: str, seconds: float, note: str | None = None) -> None:
        if name not in STAGES:
            raise ValueError(f"unknown start-up stage {name!r}; stages: {', '.join(STAGES)}")
        self.stages[name] = self.stages.get(name, 0.0) + max(0.0, seconds)
        if note:
            self.notes[name] = note

    @contextlib.contextmanager
    def stage(self, name: str, note: str | None = None):
        doing = STAGE_DOING.get(name)
        start = time.monotonic()
        try:
            with say_if_slow(f"{doing} (start-up stage {name})") if doing \
                    else contextlib.nullcontext():
                yield
        finally:
            self.add(name, time.monotonic() - start, note)

    def note(self, name: str, note: str) -> None:
        self.notes[name] = note

    @property
    def total(self) -> float:
        return sum(self.stages.values())

    def summary(self) -> str:
        parts = []
        for name in STAGES:
            if name in self.stages:
                s = f"{name} {self.stages[name]:.2f}"
                if name in self.notes:
                    s += f" ({self.notes[name]})"
                parts.append(s)
        return ", ".join(parts)

    def as_dict(self) -> dict:
        return {"total_s": round(self.total, 4),
                "stages_s": {k: round(v, 4) for k, v in self.stages.items()},
                "notes": dict(self.notes)}


_timer = StartupTimer()


def timer() -> StartupTimer:
    """The process's start-up timer."""
    return _timer


_engines_begun = 0


def begin_engine() -> StartupTimer:
    """The timer, at the start of an engine build. The process's first build also records
    `interpreter` (process start to servelm's import) and `imports` (that to now); a later
    build in the same process (tests, a second LLM) starts from an empty record."""
    global _engines_begun
    import servelm

    if _engines_begun:
        _timer.stages.clear()
        _timer.notes.clear()
    else:
        started = process_start_time()
        if started is not None:
            _timer.add("interpreter", servelm.IMPORTS_STARTED - started)
        _timer.add("imports", time.time() - servelm.IMPORTS_STARTED)
    _engines_begun += 1
    return _timer


def warm_up(engine, prompt_tokens: int = 8, new_tokens: int = 2) -> None:
    """One short greedy request through the engine before it serves: the first prefill and
    decode steps pay one-time costs (oneDNN primitive creation, first kernel calls, page
    faults of the first KV blocks) that would otherwise land on the first client's TTFT.
    Leaves no sequence, no held block and no full prefix-cache block behind."""
    from servelm.protocol import EngineRequest, SamplingParams

    # Fewer tokens than one block in all, so that nothing enters the prefix cache.
    n = max(1, min(prompt_tokens, engine.block_manager.block_size - new_tokens - 1))
    ids = [(1 + i) % engine.vocab_size for i in range(n)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest("servelm-warmup", ids, params))
    while engine.has_unfinished:
        engine.step()


def export_metrics(registry, record: dict) -> None:
    """servelm_startup_ready_seconds and servelm_startup_stage_seconds{stage} on a server's
    Prometheus registry, from a start-up record (`as_dict()` plus ready_s)."""
    from prometheus_client import Gauge

    Gauge("servelm_startup_ready_seconds", "Process start to ready for traffic",
          registry=registry).set(record["ready_s"])
    g = Gauge("servelm_startup_stage_seconds", "Seconds of each start-up stage (on the "
              "path to ready; docs/server.md)", ["stage"], registry=registry)
    for name, seconds in record["stages_s"].items():
        g.labels(name).set(seconds)
