"""servelm's C++ CPU kernels: one op library, `torch.ops.servelm_cpu`, built on first use.

    paged_attention.cpp   paged_decode: decode attention reading the paged K/V blocks in place
    layer_ops.cpp         rms_norm, add_rms_norm, rotary_, silu_and_mul: fused float32 layer ops
    quant_gemm.cpp        int4_gemm, int8_gemm: weight-only quantized matmuls, float32 activations
    decode_stack.cpp      DecodeStack (a class): a Llama decode step through all layers in one call
    vec16.h               16-lane vectors and exp shared by both

Owns: compiling the sources once per machine (torch.utils.cpp_extension: a C++ compiler and
ninja, `-O3 -march=native`, OpenMP) into $SERVELM_HOME/torch_extensions, under a name that
hashes the sources, the torch version and the CPU's instruction sets, then loading them.
A second process finds the build and only loads it; concurrent first builds take turns
(cpp_extension's lock file).

Never: fails a caller in 'auto' mode. Each user picks its path from its own environment
variable with `mode()`: 'auto' (the kernels where they build, else torch), 'kernel' (the
kernels, or an error), 'torch'; a failed build is tried once per process and warned about once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MODES = ("auto", "kernel", "torch")
_DIR = Path(__file__).parent
_SOURCES = ("paged_attention.cpp", "layer_ops.cpp", "quant_gemm.cpp", "decode_stack.cpp")
_HEADERS = ("vec16.h",)
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_lock = threading.Lock()
_loaded = None  # torch.ops.servelm_cpu once built
_error: Exception | None = None
_warned = False


def mode(env_var: str) -> str:
    value = os.environ.get(env_var, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{env_var}={value!r}: choose one of {MODES}")
    return value


def ops_for_mode(env_var: str):
    """torch.ops.servelm_cpu, or None: for mode 'torch', or a failed build in mode 'auto'
    (warned once). Mode 'kernel' raises what the build raised."""
    chosen = mode(env_var)
    if chosen == "torch":
        return None
    if chosen == "kernel":
        return load()
    try:
        return load()
    except Exception as exc:  # no compiler, no ninja, a read-only cache: keep serving
        _warn_once(exc)
        return None


def load():
    """Build (once per machine) and load the kernels; raises if they cannot be built."""
    global _loaded, _error
    with _lock:
        if _loaded is not None:
            return _loaded
        if _error is not None:
            raise _error
        try:
            _build()
            _loaded = torch.ops.servelm_cpu
            _loaded.paged_decode  # noqa: B018 - fails here, not mid-step, if registration did
        except Exception as exc:
            _error = exc
            raise
        return _loaded


def _warn_once(exc: Exception) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:300]
    logger.warning("servelm's C++ CPU kernels are unavailable (%s); the torch path runs "
                   "instead (slower). SERVELM_CPU_ATTENTION=torch and "
                   "SERVELM_CPU_LAYER_OPS=torch skip the build.", last)


def _build() -> None:
    from torch.utils import cpp_extension

    from servelm.loader.model_cache import cache_home

    _put_pip_ninja_on_path()
    name = f"servelm_cpu_kernels_{_build_key()}"
    build_dir = cache_home() / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name, [str(_DIR / s) for s in _SOURCES], extra_cflags=_CFLAGS,
                       extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                       is_python_module=False, verbose=False)


def _build_key() -> str:
    """-march=native code runs only where it was built: a home shared by different machines
    must not hand one machine's build to another."""
    h = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        h.update((_DIR / name).read_bytes())
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
