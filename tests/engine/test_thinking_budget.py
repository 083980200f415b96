"""ThinkingSteer: the tokens appended for a budgeted sequence's sampled ones (the live path,
with a real model and a reasoning parser, is tests/server/test_reasoning_budget.py)."""

from __future__ import annotations

import pytest

from servelm.engine.thinking_budget import ThinkingSteer
from servelm.protocol import InvalidParameterError, SamplingParams, ThinkingBudget

START, END = [1, 2], [8, 9]  # two-token tags, as <think> and </think> in SmolLM2's vocabulary


def _appended(budget: ThinkingBudget, sampled: list[int]) -> list[int]:
    steer = ThinkingSteer(budget)
    return [steer.next_token(t) for t in sampled]


def test_budget_spent_forces_the_end_tag_then_the_answer_goes_on():
    out = _appended(ThinkingBudget(3, END, START), [1, 2, 5, 5, 5, 6, 6, 7, 7])
    assert out == [1, 2, 5, 5, 5, 8, 9, 7, 7]


def test_prompt_opened_thinking_counts_from_the_first_token():
    assert _appended(ThinkingBudget(2, END), [5, 6, 7, 7, 7]) == [5, 6, 8, 9, 7]
    assert _appended(ThinkingBudget(0, END), [5, 6, 7]) == [8, 9, 7]


def test_the_model_closing_in_budget_is_left_alone():
    out = _appended(ThinkingBudget(4, END, START), [1, 2, 5, 8, 9, 5, 5, 5, 5])
    assert out == [1, 2, 5, 8, 9, 5, 5, 5, 5]
    # a partial end tag that does not finish is thinking like any other token
    assert _appended(ThinkingBudget(2, END), [8, 5, 5, 5]) == [8, 5, 8, 9]


def test_an_output_that_does_not_open_thinking_is_never_steered():
    assert _appended(ThinkingBudget(0, END, START), [1, 5, 5, 5]) == [1, 5, 5, 5]
    assert _appended(ThinkingBudget(0, END, START), [5, 1, 2, 5]) == [5, 1, 2, 5]


@pytest.mark.parametrize("num_tokens", [-1, 1.5, True])
def test_bad_budgets_are_refused_by_name(num_tokens):
    with pytest.raises(InvalidParameterError) as e:
        ThinkingBudget(num_tokens, END)
    assert e.value.param == "thinking_token_budget"
    with pytest.raises(InvalidParameterError) as e:
        ThinkingBudget(3, [], param="reasoning_effort")
    assert e.value.param == "reasoning_effort"


def test_a_budgeted_request_never_speculates():
    assert not SamplingParams(thinking_budget=ThinkingBudget(3, END)).speculative
    assert SamplingParams().speculative
