"""`servelm models pull NAME` and `servelm models list`.

Owns: the `models` sub-command's arguments and handlers; each handler returns an exit code.
Never: loads a model (no torch import); the work is in model_cache.
"""

from __future__ import annotations

import argparse
import sys

from servelm.loader import model_cache

__all__ = ["add_parser"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `models` (with `pull` and `list`) on the top-level sub-command parsers."""
    models = subparsers.add_parser("models", help="download and list registry models")
    models.set_defaults(func=lambda args: (models.print_help(), 2)[1])
    sub = models.add_subparsers(dest="models_command", metavar="{pull,list}")

    pull = sub.add_parser("pull", help="fetch a registry model into the local cache")
    pull.add_argument(
        "name", help=f"registry name, one of: {', '.join(sorted(model_cache.REGISTRY))}"
    )
    pull.add_argument("--quiet", action="store_true", help="no progress output")
    pull.set_defaults(func=_pull)

    listing = sub.add_parser("list", help="show registry models and whether they are cached")
    listing.set_defaults(func=_list)
    return models


def _pull(args: argparse.Namespace) -> int:
    try:
        path = model_cache.pull(args.name, progress=not args.quiet)
    except model_cache.ModelPullError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _list(args: argparse.Namespace) -> int:
    cached = {name: (path, size) for name, path, size in model_cache.list_cached()}
    print(f"cache: {model_cache.cache_home()}")
    for name in sorted(model_cache.REGISTRY):
        if name in cached:
            path, size = cached[name]
            print(f"{name}\t{size / 2**20:.1f} MiB\t{path}")
        else:
            print(f"{name}\tnot pulled\t(servelm models pull {name})")
    return 0
