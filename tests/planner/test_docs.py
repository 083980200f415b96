"""docs/planner.md pastes real output: every `$ servelm plan ...` block must still match."""

import contextlib
import io
import pathlib
import re

import pytest

from servelm.planner import cli

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "planner.md"
BLOCK = re.compile(r"```\n\$ servelm (plan [^\n]+)\n(.*?)\n```", re.S)


def _blocks():
    return BLOCK.findall(DOC.read_text()) if DOC.exists() else []


def test_doc_has_the_five_worked_questions():
    commands = [cmd.split()[1] for cmd, _ in _blocks()]
    for needed in ("capacity", "kv", "prefill", "spec", "disagg"):
        assert needed in commands


@pytest.mark.parametrize("command,expected", _blocks(), ids=lambda v: str(v)[:40])
def test_pasted_output_is_current(command, expected):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(command.split()) == 0
    assert buf.getvalue().rstrip() == expected.rstrip()
