"""servelm's own folder: `$SERVELM_HOME`, default `~/.cache/servelm`.

Owns: where it is. Everything servelm keeps between runs lives under it: pulled models
(loader/model_cache.py), the GGUF index and prepared weights (loader/), the C++ kernel build
and the instruction-set probe (cpu_kernels/), the state store's SQLite file (server/).
Never: creates anything there (each user makes its own subfolder), or imports servelm: every
layer may read it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    return Path(os.environ.get("SERVELM_HOME") or "~/.cache/servelm").expanduser()
