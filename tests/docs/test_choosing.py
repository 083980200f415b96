"""docs/choosing.md is what benchmarks/choosing.py makes of the records in
benchmarks/results/: every measured figure is from the newest record of its kind on its CPU
class, and every "what reverses the choice" is a crossover computed from a record's points."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ZEN5_FLAGS = ["avx", "avx2", "avx512_bf16", "avx512_vp2intersect", "avx512f", "avx_vnni"]
AMX_FLAGS = ["amx_bf16", "amx_int8", "amx_tile", "avx2", "avx512_bf16", "avx512f"]


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen():
    return _module("choosing")


@pytest.fixture(scope="module")
def records():
    return _module("choosing_records")


def _workload_rows(text: str, workload: str) -> dict[str, str]:
    """{CPU class: the row} for one workload of the by-workload table."""
    out = {}
    for line in text.splitlines():
        cells = line.split(" | ")
        if line.startswith(f"| {workload} | ") and len(cells) > 2:
            out[cells[1]] = line
    return out


def _copy(rec, results: Path, stamp: str, edit=None) -> str:
    """Write `rec`'s files under `results` with `stamp` in their names (its data passed
    through `edit`); the cited name of the copy."""
    for rel, data in zip(rec.paths, rec.data):
        data = copy.deepcopy(data)
        if edit is not None:
            edit(data)
        path = results / rel.replace(rec.stamp, stamp)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))
    return rec.name.replace(rec.stamp, stamp)


def _newest(gen, kind: str, cpu_class_part: str = ""):
    latest = gen.newest(gen.find_records(gen.RESULTS))
    return max((r for (k, _, c), r in latest.items() if k == kind and cpu_class_part in c),
               key=lambda r: r.stamp)


def test_doc_matches_the_generator(gen):
    assert (ROOT / "docs" / "choosing.md").read_text() == gen.render(), \
        "docs/choosing.md is stale: run .venv/bin/python benchmarks/choosing.py"
    assert gen.main(["--check"]) == 0


def test_the_doc_cites_the_newest_record_of_each_kind_and_class_and_no_older_one(gen):
    text = gen.render()
    every = gen.find_records(gen.RESULTS)
    latest = gen.newest(every)
    for (kind, _, cpu_class), rec in latest.items():
        assert f"`{rec.name}`" in text, f"the newest {kind} record on {cpu_class} is not cited"
    for rec in every:
        if latest[rec.kind, rec.variant, rec.cpu_class] != rec:
            assert f"`{rec.name}`" not in text, f"{rec.name} is older than its kind's newest"
    for who, what, url in gen.PUBLISHED:
        assert url.startswith("https://") and url in text


def test_best_vs_best_rows_match_their_summary(gen):
    text = gen.render()
    rec = _newest(gen, "best-vs-best", "Zen 5")
    single = next(e for e in rec.data[0]["ratios"] if e["workload"] == "single")
    row = _workload_rows(text, "single stream")[rec.cpu_class]
    assert rec.name in row and f"{single['servelm_value']:,.1f} decode tok/s" in row
    assert f"{single['peer_value']:,.1f}" in row


def _bump_best_vs_best(data):
    for system in data["systems"]:
        if system["key"] == "default":
            system["batch"]["output_tok_s"] = 4321.5


def _bump_lora(data):
    data["rows"][0]["output_tok_s"] = 4321.5  # the base model, no adapter


def _bump_offline(data):
    for row in data:
        if row["system"] == "servelm":
            row["output_tok_s"] = 4321.5


@pytest.mark.parametrize("kind, edit, shown", [
    ("best-vs-best", _bump_best_vs_best, "4,321.5 output tok/s"),
    ("lora", _bump_lora, "| no LoRA | - | 4,321.5 |"),
    ("offline-batch64", _bump_offline, "4,321.5 output tok/s"),
])
def test_a_newer_record_of_a_kind_replaces_the_older_one(gen, tmp_path, kind, edit, shown):
    rec = _newest(gen, kind)
    old = _copy(rec, tmp_path, rec.stamp)
    new = _copy(rec, tmp_path, "20991231T235959Z", edit)
    text = gen.render(tmp_path)
    assert f"`{new}`" in text and shown in text
    assert f"`{old}`" not in text
    assert shown not in gen.render(gen.RESULTS)


def test_a_newer_record_on_another_cpu_class_keeps_its_own_row(gen, tmp_path):
    rec = _newest(gen, "best-vs-best", "Zen 5")

    def to_amx(data):
        data["machine"].update(cpu="Intel(R) Xeon(R) Processor", cpu_flags=AMX_FLAGS)
        _bump_best_vs_best(data)

    old = _copy(rec, tmp_path, rec.stamp)
    new = _copy(rec, tmp_path, "20991231T235959Z", to_amx)
    rows = _workload_rows(gen.render(tmp_path), "batch (64 prompts)")
    assert rows.keys() == {rec.cpu_class, "Intel Xeon (AMX)"}
    assert old in rows[rec.cpu_class] and new not in rows[rec.cpu_class]
    assert new in rows["Intel Xeon (AMX)"] and "4,321.5" in rows["Intel Xeon (AMX)"]
    assert "4,321.5" not in rows[rec.cpu_class]


def test_an_empty_results_folder_renders_without_measured_rows(gen, tmp_path):
    text = gen.render(tmp_path)
    assert "| structured output | - | not measured here (no record) |" in text
    assert not _workload_rows(text, "single stream")


def test_check_fails_on_a_stale_doc(gen, tmp_path, monkeypatch):
    stale = tmp_path / "choosing.md"
    stale.write_text("old\n")
    monkeypatch.setattr(gen, "DOC", stale)
    assert gen.main(["--check"]) == 1


@pytest.mark.parametrize("cpu, flags, expected", [
    ("AMD EPYC", ZEN5_FLAGS, "AMD EPYC Zen 5 (AVX-512 BF16)"),
    ("AMD EPYC", ["avx2", "avx512_bf16", "avx512f"], "AMD EPYC Zen 4 (AVX-512 BF16)"),
    ("AMD EPYC", ["avx", "avx2", "fma"], "AMD EPYC Zen 3 or older (AVX2)"),
    ("Intel(R) Xeon(R) Processor", AMX_FLAGS, "Intel Xeon (AMX)"),
    ("Intel(R) Xeon(R) Processor", ["avx2", "avx512f"], "Intel Xeon (AVX-512)"),
    ("AMD EPYC", None, "AMD EPYC (ISA not recorded)"),
    ("Intel(R) Xeon(R) Processor", [], "Intel Xeon (ISA not recorded)"),
])
def test_cpu_class_comes_from_the_recorded_cpu_facts(records, cpu, flags, expected):
    assert records.cpu_class(cpu, flags) == expected


def test_crossings_finds_where_the_lead_changes_hands(records):
    xs = [1, 2, 4, 8]
    found = records.crossings(xs, {"a": [10, 9, 8, 7], "b": [5, 7, 9, 11]})
    assert found == [records.Crossing("a", "b", 2, 4)]
    # lower is better: the same numbers as times cross the other way
    assert records.crossings(xs, {"a": [10, 9, 8, 7], "b": [5, 7, 9, 11]}, False) == \
        [records.Crossing("b", "a", 2, 4)]
    # back and forth: every change of hands, in order
    assert records.crossings(xs, {"a": [2, 1, 2, 1], "b": [1, 2, 1, 2]}) == [
        records.Crossing("a", "b", 1, 2), records.Crossing("b", "a", 2, 4),
        records.Crossing("a", "b", 4, 8)]


def test_crossings_across_a_tie_or_a_gap_span_the_measured_points(records):
    # a tie is no lead: the crossing spans the tie and the next point where b leads
    assert records.crossings([1, 2, 4], {"a": [10, 10, 5], "b": [5, 10, 10]}) == \
        [records.Crossing("a", "b", 2, 4)]
    # an unmeasured point is skipped for its pair
    assert records.crossings([1, 2, 4], {"a": [10, None, 5], "b": [5, 7, 10]}) == \
        [records.Crossing("a", "b", 1, 4)]


def test_a_series_that_never_crosses_has_no_crossing_and_a_leader(records, gen):
    series = {"a": [10, 20, 40], "b": [5, 7, 9], "c": [1, 2, 3]}
    assert records.crossings([1, 8, 64], series) == []
    assert records.leader_throughout(series) == "a"
    assert gen.describe([1, 8, 64], series, "prompts") == \
        "no crossover measured over 1-64 prompts: a leads throughout"
    assert gen.describe([1], {"a": [1], "b": [2]}, "prompts") == \
        "no crossover measured (one point: 1 prompts)"
    assert gen.describe([1, 64], {"a": [10, 5], "b": [1, 9], "c": [2, 8]}, "prompts") == \
        "b and c overtake a between 1 and 64 prompts; b overtakes c between 1 and 64 prompts"


@pytest.mark.parametrize("xs, series, name", [
    ([4, 1], {"a": [1, 2]}, "xs"),
    ([1, 2], {"a": [1, 2, 3]}, "series"),
])
def test_crossings_rejects_bad_input_naming_the_parameter(records, xs, series, name):
    with pytest.raises(ValueError, match=name):
        records.crossings(xs, series)
