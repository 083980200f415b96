"""Autoscaling: the policy (policy.py) shared by the Ray controller and the simulator."""

from servelm.autoscale.policy import (
    AutoscaleConfig,
    AutoscaleConfigError,
    Autoscaler,
    Decision,
)

__all__ = ["AutoscaleConfig", "AutoscaleConfigError", "Autoscaler", "Decision"]
