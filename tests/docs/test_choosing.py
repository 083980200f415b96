"""docs/choosing.md is what benchmarks/choosing.py makes of the records in
benchmarks/results/ (so every measured figure in it is a recorded one)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("choosing", ROOT / "benchmarks" / "choosing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_doc_matches_the_generator():
    gen = _generator()
    assert (ROOT / "docs" / "choosing.md").read_text() == gen.render(), \
        "docs/choosing.md is stale: run .venv/bin/python benchmarks/choosing.py"
    assert gen.main(["--check"]) == 0


def test_measured_figures_come_from_the_records():
    gen = _generator()
    text = gen.render()
    record = gen._latest("offline-batch64-2*.json")
    rows = json.loads(record.read_text())
    assert record.name in text
    for r in rows:
        assert f"| {gen.NAMES[r['system']]} | {r['output_tok_s']:,.1f} |" in text
    for who, what, url in gen.PUBLISHED:
        assert url.startswith("https://") and url in text


def test_check_fails_on_a_stale_doc(tmp_path, monkeypatch):
    gen = _generator()
    stale = tmp_path / "choosing.md"
    stale.write_text("old\n")
    monkeypatch.setattr(gen, "DOC", stale)
    assert gen.main(["--check"]) == 1
