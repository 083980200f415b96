"""Percentiles, TPOT, goodput and the sweep's knee on hand-made timings (no server)."""

import math

import pytest

from servelm.bench.metrics import (RequestRecord, build_serve_result, goodput, meets_slo,
                                   render_serve_table, summarize)
from servelm.bench.sweep import find_knee, goodput_crossing, goodput_threshold, summarize_sweep


def rec(ttft, e2e, n_out, *, sent=10.0, chunks=None, error=None, n_in=5, max_tokens=None):
    r = RequestRecord(n_in, max_tokens if max_tokens is not None else n_out,
                      scheduled_time=sent, sent_time=sent)
    if error:
        r.error = error
        return r
    r.first_token_time = sent + ttft
    r.end_time = sent + e2e
    r.num_output_tokens = n_out
    r.has_usage = True
    r.chunk_times = [sent + c for c in (chunks or [ttft])]
    return r


def test_summary_percentiles_interpolate_like_numpy():
    s = summarize([4.0, 1.0, 3.0, 2.0])
    assert s["n"] == 4 and s["mean"] == 2.5 and s["max"] == 4.0
    assert s["p50"] == pytest.approx(2.5)
    assert s["p90"] == pytest.approx(3.7)  # 1 + 0.9 * 3 = 3.7 (position 2.7)
    assert s["p95"] == pytest.approx(3.85)
    assert s["p99"] == pytest.approx(3.97)
    hundred = summarize(range(1, 101), scale=1e3)
    assert hundred["p50"] == pytest.approx(50.5e3) and hundred["p99"] == pytest.approx(99.01e3)


def test_summary_of_nothing_is_none_and_one_value_is_itself():
    assert summarize([])["p99"] is None and summarize([])["n"] == 0
    one = summarize([0.25], scale=1e3)
    assert one["p50"] == one["p99"] == one["mean"] == 250.0


def test_ttft_tpot_itl_e2e_of_one_request():
    r = rec(0.5, 2.5, 5, chunks=[0.5, 1.0, 1.5, 2.0, 2.4])
    assert r.ttft_s == pytest.approx(0.5) and r.e2e_s == pytest.approx(2.5)
    assert r.tpot_s == pytest.approx((2.5 - 0.5) / 4)
    assert r.itls_s == pytest.approx([0.5, 0.5, 0.5, 0.4])
    assert rec(0.5, 0.6, 1).tpot_s is None  # one token: no time per output token


def test_goodput_counts_failures_against_it():
    slo_ttft, slo_tpot = 1.0, 0.1
    good = rec(0.5, 0.5 + 9 * 0.08, 10)
    slow_first = rec(1.5, 1.5 + 9 * 0.08, 10)
    slow_decode = rec(0.5, 0.5 + 9 * 0.2, 10)
    failed = rec(0, 0, 0, error="http_500")
    one_token = rec(0.2, 0.2, 1)  # meets TPOT by definition
    records = [good, slow_first, slow_decode, failed, one_token]
    assert [meets_slo(r, slo_ttft, slo_tpot) for r in records] == [True, False, False, False,
                                                                    True]
    assert goodput(records, slo_ttft, slo_tpot) == pytest.approx(2 / 5)
    assert goodput(records, None, None) == pytest.approx(4 / 5)  # only the failure misses
    assert goodput([], 1.0, 1.0) == 0.0
    # The boundary is inclusive.
    assert meets_slo(rec(1.0, 1.0 + 0.1 * 4, 5), 1.0, 0.1 + 1e-12)


def test_build_serve_result_arithmetic():
    records = [rec(0.5, 1.5, 11, n_in=100), rec(0.3, 0.8, 6, n_in=50),
               rec(0, 0, 0, error="timeout"), rec(0, 0, 0, error="http_429"),
               rec(0, 0, 0, error="http_429")]
    records[0].usage_prompt_tokens = 101  # the server's count wins over the workload's
    res = build_serve_result(records, 2.0, slo_ttft_s=0.4, slo_tpot_s=0.5,
                             loop_lag_s=[0.001, 0.003])
    assert res["num_requests"] == 5 and res["num_completed"] == 2 and res["num_failed"] == 3
    assert res["failures"] == {"http_429": 2, "timeout": 1}
    assert res["num_input_tokens"] == 151 and res["num_output_tokens"] == 17
    assert res["request_throughput"] == pytest.approx(1.0)
    assert res["output_tok_s"] == pytest.approx(8.5)
    assert res["total_tok_s"] == pytest.approx((151 + 17) / 2)
    assert res["ttft_ms"]["p50"] == pytest.approx(400.0)
    assert res["tpot_ms"]["mean"] == pytest.approx((100.0 + 100.0) / 2)
    assert res["num_good"] == 1 and res["goodput"] == pytest.approx(0.2)
    assert res["goodput_req_s"] == pytest.approx(0.5)
    assert res["client"]["loop_lag_ms"]["max"] == pytest.approx(3.0)
    table = render_serve_table(res)
    assert "2/5 completed" in table and "http_429=2" in table and "20.0%" in table
    with pytest.raises(ValueError):
        build_serve_result(records, 0.0, slo_ttft_s=None, slo_tpot_s=None)


def test_knee_is_the_last_point_before_latency_doubles():
    assert find_knee([100, 105, 110, 130, 400, 2000]) == 3
    # Noise below the doubling is not a knee, whatever its shape; the baseline is the lowest
    # latency at lower rates, so a slow first point does not hide a later jump.
    assert find_knee([412, 185, 257, 460, 303]) == 2
    assert find_knee([300, 310, 290, 330, 300, 305]) is None  # flat: sweep higher
    assert find_knee([100, 250]) == 0  # already past the knee at the second rate
    assert find_knee([None, 100, 150, 210]) == 2
    assert find_knee([]) is None


def test_goodput_threshold_finds_the_last_rate_meeting_the_target():
    assert goodput_threshold([1, 2, 4, 8], [1.0, 0.95, 0.7, 0.1], 0.9) == (2, 4)
    assert goodput_threshold([4, 1, 2], [0.99, 1.0, 0.97], 0.9) == (4, None)
    assert goodput_threshold([1, 2], [0.5, 0.1], 0.9) == (None, 1)


def test_goodput_crossing_interpolates_between_the_bracketing_rates():
    # 0.95 at 2, 0.7 at 4: 0.9 is a fifth of the way down, at 2.4.
    assert goodput_crossing([1, 2, 4, 8], [1.0, 0.95, 0.7, 0.1], 0.9) == pytest.approx(2.4)
    # Unsorted input; exactly on the target at the lower rate.
    assert goodput_crossing([4, 1, 2], [0.5, 1.0, 0.9], 0.9) == pytest.approx(2.0)
    # The first crossing counts, not a later recovery.
    assert goodput_crossing([1, 2, 3, 4], [1.0, 0.8, 0.95, 0.5], 0.9) == pytest.approx(1.5)
    assert goodput_crossing([4, 1, 2], [0.99, 1.0, 0.97], 0.9) is None
    assert goodput_crossing([1, 2], [0.5, 0.1], 0.9) is None


def test_summarize_sweep_uses_the_runs_in_rate_order():
    def run(rate, tok_s, p99, g):
        lat = {"p50": p99 / 2, "p99": p99}
        return {"load": {"request_rate": rate}, "request_throughput": rate,
                "output_tok_s": tok_s, "goodput": g, "ttft_ms": lat, "tpot_ms": lat}

    runs = [run(8, 38, 130, 0.85), run(1, 10, 100, 1.0), run(2, 20, 105, 0.98),
            run(4, 30, 110, 0.95), run(16, 40, 400, 0.3), run(32, 41, 2000, 0.0),
            {"error": "boom"}]
    s = summarize_sweep(runs, 0.9)
    assert s["rates"] == [1, 2, 4, 8, 16, 32]
    assert s["knee"]["request_rate"] == 8 and s["knee"]["metric"] == "p50 TTFT"
    assert (s["max_rate_meeting_target"], s["first_rate_below_target"]) == (4, 8)
    assert s["goodput_crossing_rate"] == pytest.approx(4 + 0.05 / 0.10 * 4)
    assert not math.isnan(s["points"][0]["ttft_p99_ms"])


def test_knee_follows_tpot_when_ttft_stays_flat():
    def run(rate, tok_s, ttft, tpot):
        return {"load": {"request_rate": rate}, "request_throughput": rate,
                "output_tok_s": tok_s, "goodput": 1.0,
                "ttft_ms": {"p50": ttft, "p99": ttft}, "tpot_ms": {"p50": tpot, "p99": tpot}}

    runs = [run(1, 10, 300, 70), run(2, 20, 310, 75), run(4, 30, 290, 90),
            run(8, 34, 305, 250), run(16, 35, 300, 600)]
    knee = summarize_sweep(runs, 0.9)["knee"]
    assert knee["metric"] == "p50 TPOT" and knee["request_rate"] == 4
