"""ServeProcess: `servelm serve MODEL` as a subprocess on a free port, its stderr collected
(import as `serve_process`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import httpx

from live_server import MODEL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    def __init__(self, *flags: str, model: str = MODEL, port: int | None = None):
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "servelm.cli", "serve", model, "--port", str(self.port),
               "--kv-cache-memory", "64MiB", *flags]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.stderr: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(90):
            self.proc.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.stderr))

    def _read(self):
        for line in self.proc.stderr:
            self.stderr.append(line)
            if "[servelm] serving" in line:
                self._ready.set()

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        return next(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith(name + " "))
