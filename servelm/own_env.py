"""The environment defaults servelm sets for itself when an engine is about to start.

Owns: OWN_ENV (what `apply_defaults` set in this process, so that the benchmark harness can
give peers the environment a user would run them in) and the defaults themselves:

    GOMP_SPINCOUNT=1000   torch's CPU kernels run in OpenMP (libgomp) thread teams. By default
                          a waiting thread spins for a long time; when another process holds a
                          core, a team of 2 then stalls at every barrier. Measured on the 2-core
                          CI machine (32 requests x 32 tokens): quiet, 115 -> 121 tok/s; beside
                          one busy process, 31 -> 70 tok/s.

Never: runs at import (`import servelm` leaves the environment alone), or overrides a
variable the user set. libgomp reads its variables when torch loads it, so the `servelm`
command applies these first thing; a Python program embedding servelm sets them itself (or
calls `apply_defaults()`) before it imports torch.
"""

from __future__ import annotations

import os

DEFAULTS = {"GOMP_SPINCOUNT": "1000"}
OWN_ENV: dict[str, str] = {}  # the defaults this process set (the user's own settings win)


def apply_defaults() -> dict[str, str]:
    """Set each default the environment does not have; returns OWN_ENV."""
    for key, value in DEFAULTS.items():
        if key not in os.environ:
            os.environ[key] = value
            OWN_ENV[key] = value
    return OWN_ENV
