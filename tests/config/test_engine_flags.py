"""The engine's flags against EngineArgs: one flag per field and one field per flag, each
flag with its help, and `servelm serve --help` listing them all; the flags are built from
the fields (config/flags.py), so these also check that builder."""

from __future__ import annotations

import argparse
import collections
import dataclasses

import pytest

from servelm.cli import build_parser
from servelm.config import EngineArgs, add_engine_cli_args, engine_args_from_cli

# Each command adds MODEL itself, as a positional argument with its own default.
POSITIONAL = {"model"}


def _engine_actions() -> list[argparse.Action]:
    parser = argparse.ArgumentParser()
    add_engine_cli_args(parser)
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def _fields() -> set[str]:
    return {f.name for f in dataclasses.fields(EngineArgs)}


def test_every_engine_args_field_has_a_flag():
    dests = {a.dest for a in _engine_actions()}
    assert _fields() - POSITIONAL - dests == set()


def test_every_engine_flag_sets_an_engine_args_field():
    assert {a.dest for a in _engine_actions()} - _fields() == set()


def test_no_field_has_two_flags():
    counts = collections.Counter(a.dest for a in _engine_actions())
    assert [dest for dest, n in counts.items() if n > 1] == []


def test_every_engine_flag_has_help():
    assert [a.option_strings[0] for a in _engine_actions() if not a.help] == []


def test_num_blocks_flag_reaches_the_engine_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    add_engine_cli_args(parser)
    assert engine_args_from_cli(parser.parse_args(["m", "--num-blocks", "48"])).num_blocks == 48
    assert engine_args_from_cli(parser.parse_args(["m"])).num_blocks is None


def _help_start(text: str) -> str:
    """The first words of a help text as argparse prints it (before any %(default)s)."""
    words = " ".join(text.split("%")[0].split())
    return words[:24].rsplit(" ", 1)[0] if len(words) > 24 else words


def test_serve_help_lists_every_engine_flag_with_its_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser(["serve", "--help"]).parse_args(["serve", "--help"])
    assert exit_.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    missing = [a.option_strings[0] for a in _engine_actions()
               if any(s not in shown for s in a.option_strings)
               or _help_start(a.help) not in shown]
    assert missing == []


def test_a_field_without_a_flag_is_refused_by_name():
    from servelm.config.option import option

    @dataclasses.dataclass(frozen=True)
    class Args:
        model: str
        block_size: int = option(16, "tokens per block")
        hidden: int = 3  # declared without option(): no flag, no help

    with pytest.raises(TypeError, match="Args.hidden has no flag"):
        add_engine_cli_args(argparse.ArgumentParser(), Args)


def test_flags_come_from_the_fields_names_types_and_defaults():
    from servelm.config.option import option

    @dataclasses.dataclass(frozen=True)
    class Args:
        model: str
        max_rows: int = option(8, "rows")
        share: float = option(0.5, "share", group="parallel")
        fast: bool = option(True, "off switch", names=("--no-fast",))
        tags: tuple[str, ...] = option((), "repeatable", names=("--tag",), group="lora")

    parser = argparse.ArgumentParser()
    add_engine_cli_args(parser, Args)
    assert vars(parser.parse_args([])) == {"max_rows": 8, "share": 0.5, "fast": True,
                                           "tags": None}
    got = parser.parse_args(["--max-rows", "3", "--share", "0.25", "--no-fast", "--tag", "a",
                             "--tag", "b"])
    assert vars(got) == {"max_rows": 3, "share": 0.25, "fast": False, "tags": ["a", "b"]}


def test_an_option_that_is_on_must_name_its_off_flag():
    from servelm.config.option import option

    @dataclasses.dataclass(frozen=True)
    class Args:
        fast: bool = option(True, "on by default")

    with pytest.raises(TypeError, match="--no-"):
        add_engine_cli_args(argparse.ArgumentParser(), Args)
