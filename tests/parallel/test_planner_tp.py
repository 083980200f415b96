"""`servelm plan capacity --tp N`: the tensor-parallel all-reduce bytes and seconds of a
decode step (servelm/planner/tp_comm.py), the formula the layers' byte count is checked
against in test_tensor_parallel.py."""

from __future__ import annotations

import json

import pytest


def _capacity(*flags: str) -> dict:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "servelm.cli", "plan", "capacity", "--json",
                          "--model", "Llama-3.1-70B", "--gpu", "H100-SXM", "--num-gpus", "8",
                          *flags], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_capacity_at_tp8_adds_the_allreduce_time_of_a_decode_step():
    plan = _capacity("--tp", "8")
    assert plan["tp_allreduce_bytes_per_token_per_layer"] == 2 * 8192 * 2  # bf16 activations
    calls, ring, link = 2 * 80 + 1, 2 * 7 / 8, 450e9  # NVLink 4, one way
    assert plan["tp_allreduce_s_per_step_batch_1"] == pytest.approx(
        calls * (10e-6 + ring * 8192 * 2 / link))
    users = plan["users_per_replica"]
    assert plan["tp_allreduce_s_per_step_full"] == pytest.approx(
        calls * (10e-6 + ring * users * 8192 * 2 / link))
    measured = _capacity("--tp", "8", "--tp-latency-us", "25")
    assert measured["tp_allreduce_s_per_step_batch_1"] == pytest.approx(
        calls * (25e-6 + ring * 8192 * 2 / link))
    assert any("all-reduces per decode step" in n for n in plan["notes"])


def test_capacity_at_tp1_has_no_allreduce():
    plan = _capacity("--tp", "1")
    assert plan["tp_allreduce_s_per_step_batch_1"] == 0.0
    assert not any("all-reduce" in n for n in plan["notes"])
