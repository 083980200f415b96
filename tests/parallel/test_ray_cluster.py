"""`--parallel-launcher ray` on clusters started apart from servelm: a head started by `ray
start` with token authentication on (the test's own subprocess, port and temp dir), which
`servelm serve --tensor-parallel-size 2` joins through --ray-address with only the token in
its environment (RAY_AUTH_TOKEN; RAY_AUTH_MODE unset); and two Ray nodes on this machine (ray.cluster_utils.Cluster, one CPU each)
over which STRICT_SPREAD puts rank 0 and rank 1 on different nodes. Greedy tokens equal
TP=1's on the same tiny random model (float32) in both."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from parallel_helpers import PROMPTS, build, run_greedy, save_tiny

ray = pytest.importorskip("ray")

RAY = str(Path(sys.executable).with_name("ray"))
MAX_TOKENS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes_under(path: str) -> list[int]:
    """Pids of the processes whose command line names `path` (a cluster's temp dir)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            except OSError:
                continue
            if path.encode() in cmd:
                out.append(int(d))
    return out


@contextlib.contextmanager
def ray_head(num_cpus: int):
    """A Ray head started as `ray start --head --block` in its own session, temp dir and
    port, with token authentication on (a fresh token): yields (address, the environment a
    client needs: RAY_AUTH_MODE=token and RAY_AUTH_TOKEN). Stopped by SIGTERM to its
    process group (no `ray stop`: that would stop every cluster on the machine), SIGKILL
    after 30 s; no process of it is left."""
    tmp = tempfile.mkdtemp(prefix="srt-ray-", dir="/tmp")  # short: Ray's socket paths
    port = _free_port()
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env = {**os.environ, **auth, "RAY_ADDRESS": "",
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}  # SIGTERM: stop now, no drain
    log = open(os.path.join(tmp, "ray-start.log"), "w")
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port",
         str(port), "--num-cpus", str(num_cpus), "--num-gpus", "0", "--include-dashboard",
         "false", "--disable-usage-stats", "--temp-dir", tmp],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # up once its GCS answers a client (with the token)
            assert head.poll() is None, Path(tmp, "ray-start.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "ray start: no GCS in 60 s"
            probe = subprocess.run(
                [sys.executable, "-c", f"import ray; ray.init(address={address!r}, "
                 "logging_level=40); print('nodes', len(ray.nodes()))"],
                env={**os.environ, **auth, "RAY_ADDRESS": ""}, capture_output=True,
                text=True, timeout=60)
            if "nodes 1" in probe.stdout:
                break
            time.sleep(0.5)
        yield address, auth
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        log.close()
        deadline = time.monotonic() + 15
        while _processes_under(tmp) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _processes_under(tmp)
        for pid in left:  # only this cluster's processes: they name its temp dir
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        subprocess.run(["rm", "-rf", tmp], check=False)
        assert not left, f"processes of the Ray cluster left after its stop: {left}"


class Served:
    """`servelm serve MODEL ...` as a subprocess with `env` added, its stderr collected."""

    def __init__(self, model: str, *flags: str, env: dict, ready_s: float = 120):
        self.url = f"http://127.0.0.1:{_free_port()}"
        port = self.url.rsplit(":", 1)[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "servelm.cli", "serve", model, "--port", port, *flags],
            stderr=subprocess.PIPE, text=True,
            env={**os.environ, **env, "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0"})
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + ready_s
        # this process's own line: a replica's, relayed by Ray, starts "(ReplicaActor pid=.."
        while not any(line.startswith("[servelm] serving") for line in self.stderr):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError("servelm serve did not start:\n" +
                                     "".join(self.stderr[-40:]))
            time.sleep(0.2)
        while True:  # a router prints its line before it listens
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError("servelm serve never healthy:\n" +
                                     "".join(self.stderr[-40:]))
            time.sleep(0.2)

    def _read(self):
        for line in self.proc.stderr:
            self.stderr.append(line)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def http_greedy(url: str, prompts=PROMPTS, max_tokens: int = MAX_TOKENS) -> dict:
    """{request: token ids} for each prompt (token ids in, greedy) over /v1/completions;
    the ids read back from the logprobs' tokens (the tiny tokenizer's word `t{id}`)."""
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    out = {}
    for i, p in enumerate(prompts):
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": list(p), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 1})
        assert r.status_code == 200, r.text
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
        assert all(t.startswith("t") and t[1:].isdigit() for t in tokens), tokens
        out[f"r{i}"] = [int(t[1:]) for t in tokens]
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("ray-cluster-models"))


@pytest.fixture(scope="module")
def tp1_tokens(tiny):
    tokens, _ = run_greedy(build(tiny), max_tokens=MAX_TOKENS)
    return tokens


def test_serve_tp2_on_a_started_cluster_with_token_auth_matches_tp1(tiny, tp1_tokens):
    with ray_head(num_cpus=2) as (address, auth):
        refused = subprocess.run(  # the cluster does want the token
            [sys.executable, "-c", f"import ray; ray.init(address={address!r}, "
             "logging_level=40)"], env={**os.environ, "RAY_ADDRESS": "", "RAY_AUTH_MODE": ""},
            capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0 and "token" in refused.stderr.lower()
        srv = Served(tiny, "--tensor-parallel-size", "2", "--parallel-launcher", "ray",
                     "--ray-address", address, "--dtype", "float32", "--kv-cache-memory",
                     "16MiB", "--max-model-len", "128",
                     # the token alone: servelm turns token mode on as `ray start` does
                     env={"RAY_AUTH_TOKEN": auth["RAY_AUTH_TOKEN"], "RAY_ADDRESS": ""})
        try:
            tokens = http_greedy(srv.url)
            log = "".join(srv.stderr)
        finally:
            code = srv.stop()
        assert "model parallel over Ray: 2 ranks in placement group" in log
        assert "(WorkerActor pid=" in log and "[servelm worker rank 1 " in log  # via Ray
        assert tokens == tp1_tokens
        assert code == 0, log[-3000:]


@pytest.fixture(scope="module")
def two_nodes():
    """Two Ray nodes (raylets) on this machine, one CPU each, this process their driver."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "num_gpus": 0, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, num_gpus=0)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level=logging.WARNING)
        try:
            yield cluster
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()


def test_strict_spread_puts_rank0_and_rank1_on_different_nodes(two_nodes, tiny, tp1_tokens):
    from ray.util import placement_group_table

    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 2
    here = ray.get_runtime_context().get_node_id()
    engine = build(tiny, tensor_parallel_size=2, parallel_launcher="ray",
                   parallel_placement="STRICT_SPREAD")
    workers = engine.runner.workers
    try:
        table = placement_group_table(workers.pg)
        assert table["strategy"] == "STRICT_SPREAD" and table["state"] == "CREATED"
        where = table["bundles_to_node_id"]
        # bundle 0 is rank 0's (this process's node), bundle 1 rank 1's actor's: the two
        # nodes share this machine's address, so they are told apart by node id
        assert where[0] == here and where[1] == workers.places[1].node_id
        assert workers.places[1].node_id != here and set(where.values()) == set(nodes)
        assert workers.places[1].node == ray.util.get_node_ip_address()
        tokens, _ = run_greedy(engine, max_tokens=MAX_TOKENS)
    finally:
        engine.runner.close()
    assert tokens == tp1_tokens
    assert placement_group_table(workers.pg)["state"] == "REMOVED"


def test_a_group_from_the_environment_is_checked_and_used(two_nodes, tiny, tp1_tokens,
                                                         monkeypatch):
    """The handoff from the router's Ray backend: a group named by
    $SERVELM_RAY_PLACEMENT_GROUP is used (rank 1 in its bundle 1) and left in place at
    close (its owner removes it); one whose bundle 0 is on another node is refused."""
    from ray.util import placement_group_table
    from ray.util.placement_group import placement_group

    from servelm.parallel import ray_launcher

    here = ray.get_runtime_context().get_node_id()
    there = next(n["NodeID"] for n in ray.nodes() if n["NodeID"] != here)
    wrong = placement_group([{"CPU": 1.0}] * 2, strategy="STRICT_SPREAD",
                            bundle_label_selector=[{"ray.io/node-id": there}, {}])
    assert ray.wait([wrong.ready()], timeout=30)[0]
    monkeypatch.setenv(ray_launcher.PLACEMENT_GROUP_ENV, wrong.id.hex())
    with pytest.raises(ray_launcher.PlacementError, match="not on rank 0's node"):
        build(tiny, tensor_parallel_size=2, parallel_launcher="ray")
    ray.util.remove_placement_group(wrong)

    given = placement_group([{"CPU": 1.0}] * 2, strategy="STRICT_SPREAD",
                            bundle_label_selector=[{"ray.io/node-id": here}, {}])
    assert ray.wait([given.ready()], timeout=30)[0]
    monkeypatch.setenv(ray_launcher.PLACEMENT_GROUP_ENV, given.id.hex())
    engine = build(tiny, tensor_parallel_size=2, parallel_launcher="ray")
    workers = engine.runner.workers
    try:
        assert workers.pg.id == given.id and not workers.owns_group
        assert workers.places[1].placement_group == given.id.hex()
        assert workers.places[1].node_id == there
        tokens, _ = run_greedy(engine, max_tokens=MAX_TOKENS)
    finally:
        engine.runner.close()
    assert tokens == tp1_tokens
    assert placement_group_table(given)["state"] == "CREATED"  # its owner's to remove
    ray.util.remove_placement_group(given)
    with pytest.raises(ray_launcher.PlacementError, match="which is REMOVED"):
        build(tiny, tensor_parallel_size=2, parallel_launcher="ray")
