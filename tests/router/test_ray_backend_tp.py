"""`servelm serve --backend ray --tensor-parallel-size 2`: a model-parallel replica behind
the router on a Ray cluster the test starts (`ray start --head`, 2 CPUs, token
authentication on). The replica's placement group (a bundle per rank) is reserved once, by
the router's backend: the replica's actor holds bundle 0 and the replica's ranks 1.. go to
bundles 1.. through `--parallel-launcher ray`. Greedy tokens equal TP=1's; stopping the
router leaves no actor and no placement group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from test_ray_cluster import MAX_TOKENS, Served, http_greedy, ray_head  # noqa: E402

from replica_reference import edited, parse, received  # noqa: E402

from servelm.router.ray_backend import ReplicaShape, replica_serve_options  # noqa: E402

pytest.importorskip("ray")

INSPECT = """
import json, ray
from ray._private import state
from ray.util import placement_group_table
ray.init(address=ADDRESS, logging_level=40)
print("STATE " + json.dumps({
    "groups": [{"id": g["placement_group_id"], "state": g["state"], "strategy": g["strategy"],
                "bundles": g["bundles"], "nodes": g["bundles_to_node_id"]}
               for g in placement_group_table().values()],
    "actors": [{"class": a["ActorClassName"], "state": a["State"]}
               for a in state.actors().values()],
    "free": ray.available_resources()}))
"""


def _cluster_state(address: str, auth: dict) -> dict:
    """The cluster's placement groups, actors and free resources, read by a client process
    of its own (the token in its environment only)."""
    done = subprocess.run([sys.executable, "-c", INSPECT.replace("ADDRESS", repr(address))],
                          env={**os.environ, **auth, "RAY_ADDRESS": ""}, capture_output=True,
                          text=True, timeout=60)
    line = next((x for x in done.stdout.splitlines() if x.startswith("STATE ")), None)
    assert line, done.stderr[-2000:]
    return json.loads(line[6:])


def test_a_model_parallel_replica_is_one_group_of_a_bundle_per_rank(monkeypatch):
    import argparse

    def shape(*argv):
        args = argparse.Namespace(replica_cpus=4.0, replica_gpus=0.0, tensor_parallel_size=2,
                                  pipeline_parallel_size=1, parallel_launcher="process",
                                  parallel_placement="SPREAD")
        for flag, value in zip(argv[::2], argv[1::2]):
            setattr(args, flag.lstrip("-").replace("-", "_"), value)
        return ReplicaShape.from_args(args, ["m", *argv])

    grouped = shape()
    assert grouped.is_grouped and grouped.world == 2 and grouped.strategy == "SPREAD"
    assert grouped.bundles() == [{"CPU": 2.0}, {"CPU": 2.0}]
    assert received(grouped.options(parse(["m"])), monkeypatch) == \
        edited(["m", "--threads", "4", "--parallel-launcher", "ray"])
    local = shape("--parallel-launcher", "process")  # asked for: one actor, local ranks
    assert not local.is_grouped and local.bundles() == [{"CPU": 4.0}]
    assert received(local.options(parse(["m", "--parallel-launcher", "process"])),
                    monkeypatch) == edited(["m", "--parallel-launcher", "process",
                                            "--threads", "4"])
    assert received(replica_serve_options(parse(["m", "--parallel-launcher", "ray"]), 2,
                                          True), monkeypatch) == \
        edited(["m", "--parallel-launcher", "ray", "--threads", "2"])


def test_tp2_replica_behind_the_router_matches_tp1_and_stops_clean(tmp_path):
    from parallel_helpers import build, run_greedy, save_tiny

    tiny = save_tiny("llama", tmp_path)
    tp1, _ = run_greedy(build(tiny), max_tokens=MAX_TOKENS)
    with ray_head(num_cpus=2) as (address, auth):
        srv = Served(tiny, "--backend", "ray", "--num-replicas", "1", "--ray-address",
                     address, "--replica-cpus", "2", "--tensor-parallel-size", "2",
                     "--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len",
                     "128", env={"RAY_AUTH_TOKEN": auth["RAY_AUTH_TOKEN"], "RAY_ADDRESS": ""},
                     ready_s=150)
        try:
            tokens = http_greedy(srv.url)
            serving = _cluster_state(address, auth)
            log = "".join(srv.stderr)
        finally:
            code = srv.stop(90)
        stopped = _cluster_state(address, auth)
    assert "1 replicas on Ray, 2 ranks each in its own placement group (PACK)" in log
    assert tokens == tp1
    # one group, the backend's: bundle 0 held by the replica's actor, bundle 1 by rank 1's
    # worker actor, which the replica's launcher put there instead of reserving its own
    (group,) = serving["groups"]
    assert group["state"] == "CREATED" and len(group["bundles"]) == 2
    assert all(b["CPU"] == 1.0 for b in group["bundles"].values())
    pg = group["id"]
    assert f"2 ranks in placement group {pg} (the replica's, from the router)" in log
    free = serving["free"]
    assert free.get(f"CPU_group_0_{pg}", 0.0) == 0.0
    assert free.get(f"CPU_group_1_{pg}", 0.0) == 0.0
    assert free.get("CPU", 0.0) == 0.0  # the cluster's 2 CPUs: the group's, nothing more
    alive = sorted(a["class"] for a in serving["actors"] if a["state"] == "ALIVE")
    assert alive == ["ReplicaActor", "WorkerActor"]
    assert code == 0, log[-3000:]
    # stopped: no actor alive, the group removed, every CPU free again
    assert [a for a in stopped["actors"] if a["state"] != "DEAD"] == []
    assert [g["state"] for g in stopped["groups"]] == ["REMOVED"]
    assert stopped["free"].get("CPU") == 2.0
