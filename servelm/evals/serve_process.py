"""`servelm serve` as a child process on a free port of 127.0.0.1: what the behaviour evals
and lm-eval talk to, exactly as a user would run it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


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
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServeProcess:
        import httpx

        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        env = {k: v for k, v in os.environ.items() if k != "SERVELM_API_KEY"}
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`{' '.join(self.args[2:])}` exited with "
                                   f"{self.proc.returncode} before serving")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"servelm serve did not start within "
                                   f"{self.startup_timeout:.0f}s")
            time.sleep(0.25)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: drains, then exits
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
