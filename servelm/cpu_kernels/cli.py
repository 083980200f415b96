"""`servelm kernels`: build servelm's C++ CPU kernels ahead of the first request, or see which
library a process would load.

  servelm kernels build                      this CPU's library (-march=native), once a machine
  servelm kernels build --levels all --out DIR   one library per instruction-set level (a wheel's;
                                                 --levels cpu: this CPU's level alone)
  servelm kernels status                     the CPU's instruction sets, its level, what loads

Owns: the command line over build.py and prebuilt.py. Never: loads the library to build it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def add_parser(subparsers) -> argparse.ArgumentParser:
    from servelm.cpu_kernels.build import LEVELS

    p = subparsers.add_parser(
        "kernels", help="build servelm's C++ CPU kernels now (else the first start builds "
        "them), or show which library would load")
    sub = p.add_subparsers(dest="kernels_command", required=True)
    b = sub.add_parser("build", help="build the kernels for this CPU, or for --levels")
    b.add_argument("--levels", default=None,
                   help=f"comma-separated levels ({', '.join(LEVELS)}), 'all', or 'cpu' "
                        "(this CPU's): prebuilt libraries for CPUs with those instruction "
                        "sets (needs --out)")
    b.add_argument("--out", default=None, help="where --levels puts the libraries and manifest")
    b.set_defaults(func=cmd_build)
    s = sub.add_parser("status", help="instruction sets, level, and the library that loads")
    s.set_defaults(func=cmd_status)
    return p


def cmd_build(args) -> int:
    from servelm import cpu_kernels
    from servelm.cpu_kernels import build

    if args.levels is None:
        if args.out is not None:
            print("servelm: error: --out goes with --levels", file=sys.stderr)
            return 2
        library = build.ensure_built(cpu_kernels.native_spec())
        print(f"servelm's CPU kernels for this CPU: {library}")
        return 0
    if args.out is None:
        print("servelm: error: --levels needs --out DIR", file=sys.stderr)
        return 2
    import torch

    from servelm.cpu_kernels import prebuilt

    levels = _levels(args.levels)
    if not levels:
        print("servelm: error: --levels cpu: this CPU runs none of the levels "
              f"({', '.join(build.LEVELS)})", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="servelm-kernels-") as work:
        try:
            built = prebuilt.build_levels(levels, Path(args.out),
                                          cpu_kernels.native_spec().sources,
                                          cpu_kernels._source_hash(), torch.__version__,
                                          Path(work))
        except ValueError as e:
            print(f"servelm: error: {e}", file=sys.stderr)
            return 2
    print(f"prebuilt levels {', '.join(built)} in {args.out}")
    return 0


def _levels(text: str) -> list[str]:
    """'all', 'cpu' (this CPU's newest level) or a comma-separated list."""
    from servelm.cpu_kernels import build, prebuilt

    if text == "all":
        return list(build.LEVELS)
    if text == "cpu":
        return [level] if (level := prebuilt.cpu_level()) else []
    return [x.strip() for x in text.split(",") if x.strip()]


def cmd_status(args) -> int:
    import torch

    from servelm import cpu_kernels
    from servelm.cpu_kernels import isa, prebuilt

    spec = cpu_kernels.native_spec()
    found = prebuilt.find(cpu_kernels.PREBUILT_DIR, cpu_kernels._source_hash(),
                          torch.__version__)
    print(f"instruction sets: {isa.describe()}")
    print(f"level: {prebuilt.cpu_level() or 'below avx2 (no prebuilt level runs)'}")
    print(f"built for this CPU: {'yes' if spec.is_built else 'no'} ({spec.library})")
    print("prebuilt: " + (f"{found[1]} ({found[0]})" if found else "none for this CPU"))
    loads = ("this CPU's build" if spec.is_built else f"prebuilt {found[1]}" if found
             else "nothing yet: the first start builds (about a minute)")
    print(f"a start loads: {loads}")
    return 0
