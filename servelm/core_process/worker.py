"""`python -m servelm.core_process.worker`: the process of one model-parallel rank (1..N-1).

Owns: the entry rank 0's process launcher starts (a WorkerStart frame on stdin) and the one a
user starts by hand or with torchrun (`--from-env MODEL [engine flags]`, docs/parallel.md),
handing the engine builder to the rank's main (servelm/parallel/worker.py), which builds this
rank's shard with it and serves rank 0's steps.
Never: does the rank's work itself, or is imported by the engine builder (rank 0's
build_engine names this module in the RankMain it starts the other ranks with).
"""

from __future__ import annotations

import sys

from servelm.parallel import worker


def build(args, parallel):
    """build_engine, imported only once the rank runs: the rank pins its cores first (torch
    sizes its thread pool when it is imported) and watches its parent from the start."""
    from servelm.engine_builder import build_engine

    return build_engine(args, parallel=parallel)


def main(argv: list[str] | None = None) -> int:
    return worker.main(argv, build)


if __name__ == "__main__":
    sys.exit(main())
