"""The `servelm` command builds only the named command's parser (start-up speed), and the
map from command to module stays true."""

import argparse
import importlib
import subprocess
import sys

import pytest

from servelm.cli import _SUBCOMMANDS, build_parser


@pytest.mark.parametrize("command", sorted(_SUBCOMMANDS))
def test_each_module_registers_exactly_its_command(command):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    importlib.import_module(_SUBCOMMANDS[command]).add_parser(sub)
    assert list(sub.choices) == [command]


def test_full_parser_has_every_command_and_a_named_one_only_its_own():
    full = build_parser()
    choices = full._subparsers._group_actions[0].choices
    assert set(choices) == {"generate", "chat", *_SUBCOMMANDS}
    only = build_parser(["-v", "plan", "capacity"])._subparsers._group_actions[0].choices
    assert set(only) == {"generate", "chat", "plan"}
    args = build_parser(["serve", "--port", "9"]).parse_args(["serve", "--port", "9"])
    assert args.port == 9 and args.command == "serve"


def test_serve_parses_without_importing_the_http_stack_or_torch():
    code = ("import sys; from servelm.cli import build_parser; "
            "build_parser(['serve']).parse_args(['serve']); "
            "print(sorted(m for m in ('fastapi', 'torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_an_unknown_command_lists_them_all(capsys):
    with pytest.raises(SystemExit):
        build_parser(["nosuch"]).parse_args(["nosuch"])
    err = capsys.readouterr().err
    assert "invalid choice: 'nosuch'" in err and "'serve'" in err and "'doctor'" in err
