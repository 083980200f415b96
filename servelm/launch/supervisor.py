"""Supervisor: the one place servelm starts, waits for, watches and stops processes.

Owns: starting a ProcessSpec (servelm/launch/spec.py) as a local child, handing it its
config on stdin, waiting for its readiness condition with progress in the log, the health
watch (a thread that reports each death and each run of failed health checks), stopping
(the spec's stop signal to the process or its group, SIGKILL after a grace period), and the
one way every death is told: `Death` (name, pid, exit code or signal, the last stderr lines).
Never: restarts a process (whoever watches decides), imports torch, or reads a child's
argv back to change it.

Dying with the parent: every child is forked by one thread that lives as long as this
process, with PR_SET_PDEATHSIG set between fork and exec. The kernel sends that signal when
the *thread* that forked the child ends, so forking from whichever thread called start()
(an engine built on a short-lived thread) would kill the child with that thread:

    caller thread --start(spec)--> spawner thread --fork--> child (PDEATHSIG: spec's signal)
         ^                              |  lives until the process exits
         +------ ProcessHandle ---------+
    child's stderr --pipe--> pump thread --> the parent's stderr / a log file / nowhere,
                                             keeping the last 8 KiB for the death report,
                                             and each line to spec.on_stderr_line
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import ctypes
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from servelm.launch.spec import DEVNULL, INHERIT, TEE, TO_STDERR, AtOnce, ProcessSpec

logger = logging.getLogger(__name__)

TAIL_BYTES = 8192
PROGRESS_EVERY_S = 30.0
_PR_SET_PDEATHSIG = 1


class LaunchError(RuntimeError):
    """A process could not be started or did not become ready; `death` says how it ended
    (None when it was still running and was stopped for missing its deadline)."""

    def __init__(self, message: str, death: Death | None = None):
        super().__init__(message)
        self.death = death


def describe_exit(returncode: int) -> str:
    """'exited with code 3' / 'killed by SIGKILL' (Popen's negative codes are signals)."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


@dataclass(frozen=True)
class Death:
    name: str
    pid: int
    returncode: int
    stderr_tail: tuple[str, ...]

    @property
    def exit_code(self) -> int | None:
        return self.returncode if self.returncode >= 0 else None

    @property
    def signal_name(self) -> str | None:
        return None if self.returncode >= 0 else describe_exit(self.returncode)[10:]

    @property
    def how(self) -> str:
        return describe_exit(self.returncode)

    def describe(self, when: str = "", num_lines: int = 15) -> str:
        """'replica A (pid 7) exited with code 3 while starting; last stderr lines: ...'"""
        text = f"{self.name} (pid {self.pid}) {self.how}{' ' + when if when else ''}"
        lines = self.stderr_tail[-num_lines:] if num_lines else ()
        return text + ("; last stderr lines:\n  " + "\n  ".join(lines) if lines else "")


# -- forking from one long-lived thread ------------------------------------------------------

def _prctl():
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl
    return None


class _Spawner:
    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._prctl = _prctl() if sys.platform.startswith("linux") else None

    def popen(self, argv, spec: ProcessSpec, **kwargs) -> subprocess.Popen:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="servelm-spawner",
                                                daemon=True)
                self._thread.start()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((argv, self._preexec(spec), kwargs, done))
        return done.result()

    def _run(self) -> None:
        while True:
            argv, preexec, kwargs, done = self._jobs.get()
            try:
                done.set_result(subprocess.Popen(argv, preexec_fn=preexec, **kwargs))
            except BaseException as exc:  # handed to the caller, who raises it
                done.set_exception(exc)

    def _preexec(self, spec: ProcessSpec):
        """Runs in the child between fork and exec, so it does as little as it can: the
        prctl function was looked up before the fork, nothing is imported."""
        prctl, sig, cpus = self._prctl, spec.parent_death_signal, spec.resources.cpus
        parent = os.getpid()
        if (prctl is None or sig is None) and not cpus:
            return None

        def preexec() -> None:
            if prctl is not None and sig is not None:
                prctl(_PR_SET_PDEATHSIG, int(sig))
                if os.getppid() != parent:  # the parent ended before the prctl took hold
                    os._exit(1)
            if cpus:
                os.sched_setaffinity(0, cpus)
        return preexec


_SPAWNER = _Spawner()


# -- output ------------------------------------------------------------------------------------

class _Pump:
    """Forwards a child's stderr pipe as it comes (progress bars keep their \\r) and keeps
    its tail; hands each line to `on_line`; ends at EOF (the child and everything it started
    closed the pipe)."""

    def __init__(self, fd: int, target: str, name: str,
                 on_line: Callable[[str], None] | None = None):
        self.tail = b""
        self.name = name
        self._lock = threading.Lock()
        self._out = None if target in (TEE, DEVNULL) else open(target, "ab")
        self._to_stderr = target == TEE
        self._on_line = on_line
        self._partial = b""  # a line not yet ended, for on_line
        self._thread = threading.Thread(target=self._run, args=(fd,), daemon=True,
                                        name=f"servelm-pump-{name}"[:60])
        self._thread.start()

    def _run(self, fd: int) -> None:
        try:
            while chunk := os.read(fd, 65536):
                with self._lock:
                    self.tail = (self.tail + chunk)[-TAIL_BYTES:]
                with contextlib.suppress(OSError, ValueError):
                    if self._to_stderr:
                        os.write(2, chunk)
                    elif self._out is not None:
                        self._out.write(chunk)
                        self._out.flush()
                self._give_lines(chunk)
            self._give_lines(b"", at_eof=True)
        finally:
            os.close(fd)
            if self._out is not None:
                self._out.close()

    def _give_lines(self, chunk: bytes, at_eof: bool = False) -> None:
        if self._on_line is None:
            return
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        if at_eof and self._partial:
            lines.append(self._partial)
        for line in lines:
            try:
                self._on_line(line.decode(errors="replace"))
            except Exception:  # the pipe must still be drained, or the child blocks on it
                logger.exception("%s: its stderr line callback failed; it gets no more lines",
                                 self.name)
                self._on_line = None
                return

    def lines(self) -> tuple[str, ...]:
        with self._lock:
            text = self.tail.decode(errors="replace")
        return tuple(ln for ln in text.replace("\r", "\n").splitlines() if ln.strip())

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


# -- one started process -----------------------------------------------------------------------

class ProcessHandle:
    def __init__(self, spec: ProcessSpec, proc: subprocess.Popen, pump: _Pump | None):
        self.spec = spec
        self.proc = proc
        self.pid = proc.pid
        self.name = spec.name
        self._pump = pump
        self.is_stopping = False  # stop() was called: its end is not a death to report
        self._death: Death | None = None

    def poll(self) -> int | None:
        return self.proc.poll()

    @property
    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def stderr_tail(self) -> tuple[str, ...]:
        """The last lines it wrote to stderr (none when its stderr is INHERIT)."""
        return self._pump.lines() if self._pump is not None else ()

    def death(self, settle_s: float = 0.0) -> Death | None:
        """How it ended, or None while it runs (waiting up to settle_s for it to end). The
        stderr it wrote just before dying is given a moment to reach the pump."""
        if self._death is not None:
            return self._death
        try:
            code = self.proc.wait(settle_s) if settle_s > 0 else self.proc.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            return None
        if self._pump is not None:  # its children may hold the pipe: a moment, no more
            self._pump.join(0.5)
        self._death = Death(self.name, self.pid, code, self.stderr_tail())
        return self._death

    def signal(self, sig: int) -> None:
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            if self.spec.new_session:
                os.killpg(self.pid, sig)
            else:
                self.proc.send_signal(sig)

    def stop(self, grace_s: float = 10.0) -> int:
        """The spec's stop signal, then SIGKILL once grace_s has passed; the exit code."""
        self.is_stopping = True
        self.signal(self.spec.stop_signal)
        return self.wait_or_kill(grace_s)

    def wait_or_kill(self, grace_s: float | None) -> int:
        """Its exit code once it ends; SIGKILL after grace_s (None: wait as long as it takes)."""
        try:
            return self.proc.wait(None if grace_s is None else max(0.0, grace_s))
        except subprocess.TimeoutExpired:
            logger.error("%s (pid %d) did not exit within %gs; killing it", self.name,
                         self.pid, grace_s)
            self.signal(signal.SIGKILL)
            return self.proc.wait()

    def __repr__(self) -> str:
        return f"ProcessHandle({self.name!r}, pid={self.pid})"


def _stdout_target(spec: ProcessSpec, stderr_fd: int | None):
    if spec.stdout == INHERIT:
        return None
    if spec.stdout == DEVNULL:
        return subprocess.DEVNULL
    if spec.stdout == TO_STDERR:
        return 2 if stderr_fd is None else stderr_fd
    return open(spec.stdout, "ab")


def _popen(spec: ProcessSpec) -> ProcessHandle:
    read_fd, write_fd = os.pipe() if spec.stderr != INHERIT else (None, None)
    stdout = _stdout_target(spec, write_fd)
    try:
        proc = _SPAWNER.popen(
            list(spec.argv), spec, stdin=subprocess.PIPE if spec.config is not None
            else subprocess.DEVNULL, stdout=stdout, stderr=write_fd,
            env=spec.resources.environ(os.environ), start_new_session=spec.new_session)
    except BaseException:
        if read_fd is not None:
            os.close(read_fd)
        raise
    finally:
        if write_fd is not None:
            os.close(write_fd)
        if hasattr(stdout, "close"):
            stdout.close()
    pump = (_Pump(read_fd, spec.stderr, spec.name, spec.on_stderr_line)
            if read_fd is not None else None)
    handle = ProcessHandle(spec, proc, pump)
    if spec.config is not None:
        try:
            proc.stdin.write(spec.config)
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died already: the readiness wait reports how
    return handle


# -- the supervisor ----------------------------------------------------------------------------

class Supervisor:
    """Starts processes from specs and keeps them: `start` / `start_all` wait for readiness,
    `watch` reports deaths and failed health checks, `stop_all` ends them (also at exit
    unless stop_at_exit is False: a child never outlives a parent that exits normally)."""

    def __init__(self, stop_at_exit: bool = True, progress_every_s: float = PROGRESS_EVERY_S):
        self.handles: list[ProcessHandle] = []
        self.progress_every_s = progress_every_s
        if stop_at_exit:
            atexit.register(self.stop_all, 3.0)

    def start(self, spec: ProcessSpec, wait: bool = True) -> ProcessHandle:
        return self.start_all([spec], wait)[0]

    def start_all(self, specs: Sequence[ProcessSpec], wait: bool = True) -> list[ProcessHandle]:
        """Start every spec, then wait until all are ready; if one dies or misses its
        deadline, stop them all and raise LaunchError naming it."""
        started: list[ProcessHandle] = []
        try:
            for spec in specs:
                started.append(_popen(spec))
                self.handles.append(started[-1])
            if wait:
                self.wait_ready(started)
        except BaseException:
            self.stop_all(5.0, started)
            raise
        return started

    def wait_ready(self, handles: Sequence[ProcessHandle]) -> None:
        start = time.monotonic()
        pending = list(handles)
        last_said = start
        while True:
            for h in list(pending):
                if isinstance(h.spec.readiness, AtOnce):  # ready when started, even if done
                    pending.remove(h)
                    continue
                death = h.death()
                if death is not None:
                    raise LaunchError(death.describe("while starting"), death)
                if h.spec.readiness.check():
                    pending.remove(h)
                elif time.monotonic() - start > h.spec.ready_timeout_s:
                    raise LaunchError(f"{h.name} not ready in {h.spec.ready_timeout_s:g} s "
                                      f"(waiting for {h.spec.readiness.what})")
            if not pending:
                return
            now = time.monotonic()
            if now - last_said >= self.progress_every_s:
                logger.info("waiting for %s: %.0f s", ", ".join(
                    f"{h.name} ({h.spec.readiness.what})" for h in pending), now - start)
                last_said = now
            time.sleep(min(h.spec.ready_poll_s for h in pending))

    def stop_all(self, grace_s: float = 10.0,
                 handles: Sequence[ProcessHandle] | None = None) -> None:
        """Signal them all at once, then SIGKILL whichever is left after grace_s."""
        handles = list(self.handles if handles is None else handles)
        for h in handles:
            h.is_stopping = True
            h.signal(h.spec.stop_signal)
        deadline = time.monotonic() + grace_s
        for h in handles:
            h.wait_or_kill(deadline - time.monotonic())
        self.handles = [h for h in self.handles if h not in handles]

    def watch(self, on_death: Callable[[Death], None],
              on_unhealthy: Callable[[ProcessHandle, int], None] | None = None,
              interval_s: float = 0.5, unhealthy_after: int = 3) -> Watch:
        """A thread that calls on_death(Death) once for each process that ends without
        stop(), and on_unhealthy(handle, n) after each n >= unhealthy_after failed health
        checks in a row (the spec's readiness condition, probed every interval_s)."""
        return Watch(self, on_death, on_unhealthy, interval_s, unhealthy_after)


class Watch:
    def __init__(self, supervisor: Supervisor, on_death, on_unhealthy, interval_s: float,
                 unhealthy_after: int):
        if unhealthy_after < 1:
            raise ValueError(f"unhealthy_after must be >= 1, got {unhealthy_after}")
        self._sup = supervisor
        self._on_death, self._on_unhealthy = on_death, on_unhealthy
        self._interval_s, self._after = interval_s, unhealthy_after
        self._failures: dict[int, int] = {}
        self._reported: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="servelm-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            for h in list(self._sup.handles):
                if h.pid in self._reported:
                    continue
                death = h.death()
                if death is not None:
                    self._reported.add(h.pid)
                    if not h.is_stopping:
                        self._on_death(death)
                elif self._on_unhealthy is not None:
                    self._probe(h)

    def _probe(self, h: ProcessHandle) -> None:
        if h.spec.readiness.check():
            self._failures[h.pid] = 0
            return
        n = self._failures[h.pid] = self._failures.get(h.pid, 0) + 1
        if n >= self._after:
            self._on_unhealthy(h, n)


__all__ = ["Death", "LaunchError", "ProcessHandle", "Supervisor", "Watch", "describe_exit"]
