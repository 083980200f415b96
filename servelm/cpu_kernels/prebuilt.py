"""Prebuilt kernel libraries: one per instruction-set level (build.LEVELS), made when a wheel is
built so that a machine without a compiler serves with servelm's kernels.

    servelm/cpu_kernels/prebuilt/
        manifest.json            {"torch": "2.13.0", "sources": "<hash>", "levels": [...]}
        avx2/servelm_cpu_kernels_avx2.so
        avx512_bf16/servelm_cpu_kernels_avx512_bf16.so
        ...

A library is used only for exactly the sources it was built from and the torch it was built
against (the C++ ABI of torch's ops), and only on a CPU that runs its level.

Owns: building the levels into a directory (`servelm kernels build --levels ... --out DIR`,
which setup.py runs for a wheel) and finding the one this process can load.
Never: builds for this CPU (build.ensure_built does), or loads a library.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from servelm.cpu_kernels import build

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def find(directory: Path, sources: str, torch_version: str, level: str | None = None
         ) -> tuple[Path, str] | None:
    """(library, level) for the newest level this CPU runs among those in `directory` built
    from `sources` against `torch_version`; None when there is none. level: this CPU's best
    level (default: asked of the CPU)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("sources") != sources or manifest.get("torch") != torch_version:
        logger.info("prebuilt kernels in %s are for other sources or torch %s; not used",
                    directory, manifest.get("torch"))
        return None
    if level is None:
        level = cpu_level()
    if level is None:
        return None
    order = list(build.LEVELS)
    runnable = [name for name in manifest.get("levels", [])
                if name in build.LEVELS and order.index(name) <= order.index(level)]
    for name in sorted(runnable, key=order.index, reverse=True):
        library = directory / name / f"{_name(name)}.so"
        if library.is_file():
            return library, name
    return None


def cpu_level() -> str | None:
    """This CPU's newest level (build.best_level over the probed instruction sets)."""
    from servelm.cpu_kernels import isa

    return build.best_level(isa.advertised(), isa.usable)


def build_levels(levels: list[str], out: Path, sources: tuple[str, ...], source_hash: str,
                 torch_version: str, work: Path) -> list[str]:
    """Build each level's library under `work` and copy it into `out` with the manifest;
    returns the levels built. A level the compiler cannot target fails the call."""
    unknown = [name for name in levels if name not in build.LEVELS]
    if unknown:
        raise ValueError(f"--levels: unknown level(s) {unknown}; levels: {list(build.LEVELS)}")
    out.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(levels, 1):
        spec = build.BuildSpec(_name(name), sources,
                               (*build.LEVELS[name].cflags, "-O3", "-fopenmp"),
                               work / f"{_name(name)}_{source_hash}")
        what = f"servelm's CPU kernels, level {name} ({i}/{len(levels)})"
        library = build.ensure_built(spec, what)
        (out / name).mkdir(exist_ok=True)
        shutil.copy2(library, out / name / library.name)
    (out / MANIFEST).write_text(json.dumps(
        {"torch": torch_version, "sources": source_hash, "levels": levels}, indent=1) + "\n")
    return levels


def _name(level: str) -> str:
    return f"servelm_cpu_kernels_{level}"
