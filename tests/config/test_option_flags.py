"""The flag builder (config/flags.py add_option_flags) on made-up config dataclasses: what
`servelm serve`'s own flags need beyond the engine's (a --x/--no-x pair, a help or choices
made when the parser is, a parser that reads one value into a tuple, fields no flag sets,
several classes sharing a group)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from servelm.config.flags import add_option_flags, options_from_cli
from servelm.config.option import no_flag, option

MADE = []


def _choices() -> list[str]:
    MADE.append("choices")
    return ["a", "b"]


def _help() -> str:
    MADE.append("help")
    return "made when the parser is"


@dataclasses.dataclass(frozen=True)
class Server:
    logs: bool = option(True, "log lines", group="server", negatable=True)
    hosts: tuple[str, ...] = option((), "comma list", group="server", parse="host_list")
    mode: str = option("a", _help, group="server", choices=_choices)
    internal: int = no_flag(3)


@dataclasses.dataclass(frozen=True)
class Layout:
    replicas: int = option(1, "replicas", group="server")
    region: str | None = option(None, "where", group="far", metavar="R")


GROUPS = {"server": "server", "far": "far away"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_option_flags(parser, (Server, Layout), GROUPS)
    return parser


def test_defaults_and_values_reach_the_configs():
    parser = _parser()
    args = parser.parse_args([])
    assert vars(args) == {"logs": True, "hosts": (), "mode": "a", "replicas": 1,
                          "region": None}
    assert options_from_cli(Server, args) == Server()
    args = parser.parse_args(["--no-logs", "--hosts", "X.org, y.com", "--mode", "b",
                              "--replicas", "4", "--region", "eu"])
    assert options_from_cli(Server, args, internal=7) == Server(False, ("x.org", "y.com"),
                                                                "b", 7)
    assert options_from_cli(Layout, args) == Layout(4, "eu")
    assert parser.parse_args(["--logs"]).logs is True


def test_a_callable_help_and_choices_are_made_with_the_parser(capsys):
    MADE.clear()
    parser = _parser()
    assert MADE == ["help", "choices"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "c"])
    assert "invalid choice: 'c'" in capsys.readouterr().err
    assert "made when the parser is" in " ".join(parser.format_help().split())


def test_classes_share_a_group_in_their_order():
    parser = _parser()
    titles = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    assert titles["server"] == ["logs", "hosts", "mode", "replicas"]
    assert titles["far away"] == ["region"]


def test_a_group_not_given_is_an_error_naming_the_class():
    with pytest.raises(TypeError, match="Layout: far"):
        add_option_flags(argparse.ArgumentParser(), (Layout,), {"server": "server"})


def test_a_field_without_option_or_no_flag_is_refused_by_name():
    @dataclasses.dataclass(frozen=True)
    class Loose:
        port: int = 8000

    with pytest.raises(TypeError, match="Loose.port has no flag"):
        add_option_flags(argparse.ArgumentParser(), (Loose,), GROUPS)
