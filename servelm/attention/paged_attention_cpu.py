"""The C++ paged-attention kernel for decodes on the CPU (csrc/paged_attention.cpp).

Owns: building the kernel once per machine (torch.utils.cpp_extension: a C++ compiler and
ninja, `-O3 -march=native`, into $SERVELM_HOME/torch_extensions, under a name that hashes the
source, the torch version and the CPU's instruction sets) and the choice of path, made once
when a backend is built:

    SERVELM_CPU_ATTENTION=auto    the kernel for fp32/bf16 caches on the CPU where it builds,
                                  else the torch path (default)
    SERVELM_CPU_ATTENTION=kernel  the same, but a failed build is an error
    SERVELM_CPU_ATTENTION=torch   always the torch path (gather + SDPA)

Never: fails an engine in "auto" mode. A failed build logs one warning and the torch path runs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)

ENV_VAR = "SERVELM_CPU_ATTENTION"
MODES = ("auto", "kernel", "torch")
CACHE_DTYPES = (torch.float32, torch.bfloat16)  # others (fp16, fp8) take the torch path

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_lock = threading.Lock()
_loaded: Callable | None = None
_error: Exception | None = None  # a failed build is tried once per process
_warned = False


def mode() -> str:
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV_VAR}={value!r}: choose one of {MODES}")
    return value


def decode_kernel_for(cache: torch.Tensor) -> Callable | None:
    """The kernel for decodes over `cache` (a K or V pool, [..., K, D]), or None where the
    torch path must run: not the CPU, an fp16/fp8 cache, D not a multiple of 16 (or over
    256), mode 'torch', or a failed build in mode 'auto'."""
    chosen = mode()
    head_dim = cache.shape[-1]
    if (chosen == "torch" or cache.device.type != "cpu" or cache.dtype not in CACHE_DTYPES
            or head_dim % 16 or head_dim > 256):
        return None
    if chosen == "kernel":
        return load()
    try:
        return load()
    except Exception as exc:  # no compiler, no ninja, a read-only cache: keep serving
        _warn_once(exc)
        return None


def _warn_once(exc: Exception) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:300]
    logger.warning("CPU paged-attention kernel unavailable (%s); decodes use the torch "
                   "attention path. Set %s=torch to skip the build.", last, ENV_VAR)


def load() -> Callable:
    """Build (once per machine) and load the kernel; raises if it cannot be built.

    paged_decode(q [B, H, D], k_cache, v_cache [num_slots, K, D], block_tables [>=B, M] int64,
                 seq_lens [B] int64, block_size, scale) -> out [B, H, D] float32
    """
    global _loaded, _error
    with _lock:
        if _loaded is not None:
            return _loaded
        if _error is not None:
            raise _error
        try:
            _build()
            _loaded = torch.ops.servelm_cpu.paged_decode
        except Exception as exc:
            _error = exc
            raise
        return _loaded


def _build() -> None:
    from torch.utils import cpp_extension

    from servelm.loader.model_cache import cache_home

    _put_pip_ninja_on_path()
    name = f"servelm_paged_attention_{_build_key()}"
    build_dir = cache_home() / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name, [str(_SOURCE)], extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                       build_directory=str(build_dir), is_python_module=False, verbose=False)


def _build_key() -> str:
    """-march=native code runs only where it was built: a home shared by different machines
    must not hand one machine's build to another."""
    h = hashlib.sha256(_SOURCE.read_bytes())
    h.update(" ".join([torch.__version__, *_CFLAGS, _cpu_flags()]).encode())
    return h.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _put_pip_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the PyPI `ninja` package (a dependency) puts it
    in the venv's bin/, which is not on PATH when servelm runs without activating the venv."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
