"""setuptools' build (the metadata is in pyproject.toml), plus the prebuilt C++ kernel libraries
that a wheel carries: one per instruction-set level (servelm/cpu_kernels/prebuilt.py), so that a
machine without a compiler serves with servelm's kernels.

    make wheel        (python -m build --wheel --no-isolation, with the venv's pinned torch)

The libraries need torch's headers and must match the torch they run with, so they are built
only where torch is importable (a build without isolation); an isolated build, or
SERVELM_KERNEL_LEVELS=none, makes a wheel without them, and servelm then builds for the CPU it
runs on (about a minute, once). SERVELM_KERNEL_LEVELS=avx2,avx512 builds a subset. An editable
install (`pip install -e .`, what `make serve` does) builds none: `servelm kernels build`
builds this CPU's library instead.
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py


def _levels() -> str | None:
    """The levels to prebuild ('all' or a list), or None: none asked for, or no torch here."""
    levels = os.environ.get("SERVELM_KERNEL_LEVELS", "all")
    if levels == "none":
        return None
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    return levels


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        levels = _levels()
        if getattr(self, "editable_mode", False):
            return
        if levels is None:
            print("servelm: no prebuilt kernels in this wheel (SERVELM_KERNEL_LEVELS=none, or "
                  "torch not importable here: build with --no-isolation to include them)")
            return
        out = Path(self.build_lib) / "servelm" / "cpu_kernels" / "prebuilt"
        env = dict(os.environ, PYTHONPATH=str(Path(self.build_lib).resolve()))
        subprocess.run([sys.executable, "-m", "servelm.cli", "kernels", "build",
                        "--levels", levels, "--out", str(out)], check=True, env=env)


class KernelWheel(bdist_wheel):
    """A wheel with prebuilt libraries is for one platform (x86-64 Linux), any Python 3: the
    libraries are torch ops, not Python extension modules."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = _levels() is None

    def get_tag(self):
        python, abi, platform = super().get_tag()
        return ("py3", "none", platform) if not self.root_is_pure else (python, abi, platform)


setup(cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": KernelWheel})
