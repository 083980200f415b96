"""Building servelm's C++ op library: for this CPU, or for the instruction-set levels a wheel
carries prebuilt.

    native   `-march=native` into $SERVELM_HOME/torch_extensions/<name>/ (first use, or
             `servelm kernels build`, which `make serve` and `make test` run)
    levels   `servelm kernels build --levels all --out DIR`: one library per level below, each
             runnable on any CPU that has the level's instruction sets (setup.py puts them in
             a wheel under servelm/cpu_kernels/prebuilt/)

One build of a library at a time, on a machine:

    process A                     lock file <dir>.lock         process B
    flock(LOCK_EX) ------------->  held by A                   flock() waits, says by whom
    spawn builder (own session)->  {"pid": A, "session": S}    ...
    A dies (SIGKILL, Ctrl-C) --->  released by the kernel ---> B holds it at once:
                                                               kill what is left of session S,
                                                               clear the partial build, build

The lock is an OS lock (fcntl.flock), so it goes with its holder however the holder dies: no
age rule, no stale lock to wait on. The compiler runs in a child session of its own, started
by the launcher (servelm/launch/: the child dies with its parent, PR_SET_PDEATHSIG), so a
builder that is killed leaves at most compiler jobs that the next holder kills before it
writes into the same directory. A build is
done when its marker file is written after the library linked; a directory without the marker
is a partial build and is cleared.

Owns: the lock, the child build, the progress lines while a build runs or is waited for, the
levels and their compiler flags. Never: loads the library into this process (servelm.
cpu_kernels does), or decides which library a process uses.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import NamedTuple

logger = logging.getLogger(__name__)

DONE = "built.ok"  # written into a build directory once its library linked
_SAY_AFTER_S = 2.0  # a wait or build shorter than this stays quiet
_PROGRESS_EVERY_S = 15.0
_KILL_GRACE_S = 10.0


class Level(NamedTuple):
    """A prebuilt library's target: the compiler flags, and the /proc/cpuinfo flags a CPU
    must advertise (the probed ones must also pass isa.usable) to run it."""
    cflags: tuple[str, ...]
    needs: tuple[str, ...]


_V3 = ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe")
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
# From the oldest to the newest: a CPU runs the newest level whose needs it meets. The kernels
# pick their code paths at compile time (#if __AVX512BF16__ ...), so each level is a build.
LEVELS: dict[str, Level] = {
    "avx2": Level(("-march=x86-64-v3",), _V3),
    "avx512": Level(("-march=x86-64-v4",), _V4),
    "avx512_bf16": Level(("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
                         _V4 + ("avx512_vnni", "avx512_bf16")),
    "amx": Level(("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mamx-tile",
                  "-mamx-bf16", "-mamx-int8"),
                 _V4 + ("avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")),
}


def best_level(advertised: frozenset[str], usable) -> str | None:
    """The newest level this CPU runs: every flag advertised, and each probed one usable
    (`usable(name)`, isa.usable: AMX advertised without the kernel's permission is no AMX)."""
    from servelm.cpu_kernels.isa import PROBED

    runs = [name for name, level in LEVELS.items()
            if all(f in advertised and (f not in PROBED or usable(f)) for f in level.needs)]
    return runs[-1] if runs else None


class BuildSpec(NamedTuple):
    """One library to build: its name (the .so's), sources, flags and directory."""
    name: str
    sources: tuple[str, ...]
    cflags: tuple[str, ...]
    build_dir: Path

    @property
    def library(self) -> Path:
        return self.build_dir / f"{self.name}.so"

    @property
    def is_built(self) -> bool:
        return (self.build_dir / DONE).is_file() and self.library.is_file()


def ensure_built(spec: BuildSpec, what: str = "servelm's CPU kernels for this CPU") -> Path:
    """The library, built here unless it already is; one builder at a time per directory.
    Raises RuntimeError (with the compiler's last lines) when the build fails."""
    if spec.is_built:
        return spec.library
    spec.build_dir.mkdir(parents=True, exist_ok=True)
    with _held(spec, what):
        if spec.is_built:  # the process we waited for built it
            return spec.library
        _clear_partial(spec.build_dir)
        logger.warning("building %s (first run, about a minute; later starts load it)", what)
        _run_child(spec, what)
    return spec.library


def _lock_path(spec: BuildSpec) -> Path:
    return spec.build_dir.with_name(spec.build_dir.name + ".lock")


@contextlib.contextmanager
def _held(spec: BuildSpec, what: str):
    fd = os.open(_lock_path(spec), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _wait(fd, spec, what)
        _kill_strays(_read_holder(fd), spec.build_dir)
        _write_holder(fd, {"pid": os.getpid(), "started": time.time()})
        yield fd
    finally:
        os.close(fd)  # releases the lock


def _wait(fd: int, spec: BuildSpec, what: str) -> None:
    """Block until the lock is ours, saying whose build we wait for when it takes a while."""
    start = last_said = time.monotonic()
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        now = time.monotonic()
        if (not said and now - start >= _SAY_AFTER_S) or now - last_said >= _PROGRESS_EVERY_S:
            holder = _read_holder(fd)
            logger.warning("waiting for %s, being built by process %s: %s", what,
                           holder.get("pid", "?"), _progress(spec, now - start))
            said, last_said = True, now
        time.sleep(0.2)


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}


def _write_holder(fd: int, holder: dict) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)


def _kill_strays(holder: dict, build_dir: Path) -> None:
    """A killed builder's compiler jobs run on in its child's session (ninja gives each job a
    process group of its own, so the session is what they all share); end those that work in
    `build_dir` before this process writes there."""
    session = holder.get("session")
    if not isinstance(session, int) or session <= 1:
        return
    _kill_session(session, build_dir)


def _kill_session(session: int, build_dir: Path) -> None:
    strays = [pid for pid in session_members(session) if _works_in(pid, build_dir)]
    for pid in strays:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while strays and time.monotonic() < deadline:
        strays = [pid for pid in strays if _session_of(pid) == session]
        time.sleep(0.05)
    if strays:
        logger.warning("kernel build: processes %s of a stopped build are still running",
                       strays)


def session_members(session: int) -> list[int]:
    """The live processes of a session (by /proc)."""
    return [int(p.name) for p in Path("/proc").iterdir()
            if p.name.isdigit() and _session_of(int(p.name)) == session]


def _session_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        state_on = stat.rsplit(")", 1)[1].split()  # state ppid pgrp session ...
        return None if state_on[0] == "Z" else int(state_on[3])
    except (OSError, IndexError, ValueError):
        return None


def _works_in(pid: int, build_dir: Path) -> bool:
    try:
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    return cwd == build_dir.resolve() or str(build_dir) in cmdline


def _clear_partial(build_dir: Path) -> None:
    """Objects a killed compiler half wrote would look newer than their sources to ninja."""
    for path in build_dir.iterdir():
        if path.is_file():
            path.unlink(missing_ok=True)


def _progress(spec: BuildSpec, elapsed: float) -> str:
    done = sum(1 for p in spec.build_dir.glob("*.o"))
    return f"{done}/{len(spec.sources)} sources compiled, {elapsed:.0f} s"


def _run_child(spec: BuildSpec, what: str) -> None:
    """Compile in a child of this process, started by the launcher (a session of its own,
    SIGKILLed when this process ends, its output appended to build.log), reporting progress;
    raises RuntimeError with the log's tail when it fails."""
    from servelm.launch import TO_STDERR, ProcessSpec, Supervisor

    log_path = spec.build_dir / "build.log"
    # the job stays on the command line: _works_in finds a stray build by it
    argv = (sys.executable, "-m", "servelm.cpu_kernels.build", json.dumps(
        {"name": spec.name, "sources": list(spec.sources), "cflags": list(spec.cflags),
         "build_dir": str(spec.build_dir)}))
    start = time.monotonic()
    child = Supervisor(stop_at_exit=False).start(ProcessSpec(
        f"the build of {what}", argv, stdout=TO_STDERR, stderr=str(log_path),
        new_session=True))
    try:
        fd = os.open(_lock_path(spec), os.O_RDWR)
        try:
            _write_holder(fd, {"pid": os.getpid(), "session": child.pid,
                               "started": time.time()})
        finally:
            os.close(fd)  # a second descriptor of the same file: closing it keeps the lock
        last_said = start
        while child.is_alive:
            time.sleep(0.2)
            now = time.monotonic()
            if now - last_said >= _PROGRESS_EVERY_S:
                logger.warning("still building %s: %s", what, _progress(spec, now - start))
                last_said = now
    finally:
        if child.is_alive:  # interrupted here (Ctrl-C): the compiler goes with us
            child.is_stopping = True
            _kill_session(child.pid, spec.build_dir)
            child.wait_or_kill(_KILL_GRACE_S)
    returncode = child.death(settle_s=_KILL_GRACE_S).returncode  # and build.log is complete
    if returncode != 0 or not spec.is_built:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
        raise RuntimeError(f"building {what} failed (exit {returncode}; full log "
                           f"{log_path}):\n" + "\n".join(tail))
    logger.warning("built %s in %.0f s", what, time.monotonic() - start)


def _child_main(job: dict) -> None:
    """The build itself (in the child, which the launcher made die with its parent): torch's
    cpp_extension writes the ninja file and runs ninja; the marker is written only once the
    library linked."""
    from torch.utils import cpp_extension

    put_pip_ninja_on_path()
    build_dir = Path(job["build_dir"])
    cpp_extension.load(job["name"], job["sources"], extra_cflags=job["cflags"],
                       extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                       is_python_module=False, verbose=False)
    (build_dir / DONE).write_text(json.dumps({"cflags": job["cflags"]}))


def put_pip_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the PyPI `ninja` package (a dependency) puts it
    in the venv's bin/, which is not on PATH when servelm runs without activating the venv."""
    import shutil

    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


if __name__ == "__main__":
    _child_main(json.loads(sys.argv[1]))
