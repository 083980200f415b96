"""sample(): greedy, temperature, top-k/top-p/min-p, penalties (checked against transformers'
logits processors), banned tokens, logprobs, and per-row seeds independent of the batch."""

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from servelm.sampling import SamplingTensors, sample
from servelm.sampling.sampler import _apply_penalties, _top_k, _top_p

V = 50


def _logits(b=4, seed=0):
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = _logits()
    out = sample(logits, SamplingTensors(temperatures=torch.zeros(4)))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_top_k_matches_transformers():
    logits = _logits()
    ours = _top_k(logits.clone(), torch.tensor([1, 5, 10, V]))
    for row, k in enumerate([1, 5, 10, V]):
        ref = TopKLogitsWarper(top_k=k)(None, logits[row:row + 1].clone())
        assert torch.equal(torch.isinf(ours[row]), torch.isinf(ref[0]))


@pytest.mark.parametrize("p", [0.05, 0.3, 0.9, 1.0])
def test_top_p_matches_transformers(p):
    logits = _logits()
    ours = _top_p(logits.clone(), torch.full((4,), p))
    ref = TopPLogitsWarper(top_p=p)(None, logits.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))


def test_min_p_keeps_tokens_above_threshold():
    logits = _logits()
    st = SamplingTensors(temperatures=torch.ones(4), min_ps=torch.full((4,), 0.2),
                         generators=[torch.Generator().manual_seed(i) for i in range(4)])
    ref = MinPLogitsWarper(min_p=0.2)(None, logits.clone())
    for _ in range(20):
        tok = sample(logits, st).token_ids
        assert not torch.isinf(ref.gather(1, tok[:, None])).any()


def test_repetition_penalty_matches_transformers():
    logits = _logits(2)
    prompt = torch.tensor([[1, 2, 3], [4, 5, V]])  # V pads
    st = SamplingTensors(temperatures=torch.zeros(2), repetition_penalties=torch.tensor([1.3, 1.3]),
                         prompt_tokens=prompt, output_tokens=torch.tensor([[7, V], [8, 9]]))
    ours = _apply_penalties(logits.clone(), st)
    ids = torch.tensor([[1, 2, 3, 7], [4, 5, 8, 9]])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    torch.testing.assert_close(ours, ref)


def test_presence_and_frequency_penalties_follow_openai():
    logits = torch.zeros(1, V)
    st = SamplingTensors(temperatures=torch.zeros(1), presence_penalties=torch.tensor([0.5]),
                         frequency_penalties=torch.tensor([0.25]),
                         output_tokens=torch.tensor([[3, 3, 4]]))
    out = _apply_penalties(logits, st)
    assert out[0, 3].item() == pytest.approx(-0.5 - 0.5)
    assert out[0, 4].item() == pytest.approx(-0.5 - 0.25)
    assert out[0, 5].item() == 0


def test_banned_tokens_are_never_sampled():
    logits = torch.zeros(1, V)
    logits[0, 7] = 100
    out = sample(logits, SamplingTensors(temperatures=torch.zeros(1), banned=[(0, [7])]))
    assert out.token_ids.item() != 7


def test_logprobs_are_raw_model_distribution():
    logits = _logits(2)
    out = sample(logits, SamplingTensors(temperatures=torch.tensor([0.0, 0.7]),
                                         top_ks=torch.tensor([V, 3]), num_logprobs=3))
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None])[:, 0])
    torch.testing.assert_close(out.top_logprobs, ref.topk(3).values)


def test_seeded_row_ignores_the_rest_of_the_batch():
    logits = _logits(4)

    def draw(batch_rows):
        gens = [torch.Generator().manual_seed(1234) if r == 0 else None for r in batch_rows]
        st = SamplingTensors(temperatures=torch.ones(len(batch_rows)), generators=gens)
        return [sample(logits[batch_rows], st).token_ids[0].item() for _ in range(1)]

    alone = [sample(logits[:1], SamplingTensors(temperatures=torch.ones(1), generators=[
        torch.Generator().manual_seed(1234)])).token_ids.item()]
    assert draw([0, 1, 2, 3]) == alone
    assert draw([0, 3]) == alone


def test_temperature_sampling_matches_softmax_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    gen = torch.Generator().manual_seed(0)
    st = SamplingTensors(temperatures=torch.tensor([0.8]), generators=[gen])
    counts = torch.zeros(4)
    n = 4000
    for _ in range(n):
        counts[sample(logits, st).token_ids.item()] += 1
    expected = torch.softmax(logits[0] / 0.8, -1)
    # 4 standard errors of a binomial proportion.
    assert torch.all((counts / n - expected).abs() < 4 * (expected * (1 - expected) / n).sqrt())
