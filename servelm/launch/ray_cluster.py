"""Joining a Ray cluster, for every process servelm places with Ray: the router's replicas
(router/ray_backend.py) and a replica's model-parallel ranks (parallel/ray_launcher.py).

Owns: importing Ray with a clear error, `connect` (ray.init the way `ray start` would) and the
environment variable that hands a replica's placement group down to its ranks.
Never: places or starts anything (the callers do), or imports servelm: both users sit above it.
"""

from __future__ import annotations

import os

# The environment the replica's `servelm serve` gets from its actor: the hex id of the
# replica's placement group, read by servelm/parallel/ray_launcher.py (its ranks go there).
PLACEMENT_GROUP_ENV = "SERVELM_RAY_PLACEMENT_GROUP"


class RayUnavailableError(RuntimeError):
    pass


def import_ray():
    try:
        import ray
    except ImportError:
        raise RayUnavailableError("--backend ray needs Ray: pip install 'servelm[ray]'") \
            from None
    return ray


def _token_auth_as_ray_start_would() -> None:
    """With RAY_AUTH_MODE unset and a Ray token on this machine ($RAY_AUTH_TOKEN,
    $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, which any local `ray.init` writes), `ray
    start` turns token authentication on, but `ray.init(address=...)` does not: turn it on
    here too (RAY_AUTH_MODE=token, so this process's children, the engine core among them,
    connect the same way). A token client still joins a cluster without authentication."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available)
    except ImportError:  # a Ray without token authentication
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def connect(address: str | None):
    """ray.init against `address` (or $RAY_ADDRESS, or a cluster started on this machine
    with `ray start`); with none of those, a local Ray instance for this process."""
    ray = import_ray()
    import logging

    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        _token_auth_as_ray_start_would()
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=True)
    return ray
