"""Autoscaling: the policy (policy.py) shared by the Ray controller and the simulator."""

from servelm.autoscale.policy import (
    AutoscaleConfig,
    AutoscaleConfigError,
    Autoscaler,
    BatchBacklog,
    BatchDemand,
    Decision,
)

__all__ = ["AutoscaleConfig", "AutoscaleConfigError", "Autoscaler", "BatchBacklog",
           "BatchDemand", "Decision"]
