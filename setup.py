"""setuptools' build (the metadata is in pyproject.toml), plus servelm's C++ CPU kernels built at
install, so that no first request pays for the build:

    pip install .        a wheel carrying the kernels prebuilt for this CPU's instruction-set
                         level (servelm/cpu_kernels/prebuilt.py), loaded at start-up
    pip install -e .     this CPU's own build in $SERVELM_HOME (`servelm kernels build`)
    make wheel           SERVELM_KERNEL_LEVELS=all: one library per level (AVX2, AVX-512,
                         AVX-512 BF16, AMX), so that a machine without a compiler serves with them

The kernels compile against the torch of the environment being installed into and must match
it at run time. pip builds in an isolated environment without torch, so the build runs in a
child of this interpreter with that isolation undone (its own site-packages, where the Makefile
installs the pinned torch first). Where that environment has no torch, or
SERVELM_KERNEL_LEVELS=none, nothing is built here and servelm builds for the CPU it runs on at
first use (about a minute, once, with progress). SERVELM_KERNEL_LEVELS also takes a list
(avx2,avx512).
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

_ISOLATION = ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")


def _levels() -> str:
    """'none', 'cpu' (this CPU's level: the default), 'all' or a comma-separated list."""
    return os.environ.get("SERVELM_KERNEL_LEVELS", "cpu")


def _target_env(code_dir: Path) -> dict | None:
    """The environment of a child that sees the installing interpreter's own site-packages
    (pip's build isolation undone) and this tree's servelm; None where it has no torch."""
    env = {k: v for k, v in os.environ.items() if k not in _ISOLATION}
    env["PYTHONPATH"] = str(code_dir.resolve())
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env,
                           capture_output=True)
    return env if probe.returncode == 0 else None


def _kernels(code_dir: Path, *args: str) -> bool:
    env = _target_env(code_dir)
    if env is None:
        print("servelm: no torch in the environment being installed into: the C++ kernels "
              "will build on first use (servelm kernels build does it ahead)")
        return False
    subprocess.run([sys.executable, "-m", "servelm.cli", "kernels", "build", *args],
                   check=True, env=env)
    return True


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        levels = _levels()
        if levels == "none":
            return
        if getattr(self, "editable_mode", False):  # the tree itself is the package
            _kernels(Path.cwd())
            return
        out = Path(self.build_lib) / "servelm" / "cpu_kernels" / "prebuilt"
        _kernels(Path(self.build_lib), "--levels", levels, "--out", str(out.resolve()))


class KernelWheel(bdist_wheel):
    """A wheel with prebuilt libraries is for one platform (x86-64 Linux), any Python 3: the
    libraries are torch ops, not Python extension modules."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = _levels() == "none"

    def get_tag(self):
        python, abi, platform = super().get_tag()
        return (python, abi, platform) if self.root_is_pure else ("py3", "none", platform)


setup(cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": KernelWheel})
