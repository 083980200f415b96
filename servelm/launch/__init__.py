"""The launcher: a typed description of a process (spec.py) and the one supervisor that
starts, waits for, watches and stops it (supervisor.py). Torch-free; every topology (the
engine core, model-parallel ranks, data-parallel replicas, prefill/decode workers, Ray
replicas, eval and benchmark servers) starts its processes here."""

from servelm.launch.spec import (DEVNULL, INHERIT, TEE, TO_STDERR, Accepted, AtOnce, HttpHealth,
                                 ProcessSpec, Readiness, Resources, torchrun_env)
from servelm.launch.supervisor import (Death, LaunchError, ProcessHandle, Supervisor, Watch,
                                       describe_exit)

__all__ = ["DEVNULL", "INHERIT", "TEE", "TO_STDERR", "Accepted", "AtOnce", "Death", "HttpHealth",
           "LaunchError", "ProcessHandle", "ProcessSpec", "Readiness", "Resources",
           "Supervisor", "Watch", "describe_exit", "torchrun_env"]
