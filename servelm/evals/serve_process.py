"""`servelm serve` as a child process on a free port of 127.0.0.1: what the behaviour evals
and lm-eval talk to, exactly as a user would run it (a ProcessSpec the launcher's Supervisor
starts, waits for on /health and stops; servelm/launch/)."""

from __future__ import annotations

import socket
import sys

from servelm.launch import DEVNULL, TO_STDERR, HttpHealth, ProcessHandle, ProcessSpec, \
    Resources, Supervisor


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`with ServeProcess(model, ["--quantization", "int8"]) as server: server.url ...`"""

    def __init__(self, model: str, extra_args: list[str] | None = None,
                 served_model_name: str = "model", startup_timeout: float = 300.0,
                 log_path: str | None = None):
        self.model = model
        self.served_model_name = served_model_name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "servelm.cli", "serve", model, "--port",
                     str(self.port), "--served-model-name", served_model_name,
                     "--no-log-requests", *(extra_args or [])]
        self.startup_timeout = startup_timeout
        self.log_path = log_path
        self.handle: ProcessHandle | None = None

    @property
    def spec(self) -> ProcessSpec:
        """Its output to log_path (or nowhere; either way the supervisor keeps the last
        lines for the error if it dies), without the caller's API key."""
        return ProcessSpec(f"`{' '.join(self.args[2:])}`", tuple(self.args),
                           resources=Resources(unset_env=("SERVELM_API_KEY",)),
                           readiness=HttpHealth(f"{self.url}/health", probe_timeout_s=2.0),
                           ready_timeout_s=self.startup_timeout, stdout=TO_STDERR,
                           stderr=self.log_path or DEVNULL)

    @property
    def proc(self):
        return None if self.handle is None else self.handle.proc

    def __enter__(self) -> ServeProcess:
        self.handle = Supervisor(stop_at_exit=False).start(self.spec)  # LaunchError: why not
        return self

    def __exit__(self, *exc) -> None:
        if self.handle is not None:
            self.handle.stop(grace_s=60.0)  # SIGTERM: drains, then exits
