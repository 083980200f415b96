"""servelm's C++ CPU kernels: one op library, `torch.ops.servelm_cpu`, built on first use.

    paged_attention.cpp   paged_decode: decode attention reading the paged K/V blocks in place
    prefill_attention.cpp paged_prefill: prompt chunks' attention over the same blocks
                          (bfloat16, avx512_bf16), every prefilling sequence of a step at once
    mla_attention.cpp     paged_decode_mla: the same for multi-head latent attention (one
                          [latent | rope key] entry per token, shared by every head)
    layer_ops.cpp         rms_norm, add_rms_norm, rotary_, silu_and_mul: fused float32 layer ops
    logit_rows.cpp        logit_rows: the head's logits as float32 with each row's argmax and
                          how many lie within one bfloat16 step of its maximum, one pass a row
    quant_gemm.cpp        int4_gemm, int8_gemm: weight-only quantized matmuls, float32 activations
    quant_gemm_a8.cpp     int4_gemm_a8, int8_gemm_a8: the same weights times int8 activations
                          (avx512_vnni dot products, or AVX2's vpmaddubsw on CPUs
                          without AVX-512), int8_dot_probe, int8_dot_path
    kquant_gemm.cpp       kquant_gemm, kquant_dequant: GGUF K-quant (Q4_K, Q5_K, Q6_K) rows as
                          the file stores them, times activations rounded to int8 per 256
                          columns (vpmaddubsw with vpdpwssd or vpmaddwd), or dequantized
    amx_gemm.cpp          amx_linear: bfloat16 linears on AMX tiles, weights packed as the tiles
                          read them
    dot_gemm.cpp          dot_linear: the same packed weights on avx512_bf16 dot products
    decode_stack.cpp      DecodeStack (a class): a decode step through all of a decoder's
                          layers in one call (GQA or latent attention, dense MLP or MoE)
    det_gemm.cpp          det_pack, det_linear: the batch-invariant float32 linear of
                          deterministic mode (one fixed-order sum per output element)
    vec16.h               16-lane vectors, exp and fma shared by all
    paged_tables.h        the block-table checks of the two paged decode kernels
    tile_linear.h         the argument checks and output rounding of amx_linear and dot_linear

Owns: finding or making the library and loading it: this CPU's own build ($SERVELM_HOME/
torch_extensions, under a name that hashes the sources, the torch version and the CPU's
instruction sets; `-march=native`, OpenMP), else a prebuilt library for an instruction-set
level this CPU runs (prebuilt.py: what a wheel carries), else building this CPU's now
(build.py: an OS lock so one process builds and the others wait, saying so, and a builder
that dies hands over at once; `make serve` and `make test` build it at install).

Also owns the process's CpuKernelChoice (servelm/config/cpu_kernel_choice.py): the engine build
sets it from EngineArgs.cpu_kernels with `configure()` before it builds the model, and each
part asks `mode(part)` or `ops_for_mode(part)` ('auto': the kernels where they build, else
torch; 'kernel': the kernels, or an error; 'torch'). Parts built once per engine (the attention
backend, the decode stack) also take the mode as an argument.

Never: fails a caller in 'auto' mode (a failed build is tried once per process and warned
about once), or imports torch before a kernel is asked for.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

from servelm.config.cpu_kernel_choice import MODES, PARTS, CpuKernelChoice, stale_env_vars

logger = logging.getLogger(__name__)

__all__ = ["MODES", "PARTS", "CpuKernelChoice", "configure", "current_choice", "load", "mode",
           "ops_for_mode"]
_DIR = Path(__file__).parent
_SOURCES = ("paged_attention.cpp", "layer_ops.cpp", "quant_gemm.cpp", "decode_stack.cpp",
            "det_gemm.cpp", "mla_attention.cpp", "quant_gemm_a8.cpp", "logit_rows.cpp",
            "amx_gemm.cpp", "prefill_attention.cpp", "dot_gemm.cpp", "kquant_gemm.cpp")
_HEADERS = ("vec16.h", "paged_tables.h", "tile_linear.h", "kquant_gemm.h")
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
PREBUILT_DIR = _DIR / "prebuilt"  # where a wheel carries its prebuilt levels (prebuilt.py)
_lock = threading.Lock()
_loaded = None  # torch.ops.servelm_cpu once built
_error: Exception | None = None
_source = ""
_warned = False
_choice = CpuKernelChoice()


def configure(choice: CpuKernelChoice) -> None:
    """Set the process's choice (the engine build does, from EngineArgs.cpu_kernels)."""
    global _choice
    _choice = choice
    stale = stale_env_vars()
    if stale:
        logger.warning("%s: no longer read; the engine option --cpu-kernels (EngineArgs."
                       "cpu_kernels, now %r) chooses the CPU kernel paths", ", ".join(stale),
                       str(choice))


def current_choice() -> CpuKernelChoice:
    return _choice


def mode(part: str) -> str:
    """'auto' | 'kernel' | 'torch' for a part ("attention", "decode", "layer_ops", "quant")."""
    return _choice.mode(part)


def ops_for_mode(part: str, chosen: str | None = None):
    """torch.ops.servelm_cpu, or None: for mode 'torch', or a failed build in mode 'auto'
    (warned once). Mode 'kernel' raises what the build raised. chosen: the part's mode when
    the caller was given one, else the process's."""
    chosen = mode(part) if chosen is None else chosen
    if chosen not in MODES:
        raise ValueError(f"cpu_kernels: {part}={chosen!r}: choose one of {MODES}")
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
            import torch

            _build()
            ops = torch.ops.servelm_cpu
            ops.paged_decode
            # bfloat16 decodes' q . k on vdpbf16ps only where the probe saw it run (isa.py)
            from servelm.cpu_kernels import isa

            ops.paged_decode_use_bf16_dot(isa.usable("avx512_bf16"))
            ops.paged_prefill_use(isa.usable("avx512_bf16"))  # the same instruction
            ops.dot_linear_use(isa.usable("avx512_bf16"))  # and dot_gemm.cpp's linears
            _loaded = ops
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
                   "instead (slower). --cpu-kernels torch skips the build.", last)


def _build() -> None:
    """Load this CPU's own build, else a prebuilt level this CPU runs (a wheel's), else build
    this CPU's (build.py: one builder at a time, progress while it runs)."""
    import torch

    global _source
    library, source = _find_or_build()
    torch.ops.load_library(str(library))
    _source = source  # only once loaded: a failed build leaves source() empty


def _find_or_build() -> tuple[Path, str]:
    """(the library to load, where it came from)."""
    import torch

    from servelm.cpu_kernels import build, prebuilt

    spec = native_spec()
    if spec.is_built:
        return spec.library, "built for this CPU"
    found = prebuilt.find(PREBUILT_DIR, _source_hash(), torch.__version__)
    if found is not None:
        return found[0], f"prebuilt ({found[1]})"
    return build.ensure_built(spec), "built for this CPU (this run)"


def native_spec():
    """The library built for this machine's CPU (-march=native) in $SERVELM_HOME."""
    from servelm.cpu_kernels.build import BuildSpec

    build_dir = _build_dir()
    return BuildSpec(build_dir.name, tuple(str(_DIR / s) for s in _SOURCES), tuple(_CFLAGS),
                     build_dir)


def source() -> str:
    """Where the loaded library came from (for the start-up log): built for this CPU, built
    for it by this process, or a prebuilt level; "" before a load."""
    return _source


def _build_dir() -> Path:
    from servelm.home import cache_home

    return cache_home() / "torch_extensions" / f"servelm_cpu_kernels_{_build_key()}"


def is_built() -> bool:
    """Whether this machine already has the library for these sources, torch and CPU (then
    `load()` only loads it; otherwise it compiles first, about a minute on the CI machine)."""
    return native_spec().is_built


def _build_key() -> str:
    """-march=native code runs only where it was built: a home shared by different machines
    must not hand one machine's build to another. The sources' directory is in the key too:
    ninja's command lines name the sources by path, so two checkouts sharing one home would
    otherwise rebuild each other's library on every load."""
    import torch

    h = hashlib.sha256(str(_DIR.resolve()).encode())
    h.update(_source_hash().encode())
    h.update(" ".join([torch.__version__, *_CFLAGS, _cpu_flags()]).encode())
    return h.hexdigest()[:16]


def _source_hash() -> str:
    """The sources' and headers' bytes: a prebuilt library is for exactly these."""
    h = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        h.update((_DIR / name).read_bytes())
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
