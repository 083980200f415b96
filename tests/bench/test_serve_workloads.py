"""The online workloads (conversation, documents) and the text prompts are seeded and shaped
as documented."""

import pytest

from servelm.bench.workloads import (SPECIAL_MARGIN, RangeError, conversation, documents,
                                     prompt_text, word_of)


def test_conversation_is_seeded_long_tailed_and_shares_history():
    reqs = conversation(300, (16, 1024), (16, 512), vocab_size=1000, seed=3)
    assert len(reqs) == 300
    assert reqs == conversation(300, (16, 1024), (16, 512), vocab_size=1000, seed=3)
    assert reqs != conversation(300, (16, 1024), (16, 512), vocab_size=1000, seed=4)
    outs = sorted(r.max_tokens for r in reqs)
    assert outs[0] >= 16 and outs[-1] <= 512
    assert outs[len(outs) // 2] < sum(outs) / len(outs)  # long tail: median below mean
    ids = {t for r in reqs for t in r.prompt_token_ids}
    assert min(ids) >= SPECIAL_MARGIN and max(ids) < 1000 - SPECIAL_MARGIN
    # Later turns extend an earlier prompt: its whole prompt is a prefix of theirs.
    prompts = [tuple(r.prompt_token_ids) for r in reqs]
    extended = sum(any(len(q) < len(p) and p[:len(q)] == q for q in prompts[:i])
                   for i, p in enumerate(prompts))
    assert extended > len(reqs) // 3


def test_documents_are_a_batch_of_long_prompts():
    docs = documents(20, (1000, 2000), (128, 128), 1000, seed=0)
    assert len(docs) == 20 and docs == documents(20, (1000, 2000), (128, 128), 1000, seed=0)
    assert all(1000 + 16 <= len(d.prompt_token_ids) <= 2000 + 16 for d in docs)
    assert all(d.max_tokens == 128 for d in docs)
    assert len({tuple(d.prompt_token_ids[-16:]) for d in docs}) == 1  # one instruction


def test_bad_workload_arguments_name_the_parameter():
    with pytest.raises(RangeError) as e:
        conversation(0, 4, 4, 1000)
    assert e.value.param == "num_prompts"
    with pytest.raises(RangeError) as e:
        conversation(5, (10, 5), 4, 1000)
    assert e.value.param == "input_len"


def test_prompt_text_is_deterministic_one_word_per_id():
    assert prompt_text([5, 70000, 5]).split() == [word_of(5), word_of(70000), word_of(5)]
    words = {word_of(i) for i in range(5000)}
    assert len(words) == 5000  # distinct ids give distinct words
