"""ProcessSpec: the typed description of a process servelm starts.

Owns: what to run (argv), the config object it is handed (bytes on its stdin: a codec frame
or JSON, so a child never reparses a parent's edited command line), its resources (CPU
threads, CPU cores, GPU ids, environment), where its output goes, how it dies with its
parent, and its readiness condition (HTTP health, a socket a child connects to, at once).
Never: starts anything (servelm/launch/supervisor.py does), imports torch.

Readiness is a small protocol so every topology waits the same way:

    check()   one non-blocking-ish probe: True once the process is ready (an HTTP 200 on
              its health URL, a connection accepted, ...); polled until then, and again
              by Supervisor.watch as the health check
    what      how a log line and an error name the condition ("GET http://.../health")
"""

from __future__ import annotations

import dataclasses
import functools
import signal
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

# where output goes (or a file path, appended to)
TEE, INHERIT, DEVNULL, TO_STDERR = "tee", "inherit", "devnull", "stderr"


class Readiness(Protocol):
    what: str

    def check(self) -> bool: ...


@dataclass(frozen=True)
class AtOnce:
    """Ready as soon as it is started (a rank that joins a group its parent waits on)."""
    what: str = "started"

    def check(self) -> bool:
        return True


@dataclass(frozen=True)
class HttpHealth:
    """Ready (and healthy) while GET url answers 200."""
    url: str
    probe_timeout_s: float = 1.0

    @property
    def what(self) -> str:
        return f"GET {self.url}"

    def check(self) -> bool:
        import httpx

        try:
            return _probe_client().get(self.url, timeout=self.probe_timeout_s).status_code \
                == 200
        except httpx.HTTPError:
            return False


@functools.cache
def _probe_client():
    """One HTTP client for every health probe of this process (httpx's clients may be shared
    between threads): a client per probe builds an SSL context each time, about 25 ms of CPU,
    which a start-up probed every 10 ms would pay beside the process it times."""
    import httpx

    return httpx.Client()


@dataclass
class Accepted:
    """Ready once the child connects to `listener` (a bound, listening socket): the start of
    a handshake the caller then runs on `.sock` (the engine core's Hello / Start / Ready)."""
    listener: socket.socket
    what: str = "a connection"
    sock: socket.socket | None = None
    poll_s: float = 0.2

    def check(self) -> bool:
        if self.sock is None:
            self.listener.settimeout(self.poll_s)
            try:
                self.sock, _ = self.listener.accept()
            except TimeoutError:
                return False
            self.sock.settimeout(None)
        return True


@dataclass(frozen=True)
class Resources:
    """What a process may use. `num_threads` sets OMP_NUM_THREADS; `cpus` pins it (sched
    affinity, set before exec); `gpu_ids` sets CUDA_VISIBLE_DEVICES; `env` is added to (and
    `unset_env` removed from) the parent's environment."""
    num_threads: int | None = None
    cpus: tuple[int, ...] = ()
    gpu_ids: tuple[int, ...] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    unset_env: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if any(c < 0 for c in self.cpus):
            raise ValueError(f"cpus must be core numbers >= 0, got {list(self.cpus)}")

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        out = {k: v for k, v in base.items() if k not in self.unset_env}
        if self.num_threads is not None:
            out["OMP_NUM_THREADS"] = str(self.num_threads)
        if self.gpu_ids is not None:
            out["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpu_ids)
        out.update(self.env)
        return out


def torchrun_env(rank: int, world_size: int, master_addr: str, master_port: int,
                 local_rank: int | None = None) -> dict[str, str]:
    """The variables torchrun gives a rank (what `python -m servelm.core_process.worker
    --from-env` reads): a rank placed by something else runs under these."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": master_addr,
           "MASTER_PORT": str(master_port)}
    if local_rank is not None:
        env["LOCAL_RANK"] = str(local_rank)
    return env


@dataclass(frozen=True)
class ProcessSpec:
    """One process to start. `name` names it in every log line and error ("replica
    http://127.0.0.1:8001", "worker rank 1"). `config` is written to its stdin, which is
    then closed (None: stdin is /dev/null). `stdout` / `stderr`: TEE (stderr only: to the
    parent's stderr through the supervisor, which keeps the last lines for the death report),
    INHERIT (straight to the parent's: what a child that logs after the parent is gone
    needs), DEVNULL or a file path (both through the supervisor too), or TO_STDERR (stdout
    only: wherever stderr goes). `on_stderr_line` is also handed each line of stderr (without
    its newline, on the supervisor's pump thread, so it must be quick; not with INHERIT):
    what a caller that reads a child's log as it comes needs (`bench coldstart`'s notes).
    `ready_poll_s` is how often the readiness condition is probed while it starts (a caller
    that times the start-up polls often). `parent_death_signal` reaches
    the child when this process ends, however it ends (None: it outlives us). SIGKILL by
    default: a teed child cannot even log once our end of its stderr is gone (a print
    raises), so one that must finish something (the engine core freeing its blocks) gets a
    lifeline of its own (its socket) with stderr INHERIT and None here;
    `new_session` puts it in a process group of its own, so stopping it stops what it
    started too (and a terminal's Ctrl-C reaches only the parent, which stops it)."""
    name: str
    argv: tuple[str, ...]
    config: bytes | None = None
    resources: Resources = field(default_factory=Resources)
    readiness: Readiness = field(default_factory=AtOnce)
    ready_timeout_s: float = 900.0
    ready_poll_s: float = 0.2
    stdout: str = INHERIT
    stderr: str = TEE
    on_stderr_line: Callable[[str], None] | None = None
    parent_death_signal: int | None = signal.SIGKILL
    new_session: bool = False
    stop_signal: int = signal.SIGTERM

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError(f"argv of {self.name!r} is empty")
        if self.ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s must be > 0, got {self.ready_timeout_s}")
        if self.ready_poll_s <= 0:
            raise ValueError(f"ready_poll_s must be > 0, got {self.ready_poll_s}")
        if self.on_stderr_line is not None and self.stderr == INHERIT:
            raise ValueError("on_stderr_line needs stderr other than INHERIT (an inherited "
                             "stderr never passes through the supervisor)")
        if self.stderr == TO_STDERR:
            raise ValueError("stderr cannot be TO_STDERR (only stdout can be merged)")
        if self.stdout == TEE:
            raise ValueError("stdout cannot be TEE (only stderr is kept for death reports)")
        object.__setattr__(self, "argv", tuple(self.argv))

    def replace(self, **changes) -> ProcessSpec:
        return dataclasses.replace(self, **changes)


__all__ = ["DEVNULL", "INHERIT", "TEE", "TO_STDERR", "Accepted", "AtOnce", "HttpHealth",
           "ProcessSpec", "Readiness", "Resources", "torchrun_env"]
