"""`--parallel-launcher ray`: a replica's ranks in one Ray placement group, on a local Ray
instance this module starts itself (one for the module, two logical CPUs: one bundle per
rank). Rank 0 is this process, pinned to bundle 0's node; rank 1 a Ray actor in bundle 1
running the worker main the process launcher's children run."""

from __future__ import annotations

import logging
import os
import time

import pytest
from parallel_helpers import build, max_logprob_diff, run_greedy, save_tiny
from test_tensor_parallel import TOLERANCE

ray = pytest.importorskip("ray")

RAY_CPUS = 2


@pytest.fixture(scope="module")
def cluster():
    """A local Ray instance of RAY_CPUS logical CPUs (address "local": never one named by
    $RAY_ADDRESS), shut down after the module."""
    ray.init(address="local", num_cpus=RAY_CPUS, num_gpus=0, include_dashboard=False,
             logging_level=logging.WARNING)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("ray-models"))


def _wait(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[1].split()[0] != "Z"  # a zombie has ended


def _released(workers) -> bool:
    """The placement group removed, every CPU free again, the actor's process gone."""
    from ray.util import placement_group_table

    return (placement_group_table(workers.pg)["state"] == "REMOVED"
            and ray.available_resources().get("CPU") == RAY_CPUS
            and not any(_alive(p) for p in workers.pids))


def test_tp2_over_ray_matches_one_process_and_uses_its_bundles(cluster, tiny):
    from ray.util import placement_group_table

    from servelm.parallel.ray_launcher import RayWorkerSet

    ref_tokens, ref_lps = run_greedy(build(tiny))
    engine = build(tiny, tensor_parallel_size=2, parallel_launcher="ray")
    workers = engine.runner.workers
    try:
        assert isinstance(workers, RayWorkerSet)
        pg = workers.pg.id.hex()
        table = placement_group_table(workers.pg)
        assert table["state"] == "CREATED" and table["strategy"] == "PACK"
        assert table["bundles"][0]["CPU"] == table["bundles"][1]["CPU"] == 1.0
        # rank 1's actor runs in the group and holds bundle 1's CPU; bundle 0's is rank 0's
        # (this process, no actor), so Ray still counts it free
        assert workers.places[1].placement_group == pg
        free = ray.available_resources()
        assert free.get(f"CPU_group_1_{pg}", 0.0) == 0.0
        assert free[f"CPU_group_0_{pg}"] == 1.0
        assert _alive(workers.pids[0]) and workers.pids[0] != os.getpid()
        tokens, lps = run_greedy(engine)
    finally:
        engine.runner.close()
    assert tokens == ref_tokens
    assert max_logprob_diff(lps, ref_lps) < TOLERANCE
    assert _wait(lambda: _released(workers), 10)


def test_a_killed_actor_fails_the_replica_and_leaves_no_actor_or_group(cluster, tiny):
    from ray.util import placement_group_table

    from servelm.parallel.runner import WorkerDiedError
    from servelm.protocol import EngineRequest, SamplingParams

    engine = build(tiny, tensor_parallel_size=2, parallel_launcher="ray",
                   parallel_placement="SPREAD")
    workers = engine.runner.workers
    try:
        assert placement_group_table(workers.pg)["strategy"] == "SPREAD"
        engine.add_request(EngineRequest("r0", [5, 6, 7], SamplingParams(
            max_tokens=50, temperature=0.0, ignore_eos=True)))
        engine.step()
        ray.kill(workers.actors[1])
        with pytest.raises(WorkerDiedError, match="worker rank 1 .*Ray actor"):
            for _ in range(50):  # the next step fails: its collective, or the check before it
                engine.step()
    finally:
        engine.runner.close()
    assert _wait(lambda: _released(workers), 10)


def test_a_group_the_cluster_cannot_place_fails_the_build_and_is_removed(cluster, tiny,
                                                                         monkeypatch):
    """STRICT_SPREAD wants one node per rank; this cluster has one node."""
    from ray.util import placement_group_table

    from servelm.parallel import ray_launcher

    monkeypatch.setattr(ray_launcher, "PLACEMENT_TIMEOUT_S", 2.0)
    with pytest.raises(ray_launcher.PlacementError, match="parallel_placement STRICT_SPREAD"):
        build(tiny, tensor_parallel_size=2, parallel_launcher="ray",
              parallel_placement="STRICT_SPREAD")
    mine = [g for g in placement_group_table().values()
            if g["name"].startswith(f"servelm-{os.getpid()}-")]
    assert mine and all(g["state"] == "REMOVED" for g in mine)
    assert _wait(lambda: ray.available_resources().get("CPU") == RAY_CPUS, 10)


def test_the_launcher_is_chosen_by_name(tmp_path):
    import argparse

    from servelm.config import EngineArgs, add_engine_cli_args, engine_args_from_cli
    from servelm.parallel.launcher import RankMain, start_workers
    from servelm.protocol import InvalidParameterError

    p = argparse.ArgumentParser()
    p.add_argument("model")
    add_engine_cli_args(p)
    assert "--parallel-launcher {process,ray}" in p.format_help()
    assert engine_args_from_cli(p.parse_args(["m"])).parallel_launcher == "process"
    args = engine_args_from_cli(p.parse_args(["m", "--parallel-launcher", "ray",
                                              "--parallel-placement", "STRICT_PACK"]))
    assert (args.parallel_launcher, args.parallel_placement) == ("ray", "STRICT_PACK")
    with pytest.raises(ValueError, match="parallel_launcher: 'mpi'"):
        EngineArgs(model="m", parallel_launcher="mpi")
    with pytest.raises(ValueError, match="parallel_placement: 'pack'"):
        EngineArgs(model="m", parallel_placement="pack")
    with pytest.raises(InvalidParameterError) as e:
        start_workers(EngineArgs(model="m", tensor_parallel_size=2, parallel_launcher="ray",
                                 parallel_master="127.0.0.1:1"),
                      RankMain("servelm.core_process.worker", build=lambda *a, **k: None))
    assert e.value.param == "parallel_master"
