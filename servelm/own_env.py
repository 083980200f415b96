"""The environment defaults servelm sets for itself when an engine is about to start.

Owns: OWN_ENV (what `apply_defaults` set in this process, so that the benchmark harness can
give peers the environment a user would run them in), REASONS (why each was chosen, for the
start-up log) and the defaults themselves:

    GOMP_SPINCOUNT        torch's CPU kernels run in OpenMP (libgomp) thread teams, and a
                          decode step passes a few hundred of their barriers. How long a
                          thread that waits at one spins before it sleeps decides two things:
                          on quiet cores, a short spin puts threads to sleep between ops and
                          wakes them again (slow); beside another busy process, a long spin
                          burns the time slice the awaited thread needs (much slower).
                          So the cores are sampled for about 0.15 s before torch loads: cores
                          in use by others -> 1000, idle -> 10000. Measured (record
                          benchmarks/results/spincount-20261204T200437Z: 64 prompts x 128
                          tokens, default model, 2 threads, Intel Xeon with AMX), output
                          tok/s at 1000 / 10000 / 50000 / 300000
                          (libgomp's own default): quiet 856 / 964 / 956 / 952; beside one
                          busy process 468 / 298 / 133 / 72. 10000 is the quiet best and keeps
                          4x the default's speed when a busy process appears later; served
                          (32 concurrent streams, front end and load generator on the same
                          cores; spincount-serve-20261204T202706Z) 10000 gave 579-583 output
                          tok/s against 515-544 for 1000.

Never: runs at import (`import servelm` leaves the environment alone), or overrides a
variable the user set. libgomp reads its variables when torch loads it, so the `servelm`
command applies these first thing; a Python program embedding servelm sets them itself (or
calls `apply_defaults()`) before it imports torch.
"""

from __future__ import annotations

import os
import time

SPIN_CONTESTED, SPIN_IDLE = "1000", "10000"
BUSY_CORES_CONTESTED = 0.25  # others' use of the usable cores, in cores, that counts as busy
PROBE_S = 0.15

OWN_ENV: dict[str, str] = {}  # the defaults this process set (the user's own settings win)
REASONS: dict[str, str] = {}  # why, per variable set


def _cpu_times(cpus: set[int]) -> tuple[int, int] | None:
    """(busy, total) jiffies summed over `cpus` from /proc/stat; None where unreadable."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        fields = [int(x) for x in rest.split()]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        all_ = sum(fields[:8])  # user nice system idle iowait irq softirq steal
        busy += all_ - idle
        total += all_
    return (busy, total) if total else None


def busy_cores(window_s: float = PROBE_S) -> float | None:
    """How many of this process's usable cores other processes keep busy, sampled over
    `window_s` while this one sleeps; None where /proc/stat cannot be read."""
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        cpus = set(range(os.cpu_count() or 1))
    before = _cpu_times(cpus)
    if before is None:
        return None
    time.sleep(window_s)
    after = _cpu_times(cpus)
    if after is None or after[1] <= before[1]:
        return None
    return len(cpus) * (after[0] - before[0]) / (after[1] - before[1])


def choose_spincount(busy: float | None) -> tuple[str, str]:
    """(GOMP_SPINCOUNT, why) for `busy` cores in use by others (None: unknown)."""
    if busy is None:
        return SPIN_CONTESTED, "core use unknown (no /proc/stat): the short spin"
    if busy >= BUSY_CORES_CONTESTED:
        return SPIN_CONTESTED, f"{busy:.2f} cores busy with other work at start: the short spin"
    return SPIN_IDLE, f"cores idle at start ({busy:.2f} busy)"


CHOICE_VAR = "SERVELM_ENV_CHOICE"  # the choice's log line, for child processes (engine core)


def apply_defaults() -> dict[str, str]:
    """Set each default the environment does not have; returns OWN_ENV."""
    if "GOMP_SPINCOUNT" not in os.environ:
        value, why = choose_spincount(busy_cores())
        os.environ["GOMP_SPINCOUNT"] = OWN_ENV["GOMP_SPINCOUNT"] = value
        REASONS["GOMP_SPINCOUNT"] = why
        os.environ[CHOICE_VAR] = OWN_ENV[CHOICE_VAR] = _line()
    return OWN_ENV


def _line() -> str:
    return "environment: " + "; ".join(f"{k}={v} ({REASONS.get(k, 'default')})"
                                       for k, v in OWN_ENV.items() if k != CHOICE_VAR)


def startup_line() -> str | None:
    """One start-up log line naming what was set and why (None when nothing was): this
    process's choice, or the one its parent (`servelm serve` for its engine core) passed on."""
    if OWN_ENV:
        return OWN_ENV[CHOICE_VAR]
    return os.environ.get(CHOICE_VAR)
