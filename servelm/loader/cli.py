"""`servelm models pull NAME` and `servelm models list`.

Owns: the `models` sub-command's arguments and handlers; each handler returns an exit code
and a failure is one line on stderr.
Never: loads a model (no torch import); the work is in model_cache (registry names) and
hub_cache (Hugging Face Hub names).
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from servelm.loader import model_cache

__all__ = ["add_parser"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `models` (with `pull` and `list`) on the top-level sub-command parsers."""
    models = subparsers.add_parser(
        "models", help="download and list registry and Hugging Face models")
    models.set_defaults(func=lambda args: (models.print_help(), 2)[1])
    sub = models.add_subparsers(dest="models_command", metavar="{pull,list}")

    pull = sub.add_parser(
        "pull", help="fetch a registry model, or a Hugging Face model's files servelm needs")
    pull.add_argument(
        "name", help=f"registry name ({', '.join(sorted(model_cache.REGISTRY))}) or Hugging Face "
                     "name ORG/NAME[:TAG][@REVISION], TAG a GGUF quantization (Q4_K_M) or "
                     "file name (into HF_HUB_CACHE; HF_TOKEN for gated models)"
    )
    pull.add_argument("--quiet", action="store_true", help="no progress output")
    pull.set_defaults(func=_pull)

    listing = sub.add_parser(
        "list", help="show registry models and whether they are cached, and the Hugging Face "
                     "models in its cache that servelm can serve")
    listing.set_defaults(func=_list)
    return models


def _pull(args: argparse.Namespace) -> int:
    from servelm.loader import hub_ref

    try:
        if args.name not in model_cache.REGISTRY and hub_ref.looks_like_hub_name(args.name):
            path = _pull_hub(args.name, args.quiet)
        else:
            path = model_cache.pull(args.name, progress=not args.quiet)
    except (model_cache.ModelPullError, hub_ref.HubModelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _pull_hub(name: str, quiet: bool):
    from servelm.loader import hub_cache, hub_ref

    bars = contextlib.nullcontext()
    if quiet:  # huggingface_hub's own switch for its progress bars
        from huggingface_hub.utils import disable_progress_bars

        bars = disable_progress_bars()
    with bars:
        return hub_cache.fetch(hub_ref.parse_hub_name(name), name).path


def _list(args: argparse.Namespace) -> int:
    cached = {name: (path, size) for name, path, size in model_cache.list_cached()}
    print(f"cache: {model_cache.cache_home()}")
    for name in sorted(model_cache.REGISTRY):
        if name in cached:
            path, size = cached[name]
            print(f"{name}\t{size / 2**20:.1f} MiB\t{path}")
        else:
            print(f"{name}\tnot pulled\t(servelm models pull {name})")
    from servelm.loader import hub_cache

    hub_models = hub_cache.list_cached_hub_models()
    print(f"hugging face cache: {hub_cache.hub_cache_dir()}")
    for name, path, size in hub_models:
        print(f"{name}\t{size / 2**20:.1f} MiB\t{path}")
    if not hub_models:
        print("(none servelm can serve; servelm models pull ORG/NAME[:TAG][@REVISION])")
    return 0
