"""`servelm serve --data-parallel-size 2`: two replicas of the default model behind one port."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai

from live_server import MODEL
from serve_process import ServeProcess


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def test_two_replicas_behind_one_port(default_model_path):
    srv = ServeProcess("--data-parallel-size", "2", "--router-policy", "prefix_affinity")
    try:
        deadline = time.monotonic() + 120
        while True:  # the replicas print their own ready lines first
            try:
                if httpx.get(srv.url + "/health").json().get("healthy_replicas") == 2:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline, "".join(srv.stderr)
            time.sleep(0.2)
        replicas = [c for c in _children(srv.proc.pid)
                    if b"serve" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(replicas) == 2
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
        system = "You are a terse assistant. " * 20  # a shared prefix of many blocks
        answers, homes = [], set()
        for q in ("Name a color.", "Name a fruit.", "Name a planet."):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, max_tokens=8, temperature=0,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": q}])
            homes.add(raw.headers["x-servelm-replica"])
            answers.append(raw.parse())
            time.sleep(0.6)  # a probe: the router learns what the replica now caches
        assert all(a.choices[0].message.content for a in answers)
        assert len(homes) == 1  # the shared system prompt keeps them on one replica
        assert answers[-1].usage.prompt_tokens_details.cached_tokens > 100
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
    for pid in replicas:  # SIGTERM reached every replica and they are gone
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"


def _wait(cond, what: str, guard_s: float = 120.0) -> None:
    """Wait for cond(); the guard only ends a wait that would never end."""
    deadline = time.monotonic() + guard_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _healthy_replicas(url: str) -> int:
    try:
        return httpx.get(url + "/health").json().get("healthy_replicas", 0)
    except (httpx.HTTPError, ValueError):
        return 0


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_dead_replica_is_reported_and_the_rest_end_with_the_parent(default_model_path):
    srv = ServeProcess("--data-parallel-size", "2")
    try:
        _wait(lambda: _healthy_replicas(srv.url) == 2, "".join(srv.stderr))
        replicas = [c for c in _children(srv.proc.pid)
                    if b"serve" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(replicas) == 2
        os.kill(replicas[0], signal.SIGKILL)
        said = f"(pid {replicas[0]}) killed by SIGKILL"
        _wait(lambda: any("[servelm] data parallel: replica http://127.0.0.1:" in line
                          and said in line for line in srv.stderr), "".join(srv.stderr[-20:]))
        srv.proc.kill()  # no drain, no stop_all: the other replica goes by its own signal
        srv.proc.wait()
        _wait(lambda: _gone(replicas[1]), "the surviving replica outlived its parent")
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
