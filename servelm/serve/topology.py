"""TopologyConfig: which processes `servelm serve` starts and how they are laid out.

Owns: the serve command's topology options, their defaults and their flags (each field an
`option()`: servelm/config/option.py): data-parallel replicas and their routing policy,
prefill/decode disaggregation, where the engine core runs, and replicas placed on Ray. In
a --config file these are keys under `topology:` (config_file.py), with the engine's
model-parallel ones (EngineArgs: tensor-parallel-size, ..., role).
Never: starts anything (serve/cli.py's handler does, through the router packages), imports
FastAPI or torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelm.config.option import option
from servelm.router.policies import DEFAULT_POLICY, policy_help, policy_names

ENGINE_CORES = ("process", "thread")
BACKENDS = ("local", "ray")


def _router_policy_help() -> str:
    return "with --data-parallel-size or --backend ray: " + policy_help()


@dataclass(frozen=True)
class TopologyConfig:
    data_parallel_size: int = option(
        1, "N replicas of the model (each its own front end and engine core, the cores split "
           "between them) behind a router on this port", group="server", metavar="N")
    disagg: str | None = option(
        None, "prefill/decode disaggregation on this machine: P prefill and D decode workers "
              "(the cores split between them) behind a router on this port "
              "(docs/disaggregation.md)", group="server", metavar="P:D")
    router_policy: str = option(DEFAULT_POLICY, _router_policy_help, group="server",
                                choices=policy_names)
    engine_core: str = option(
        "process", "run the engine core (scheduler + model) in its own process (default; a "
                   "slow client or a busy event loop never delays a step) or on a thread of "
                   "the HTTP process", group="server", choices=ENGINE_CORES)
    backend: str = option(
        "local", "local: this machine's processes (default; --data-parallel-size N replicas); "
                 "ray: --num-replicas replicas as Ray actors on a cluster, the router here "
                 "(docs/router.md)", group="ray", choices=BACKENDS)
    num_replicas: int = option(1, "with --backend ray: replicas to place", group="ray",
                               metavar="N")
    ray_address: str | None = option(
        None, "with --backend ray or --parallel-launcher ray: the cluster to join (default "
              "$RAY_ADDRESS, a cluster started here with `ray start`, else a local Ray "
              "instance)", group="ray", metavar="ADDR")
    replica_cpus: float = option(
        1.0, "with --backend ray: CPUs each replica actor holds (its --threads unless given; "
             "default %(default)s)", group="ray", metavar="C")
    replica_gpus: float = option(
        0.0, "with --backend ray: GPUs each replica actor holds (default %(default)s)",
        group="ray", metavar="G")
    autoscale: str | None = option(
        None, "with --backend ray: add and remove replica actors as the load asks, by this "
              "policy (JSON; docs/autoscale.md), starting from --num-replicas within its "
              "min..max", group="ray", metavar="POLICY_FILE")
