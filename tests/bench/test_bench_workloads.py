"""Seeded workloads: deterministic, within their ranges, clear errors naming the parameter."""

import subprocess
import sys
from pathlib import Path

import pytest

from servelm.bench.workloads import (SPECIAL_MARGIN, RangeError, format_range, parse_range,
                                     random_lengths)


def test_same_seed_same_requests_other_seed_differs():
    a = random_lengths(16, (32, 256), (8, 64), vocab_size=49152, seed=3)
    b = random_lengths(16, (32, 256), (8, 64), vocab_size=49152, seed=3)
    c = random_lengths(16, (32, 256), (8, 64), vocab_size=49152, seed=4)
    assert a == b
    assert a != c


def test_pinned_values_do_not_drift():
    # Results recorded on different days compare only if the workload never changes.
    reqs = random_lengths(2, "4:6", "2:3", vocab_size=1000, seed=0)
    assert [tuple(r) for r in reqs] == [([346, 132, 160, 113, 240, 750], 3),
                                        ([619, 830, 502, 585, 876], 2)]


def test_lengths_within_inclusive_ranges_and_both_ends_reached():
    reqs = random_lengths(400, (32, 40), (5, 7), vocab_size=49152, seed=1)
    in_lens = {len(r.prompt_token_ids) for r in reqs}
    out_lens = {r.max_tokens for r in reqs}
    assert in_lens == set(range(32, 41))
    assert out_lens == {5, 6, 7}


def test_token_ids_avoid_special_tokens_at_both_ends():
    reqs = random_lengths(50, 200, 1, vocab_size=1000, seed=2)
    ids = [t for r in reqs for t in r.prompt_token_ids]
    assert min(ids) >= SPECIAL_MARGIN
    assert max(ids) < 1000 - SPECIAL_MARGIN
    assert all(type(t) is int for t in ids)  # JSON-serialisable, not numpy ints


def test_fixed_length_string():
    reqs = random_lengths(3, "128", "128", 1000, seed=0)
    assert [len(r.prompt_token_ids) for r in reqs] == [128, 128, 128]
    assert [r.max_tokens for r in reqs] == [128, 128, 128]


@pytest.mark.parametrize("text,expected", [("5", (5, 5)), ("32:256", (32, 256)),
                                           (" 7 : 9 ", (7, 9)), (4, (4, 4)), ((2, 3), (2, 3))])
def test_parse_range(text, expected):
    assert parse_range(text, "--input-len") == expected


@pytest.mark.parametrize("text", ["", "a", "1:", ":4", "1:2:3", "0", "0:4", "9:3", "-1", "1.5"])
def test_parse_range_rejects_bad_input_naming_the_flag(text):
    with pytest.raises(RangeError, match="--output-len") as info:
        parse_range(text, "--output-len")
    assert info.value.param == "--output-len"
    assert isinstance(info.value, ValueError)


def test_random_lengths_errors_name_the_parameter():
    with pytest.raises(RangeError) as info:
        random_lengths(0, 4, 4, 1000)
    assert info.value.param == "num_prompts"
    with pytest.raises(RangeError) as info:
        random_lengths(1, "8:2", 4, 1000)
    assert info.value.param == "input_len"
    with pytest.raises(RangeError) as info:
        random_lengths(1, 4, 4, vocab_size=150)
    assert info.value.param == "vocab_size"


def test_format_range_round_trips():
    for r in [(3, 3), (32, 256)]:
        assert parse_range(format_range(r)) == r


def test_loadable_by_path_without_servelm_or_torch():
    # Peer venvs import this file by path: it must not pull in servelm or torch.
    path = Path(__file__).parents[2] / "servelm" / "bench" / "workloads.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('w', {str(path)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "assert len(m.random_lengths(2, '3:4', '2', 1000)) == 2\n"
        "assert 'torch' not in sys.modules and 'servelm' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_shared_prefix_requests_share_exactly_the_prefix():
    from servelm.bench.workloads import shared_prefix

    reqs = shared_prefix(5, prefix_len=50, suffix_len=7, output_len=(3, 3), vocab_size=1000,
                         seed=1)
    assert len(reqs) == 5 and all(len(r.prompt_token_ids) == 57 for r in reqs)
    assert len({tuple(r.prompt_token_ids[:50]) for r in reqs}) == 1
    assert len({tuple(r.prompt_token_ids[50:]) for r in reqs}) == 5
    assert reqs == shared_prefix(5, prefix_len=50, suffix_len=7, output_len=(3, 3),
                                 vocab_size=1000, seed=1)
