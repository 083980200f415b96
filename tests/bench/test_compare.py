"""`servelm bench compare`: real `bench serve` results of two fake servers (one that serves a
request at a time, one that batches everything) side by side: grouping by --label, the
document-batch ratio, the table, JSON and PNG; and the errors that name the file."""

import json

import pytest

from servelm.bench.cli import main
from servelm.bench.fake_server import FakeBehaviour, FakeServer

# Rates far apart and a loose TTFT SLO, so that a busy machine's jitter cannot move a rate
# across the goodput target: at 2 req/s the serial server is idle most of the time; at 40
# req/s 10 requests of ~0.07 s arrive within 0.25 s and the last ones wait ~0.4 s.
SWEEP = ["--sweep-rates", "2,40", "--num-prompts", "10", "--warmup", "0", "--output-len", "6",
         "--input-len", "8:16", "--slo-ttft-ms", "300", "--slo-tpot-ms", "50", "--no-progress"]
DOCS = ["--workload", "documents", "--num-prompts", "8", "--input-len", "8:16",
        "--output-len", "5", "--warmup", "0", "--no-progress"]


def _bench(server, label, flags, out):
    assert main(["serve", "--base-url", server.url, "--model", "fake", "--label", label,
                 "--vocab-size", "1000", *flags, "--out", str(out)]) == 0
    return str(out)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Per system: a sweep, the documents all at once and one after another."""
    tmp = tmp_path_factory.mktemp("compare")
    files = []
    # "serial" serves one request at a time (like llama-cpp-python's server): 40 req/s of
    # ~0.07 s requests queue up; "batching" serves all at once.
    for label, capacity in (("serial", 1), ("batching", 1000)):
        with FakeServer(FakeBehaviour(ttft_s=0.02, tpot_s=0.01, capacity=capacity)) as s:
            files.append(_bench(s, label, SWEEP, tmp / f"sweep-{label}.json"))
            files.append(_bench(s, label, DOCS, tmp / f"docs-batch-{label}.json"))
            files.append(_bench(s, label, DOCS + ["--concurrency", "1"],
                                tmp / f"docs-seq-{label}.json"))
    return tmp, files


def test_compare_groups_by_label_and_times_the_document_batch(results, capsys):
    tmp, files = results
    out = tmp / "record.json"
    assert main(["compare", *files, "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["kind"] == "serve_compare" and res["sources"] == files
    assert "machine" in res and "commit" in res and res["command"].startswith(
        "servelm bench compare")
    assert res["slo"] == {"ttft_ms": 300, "tpot_ms": 50} and res["goodput_target"] == 0.9
    assert res["warnings"] == []
    systems = {e["system"]: e for e in res["systems"]}
    assert list(systems) == ["serial", "batching"]
    for label, e in systems.items():
        sweep = json.loads((tmp / f"sweep-{label}.json").read_text())
        assert e["sweep"]["summary"] == sweep["summary"]
        assert e["sweep"]["max_rate_meeting_target"] == sweep["summary"][
            "max_rate_meeting_target"]
        batch = json.loads((tmp / f"docs-batch-{label}.json").read_text())
        seq = json.loads((tmp / f"docs-seq-{label}.json").read_text())
        d = e["documents"]
        assert d["batch"]["elapsed_s"] == batch["elapsed_s"]
        assert d["sequential"]["elapsed_s"] == seq["elapsed_s"]
        assert d["speedup"] == pytest.approx(seq["elapsed_s"] / batch["elapsed_s"])
        assert d["batch"]["num_completed"] == d["sequential"]["num_completed"] == 8
    # One at a time, sending everything at once buys nothing; batching 8 requests of
    # ~0.06 s each finishes them together (the band is wide: on 2 busy cores a run of
    # 0.5 s jitters).
    assert systems["serial"]["documents"]["speedup"] == pytest.approx(1.0, abs=0.5)
    assert systems["batching"]["documents"]["speedup"] > 3
    # At 40 req/s the serial server queues (TTFT past 300 ms); the batching one keeps up.
    assert systems["serial"]["sweep"]["first_rate_below_target"] == 40
    assert systems["batching"]["sweep"]["max_rate_meeting_target"] == 40
    png = out.with_suffix(".png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    table = capsys.readouterr().out
    assert "== serial: rate sweep" in table and "== batching: rate sweep" in table
    assert f"{systems['batching']['documents']['speedup']:.2f}x" in table


def test_different_workloads_are_compared_with_a_warning(results, tmp_path, capsys):
    tmp, files = results
    with FakeServer(FakeBehaviour(ttft_s=0.01, tpot_s=0.005)) as s:
        other = _bench(s, "other", [a if a != "6" else "7" for a in SWEEP],
                       tmp_path / "sweep-other.json")
    assert main(["compare", files[0], other, "--out", str(tmp_path / "c.json")]) == 0
    res = json.loads((tmp_path / "c.json").read_text())
    assert len(res["warnings"]) == 1 and "sweep-other.json" in res["warnings"][0]
    assert "warning:" in capsys.readouterr().out


def test_bad_inputs_exit_2_naming_the_file(results, tmp_path, capsys):
    tmp, files = results
    not_json = tmp_path / "x.json"
    not_json.write_text("{")
    offline = tmp_path / "offline.json"
    offline.write_text(json.dumps([{"system": "servelm"}]))
    random_run = tmp_path / "random.json"
    with FakeServer() as s:
        _bench(s, "r", ["--request-rate", "50", "--num-prompts", "2", "--warmup", "0",
                        "--output-len", "2", "--no-progress"], random_run)
    cases = [([str(tmp_path / "missing.json")], "missing.json: cannot read"),
             ([str(not_json)], "x.json: not JSON"),
             ([str(offline)], "offline.json: not a `servelm bench serve` result"),
             ([str(random_run)], "random.json: a single run of the 'random' workload"),
             ([files[0], files[0]], "a second sweep for 'serial'"),
             ([files[1], files[1]], "a second documents batch run for 'serial'")]
    for argv, message in cases:
        assert main(["compare", *argv, "--out", str(tmp_path / "c.json")]) == 2
        err = capsys.readouterr().err
        assert "servelm bench compare: error:" in err and message in err, (argv, err)
