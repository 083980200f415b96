"""Result arithmetic and schema from hand-made timings; the side-by-side table."""

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from servelm.bench.offline import result_from_outputs, timings_from_outputs
from servelm.bench.results import (MemorySampler, RequestTiming, build_result, render_table,
                                   table_row)
from servelm.bench.workloads import Request

SCHEMA_KEYS = {"schema_version", "system", "model", "command", "machine", "commit",
               "num_requests", "num_input_tokens", "num_output_tokens", "elapsed_s",
               "output_tok_s", "total_tok_s", "ttft_s", "decode_tok_s", "peak_memory_bytes"}


def two_requests():
    # arrive at 10.0; first tokens at 10.5 and 11.0; 5 and 3 tokens
    return [RequestTiming(100, 5, 10.0, 10.5, 11.5, 11.5),
            RequestTiming(60, 3, 10.0, 11.0, 12.0, 12.0)]


def test_build_result_arithmetic():
    r = build_result(system="x", model="m", timings=two_requests(), elapsed_s=2.0,
                     peak_memory_bytes=123, command=["a", "b"], threads=2)
    assert SCHEMA_KEYS <= set(r)
    assert r["num_requests"] == 2
    assert r["num_input_tokens"] == 160
    assert r["num_output_tokens"] == 8
    assert r["output_tok_s"] == pytest.approx(4.0)
    assert r["total_tok_s"] == pytest.approx(84.0)
    assert r["ttft_s"]["mean"] == pytest.approx(0.75)
    assert r["ttft_s"]["p50"] == pytest.approx(0.75)
    # (5-1)/1.0 = 4 and (3-1)/1.0 = 2: mean per-stream decode speed 3
    assert r["decode_tok_s"] == pytest.approx(3.0)
    assert r["command"] == "a b"
    assert r["machine"]["threads"] == 2 and r["machine"]["cores"] == os.cpu_count()
    assert len(r["machine"]["load_avg"]) == 3 and min(r["machine"]["load_avg"]) >= 0
    assert r["peak_memory_bytes"] == 123


def test_single_stream_decode_is_tokens_after_the_first_over_their_span():
    t = RequestTiming(128, 128, 0.0, 0.2, 0.2 + 127 / 50.0)
    r = build_result(system="x", model="m", timings=[t], elapsed_s=2.74,
                     peak_memory_bytes=None)
    assert r["decode_tok_s"] == pytest.approx(50.0)
    assert r["ttft_s"] == {"mean": pytest.approx(0.2), "p50": pytest.approx(0.2)}


def test_p50_is_the_median_of_odd_and_even_counts():
    ts = [RequestTiming(1, 2, 0.0, f, f + 1) for f in (0.1, 0.3, 0.2, 0.9)]
    r = build_result(system="x", model="m", timings=ts, elapsed_s=1.0, peak_memory_bytes=None)
    assert r["ttft_s"]["p50"] == pytest.approx(0.25)
    r = build_result(system="x", model="m", timings=ts[:3], elapsed_s=1.0,
                     peak_memory_bytes=None)
    assert r["ttft_s"]["p50"] == pytest.approx(0.2)


def test_missing_timings_give_none_not_a_crash():
    t = RequestTiming(10, 1, 0.0, 0.5, 0.5)  # one token: no decode span
    r = build_result(system="x", model="m", timings=[t], elapsed_s=1.0, peak_memory_bytes=None)
    assert r["decode_tok_s"] is None
    t = RequestTiming(10, 0, 0.0, None, None)
    r = build_result(system="x", model="m", timings=[t], elapsed_s=1.0, peak_memory_bytes=None)
    assert r["ttft_s"] == {"mean": None, "p50": None}


@pytest.mark.parametrize("elapsed", [0.0, -1.0])
def test_build_result_rejects_bad_input(elapsed):
    with pytest.raises(ValueError, match="elapsed_s"):
        build_result(system="x", model="m", timings=two_requests(), elapsed_s=elapsed,
                     peak_memory_bytes=None)
    with pytest.raises(ValueError, match="timings"):
        build_result(system="x", model="m", timings=[], elapsed_s=1.0, peak_memory_bytes=None)


def fake_output(n_prompt, n_out, first, last):
    timings = SimpleNamespace(arrival_time=0.0, first_token_time=first, last_token_time=last,
                              finish_time=last, num_preemptions=1)
    return SimpleNamespace(prompt_token_ids=[1] * n_prompt,
                           outputs=[SimpleNamespace(token_ids=[7] * n_out)], timings=timings)


def test_servelm_outputs_to_result_use_t0_as_arrival():
    outs = [fake_output(10, 4, 5.5, 6.0), fake_output(20, 4, 5.5, 7.0)]
    reqs = [Request([1] * 10, 4), Request([1] * 20, 4)]
    ts = timings_from_outputs(outs, t0=5.0)
    assert [t.ttft_s for t in ts] == [pytest.approx(0.5), pytest.approx(0.5)]
    r = result_from_outputs(outs, 5.0, 2.0, model="m", requests=reqs, peak_memory_bytes=1)
    assert r["system"] == "servelm"
    assert r["output_tok_s"] == pytest.approx(4.0)
    assert r["decode_tok_s"] == pytest.approx((3 / 0.5 + 3 / 1.5) / 2)
    assert r["num_preemptions"] == 2
    assert "warning" not in r


def test_short_outputs_are_flagged():
    outs = [fake_output(10, 2, 5.5, 6.0)]
    r = result_from_outputs(outs, 5.0, 1.0, model="m", requests=[Request([1] * 10, 4)],
                            peak_memory_bytes=None)
    assert "expected 4" in r["warning"]


def test_table_renders_every_system_and_failures():
    ok = build_result(system="servelm", model="m", timings=two_requests(), elapsed_s=2.0,
                      peak_memory_bytes=3 * 2**20)
    bad = {"system": "vllm", "error": "exit 1: no CPU backend"}
    lines = render_table([ok, bad]).splitlines()
    assert lines[0].split()[:2] == ["system", "reqs"]
    row = lines[2].split()
    assert row[0] == "servelm"
    assert row[1:5] == ["2", "160", "8", "-"]  # no prefill count from a hand-made result
    assert row[6] == "4.0"  # output tok/s
    assert row[8] == "750.0"  # TTFT mean ms
    assert row[-1] == "3"  # peak MiB
    assert lines[3].startswith("vllm") and "FAILED: exit 1: no CPU backend" in lines[3]
    # columns line up: every header cell ends where its values end
    assert len(lines[0]) == len(lines[2])


def test_table_row_units():
    r = table_row({"ttft_s": {"mean": 0.25, "p50": None}, "peak_memory_bytes": 2**21})
    assert r["ttft_mean_ms"] == 250.0 and r["ttft_p50_ms"] is None
    assert r["peak_memory_mib"] == 2.0


def test_memory_sampler_sees_child_processes():
    # A peer like vLLM keeps its model in a child process: the tree must count it.
    code = "import time; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); " \
           "print(flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # the child has touched its 200 MiB
        with MemorySampler(interval_s=0.02) as mem:
            time.sleep(0.1)
        assert mem.peak_tree_bytes > 200 * 2**20
        assert mem.peak_bytes >= mem.peak_tree_bytes
    finally:
        child.kill()
        child.wait()


def test_results_module_loads_by_path_without_servelm_or_torch():
    path = Path(__file__).parents[2] / "servelm" / "bench" / "results.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('r', {str(path)!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['r'] = m\n"
        "spec.loader.exec_module(m)\n"
        "assert 'torch' not in sys.modules and 'servelm' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")
