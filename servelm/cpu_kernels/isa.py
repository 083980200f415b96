"""Which x86 instruction sets this machine can run, checked by running them.

A CPU flag is not proof that an instruction set is usable: a virtual machine may advertise one
it does not honour, and AMX needs the kernel's permission for its tile state before the first
tile instruction (without it the process dies of SIGILL; llama.cpp's AMX build did exactly that
on one of this project's machines). So the paths that depend on an instruction set ask
`usable(name)`, which is true only when the CPU advertises it and a probe ran one instruction
of it and got the right answer.

Owns: the probe (isa_probe.c, compiled with the system C compiler into $SERVELM_HOME/isa/, a
second of work once per machine; each test runs in a child process, so an instruction that
faults kills the child, never the caller) and its answer, cached on disk under a key of the
CPU's flags line and the probe's source, and in the process.
Never: enables anything itself. Without a C compiler it trusts the advertised flags for the
vector sets and reports AMX unusable (the one set known to fault where advertised), and says
so in `describe()`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# What the probe tests (isa_probe.c), by /proc/cpuinfo flag name.
PROBED = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
_SOURCE = Path(__file__).with_name("isa_probe.c")


def advertised() -> frozenset[str]:
    """The flags /proc/cpuinfo lists for the first CPU (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def probe() -> dict[str, object]:
    """{"usable": {name: bool}, "checked": bool, "note": str}, once per process."""
    flags = advertised()
    if platform.machine().lower() not in ("x86_64", "amd64") or not flags:
        return {"usable": dict.fromkeys(PROBED, False), "checked": False,
                "note": f"not an x86-64 CPU ({platform.machine()})"}
    cache = _cache_path(flags)
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        pass
    result = _run_probe(flags)
    if result["checked"]:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(result))
            tmp.replace(cache)
        except OSError:  # a read-only home: probe again next time
            pass
    return result


def usable(name: str) -> bool:
    """Whether this machine runs instruction set `name` (one of PROBED)."""
    if name not in PROBED:
        raise ValueError(f"isa: {name!r} is not probed; probed sets: {PROBED}")
    return bool(probe()["usable"][name])


def has_bf16_math() -> bool:
    """bfloat16 dot products in hardware: avx512_bf16 or AMX-BF16 tiles."""
    return usable("avx512_bf16") or usable("amx_bf16")


def describe() -> str:
    """One line for the start-up log: what runs, and how that is known."""
    result = probe()
    ok = [n for n in PROBED if result["usable"][n]]
    said = sorted(set(PROBED) & advertised())
    refused = [n for n in said if n not in ok]
    text = "usable: " + (" ".join(ok) or "none of " + " ".join(PROBED))
    if refused:
        text += "; advertised but not usable: " + " ".join(refused)
    return f"{text} ({result['note']})"


def _cache_path(flags: frozenset[str]) -> Path:
    from servelm.home import cache_home

    h = hashlib.sha256(" ".join(sorted(flags)).encode())
    h.update(_SOURCE.read_bytes())
    return cache_home() / "isa" / f"probe-{h.hexdigest()[:16]}.json"


def _run_probe(flags: frozenset[str]) -> dict[str, object]:
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        trusted = {n: n in flags and not n.startswith("amx") for n in PROBED}
        return {"usable": trusted, "checked": False,
                "note": "no C compiler to probe with: vector flags trusted as advertised, AMX off"}
    with tempfile.TemporaryDirectory(prefix="servelm-isa-") as tmp:
        exe = Path(tmp) / "isa_probe"
        build = subprocess.run([compiler, "-O1", "-o", str(exe), str(_SOURCE)],
                               capture_output=True, text=True, timeout=60)
        if build.returncode != 0:  # an old compiler without the AMX intrinsics, say
            last = (build.stderr.strip().splitlines() or ["?"])[-1][:200]
            logger.warning("isa: the instruction-set probe did not compile (%s); vector "
                           "flags trusted as advertised, AMX off", last)
            trusted = {n: n in flags and not n.startswith("amx") for n in PROBED}
            return {"usable": trusted, "checked": False, "note": "probe did not compile"}
        ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    found = dict(line.split() for line in ran.stdout.splitlines() if line.count(" ") == 1)
    # Both must hold: advertised (a probe may pass where the kernel would still refuse a
    # feature it does not expose) and run correctly.
    checked = {n: n in flags and found.get(n) == "1" for n in PROBED}
    return {"usable": checked, "checked": True, "note": "each set probed by running it"}


def request_amx() -> bool:
    """Ask the kernel for AMX tile state in this process (once is enough; idempotent): True
    when granted. Kernels of servelm's own that use tiles call it before the first one;
    oneDNN asks for itself."""
    if not usable("amx_bf16") and not usable("amx_int8"):
        return False
    import ctypes

    arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18  # x86-64 syscall numbers
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(arch_prctl, req_xcomp_perm, xtiledata) == 0
