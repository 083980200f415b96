"""The reference a replica's options are checked against: what a replica received when its
parent edited its own command line (the parent's flags cut out, the replica's added), so a
replica handed its options by value is shown to run with exactly the same options."""

from __future__ import annotations

import io
import sys

from servelm.router.data_parallel import PARENT_OPTIONS

PARENT_FLAGS = {"--" + name.replace("_", "-") for name in PARENT_OPTIONS}


def parse(argv: list[str]):
    from servelm.cli import build_parser

    return build_parser(["serve"]).parse_args(["serve", *argv])


def strip_flags(argv: list[str], flags: set[str]) -> list[str]:
    """`argv` without the value-taking `flags` (as `--flag value` or `--flag=value`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def edited(argv: list[str]) -> dict:
    """The options `serve` makes of a command line."""
    return vars(parse(argv))


def received(options: dict, monkeypatch) -> dict:
    """The options a replica's `serve MODEL --options-from-stdin` runs with, handed
    `options` as JSON on its stdin."""
    import json

    from servelm.serve.cli import options_from_stdin

    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(options)))
    return vars(options_from_stdin(parse([options["model"], "--options-from-stdin"])))
