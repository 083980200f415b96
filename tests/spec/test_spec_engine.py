"""Speculative decoding end to end on a tiny model: greedy output is the target's own, token
for token, for every proposer, alone and in mixed batches, with prefix hits, preemption and
chunked prefill; rollback leaves the block manager's invariants intact.

Float reductions differ between a 1-token decode and a (k + 1)-token verification, so where
two tokens are a near-tie the reference's logprobs decide (see _same_or_tie); the tiny models'
logits are spread wide enough that this is rare.
"""

import random

import pytest

from servelm.llm import LLM
from servelm.protocol import SamplingParams

MAX_TOKENS = 24
REF = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def _prompts(vocab, n=10, seed=0):
    """Random prompts and repetitive ones (so that n-gram lookups find matches)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2:
            unit = [rng.randrange(vocab) for _ in range(rng.randint(2, 5))]
            out.append((unit * 12)[: rng.randint(8, 40)])
        else:
            out.append([rng.randrange(vocab) for _ in range(rng.randint(3, 50))])
    return out


def _same_or_tie(ref, ids, tol=1e-3):
    for i, (x, y) in enumerate(zip(ref.token_ids, ids)):
        if x != y:
            top = dict(ref.logprobs[i].top)
            assert y in top and abs(top[x] - top[y]) < tol, f"diverged at {i}: {x} vs {y}"
            return
    assert len(ref.token_ids) == len(ids)


@pytest.fixture(scope="module")
def hf():
    from tiny_models import make_tiny_hf_model

    return make_tiny_hf_model("llama", num_hidden_layers=3)


@pytest.fixture(scope="module")
def hf_dir(hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    hf.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def prompts(hf):
    return _prompts(hf.config.vocab_size)


@pytest.fixture(scope="module")
def reference(hf, prompts):
    from tiny_models import make_tiny_engine

    llm = LLM(engine=make_tiny_engine(hf))
    return [o.outputs[0] for o in llm.generate(prompts, REF, use_tqdm=False)]


def _spec_engine(hf, **kw):
    from tiny_models import make_tiny_engine

    kw.setdefault("spec_adaptive", False)  # always speculate: what is under test
    kw.setdefault("num_speculative_tokens", 3)
    return make_tiny_engine(hf, **kw)


def _run(engine, prompts, params=GREEDY):
    outs = LLM(engine=engine).generate(prompts, params, use_tqdm=False)
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [o.outputs[0].token_ids for o in outs]


PROPOSERS = {
    "ngram": dict(speculative_method="ngram", spec_ngram_min=1),
    "early-exit": dict(speculative_method="draft", spec_draft_layers=1),
}


@pytest.fixture(scope="module")
def noisy_dir(hf, tmp_path_factory):
    """A draft that agrees with the target often but not always: the target's weights with
    noise, so verifications accept some drafts and reject others, and the draft's catch-up
    differs between sequences (1 token after a rejection, 2 after all passed, a whole prompt
    for a new sequence) within one forward."""
    import copy

    import torch
    from tiny_models import make_tiny_hf_model

    draft = copy.deepcopy(hf)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                p.add_(torch.randn_like(p) * 0.01)
    path = tmp_path_factory.mktemp("noisy-draft")
    draft.save_pretrained(path)
    assert make_tiny_hf_model  # same architecture and vocabulary as the target
    return str(path)


@pytest.fixture(params=["ngram", "early-exit", "draft-model", "noisy-draft"])
def proposer_kw(request, hf_dir, noisy_dir):
    if request.param == "draft-model":  # the target's own checkpoint as the draft: all pass
        return dict(speculative_method="draft", spec_draft_model=hf_dir)
    if request.param == "noisy-draft":
        return dict(speculative_method="draft", spec_draft_model=noisy_dir)
    return PROPOSERS[request.param]


def test_greedy_batched_matches_target(hf, prompts, reference, proposer_kw):
    engine = _spec_engine(hf, **proposer_kw)
    outs = _run(engine, prompts)
    for ref, ids in zip(reference, outs):
        _same_or_tie(ref, ids)
    st = engine.stats
    assert st.spec_num_proposed > 0
    if proposer_kw.get("spec_draft_model") and "noisy" in proposer_kw["spec_draft_model"]:
        assert 0 < st.spec_num_accepted < st.spec_num_proposed  # both outcomes happened
    elif proposer_kw.get("spec_draft_model"):
        # Draft == target: every draft passes, each verification emits k + 1 tokens.
        assert st.spec_num_accepted >= 0.9 * st.spec_num_proposed
        assert st.spec_mean_accepted_length > 3.0


def test_greedy_alone_matches_target(hf, prompts, reference):
    engine = _spec_engine(hf, **PROPOSERS["early-exit"])
    for p, ref in zip(prompts[:4], reference[:4]):
        _same_or_tie(ref, _run(engine, [p])[0])


def test_preemption_keeps_output(hf, prompts, reference, proposer_kw):
    # 24 blocks of 4 tokens cannot hold 10 sequences of up to 74 tokens: preemption.
    engine = _spec_engine(hf, num_blocks=24, **proposer_kw)
    outs = _run(engine, prompts)
    assert engine.scheduler.num_preemptions > 0
    for ref, ids in zip(reference, outs):
        _same_or_tie(ref, ids)


def test_chunking_keeps_output(hf, prompts, reference, proposer_kw):
    # A 9-token budget chunks prompts and clips the draft slots of decodes.
    engine = _spec_engine(hf, max_num_batched_tokens=9, **proposer_kw)
    outs = _run(engine, prompts)
    for ref, ids in zip(reference, outs):
        _same_or_tie(ref, ids)
    assert engine.stats.spec_num_proposed > 0


def test_prefix_hits_keep_output(hf, prompts, reference, proposer_kw):
    engine = _spec_engine(hf, **proposer_kw)
    first = _run(engine, prompts)
    again = _run(engine, prompts)  # full prefix hits now
    assert engine.scheduler.running == [] and engine.stats.num_computed_prompt_tokens < 2 * sum(
        len(p) for p in prompts)  # the second pass computed (almost) no prompt tokens
    for ref, a, b in zip(reference, first, again):
        _same_or_tie(ref, a)
        _same_or_tie(ref, b)


def test_mixed_batch_with_opted_out_requests(hf, prompts, reference):
    """Requests asking for logprobs (or speculative=False) decode one token at a time in the
    same batch as speculating ones; everyone gets the target's output."""
    engine = _spec_engine(hf, **PROPOSERS["early-exit"])
    params = [REF if i % 3 == 0 else GREEDY for i in range(len(prompts))]
    outs = LLM(engine=engine).generate(prompts, params, use_tqdm=False)
    engine.check_invariants()
    for ref, out in zip(reference, outs):
        _same_or_tie(ref, out.outputs[0].token_ids)
    assert engine.stats.spec_num_proposed > 0


def test_stop_inside_accepted_drafts(hf, prompts, reference, hf_dir):
    """A stop token among several tokens emitted in one step ends the sequence there."""
    ref = reference[1].token_ids
    stop = ref[7]
    first = ref.index(stop)
    engine = _spec_engine(hf, speculative_method="draft", spec_draft_model=hf_dir)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                            stop_token_ids=[stop])
    out = LLM(engine=engine).generate([prompts[1]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[:first + 1]
    assert out.finish_reason.value == "stop"
    engine.check_invariants()


def test_max_tokens_is_exact(hf, prompts, hf_dir):
    engine = _spec_engine(hf, speculative_method="draft", spec_draft_model=hf_dir,
                          num_speculative_tokens=4)
    for n in (1, 2, 5, 7):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        out = LLM(engine=engine).generate([prompts[0]], params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == n


def test_bad_speculative_args_name_the_parameter(hf):
    from servelm.protocol import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="spec_draft_layers"):
        _spec_engine(hf, speculative_method="draft", spec_draft_layers=3)
    with pytest.raises(ValueError, match="needs --spec-draft-model"):
        _spec_engine(hf, speculative_method="draft")


def test_per_request_opt_out(hf, prompts, reference):
    engine = _spec_engine(hf, **PROPOSERS["early-exit"])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                            speculative=False)
    outs = _run(engine, prompts[:3], params)
    assert engine.stats.spec_num_proposed == 0
    for ref, ids in zip(reference, outs):
        _same_or_tie(ref, ids)


def test_server_metrics_report_speculation(hf, prompts):
    from servelm.server.metrics import ServerMetrics

    engine = _spec_engine(hf, **PROPOSERS["early-exit"])
    metrics = ServerMetrics("tiny", 1.0, 0.1)
    metrics.start_from(engine.report())
    _run(engine, prompts[:4])
    metrics.observe_step(engine.report(), [])
    text = metrics.render().decode()
    st = engine.stats

    def value(name):
        line = next(x for x in text.splitlines() if x.startswith(name + " "))
        return float(line.split()[1])

    assert value("servelm_spec_draft_tokens_total") == st.spec_num_proposed > 0
    assert value("servelm_spec_accepted_tokens_total") == st.spec_num_accepted
    assert value("servelm_spec_mean_accepted_length") >= 1.0
    assert 0 < value("servelm_spec_draft_time_share") < 1
    # the acceptance-length histogram: one observation per verification, summing to the
    # accepted drafts; position 1's acceptance rate is the share of verifications accepting it
    assert value("servelm_spec_acceptance_length_count") == st.spec_num_verifications
    assert value("servelm_spec_acceptance_length_sum") == st.spec_num_accepted
    assert sum(st.spec_accepted_lengths) == st.spec_num_verifications
    first = next(x for x in text.splitlines()
                 if x.startswith('servelm_spec_position_acceptance_rate{position="1"}'))
    assert float(first.split()[1]) == pytest.approx(st.spec_position_acceptance[0])
    assert 0 < st.spec_position_acceptance[0] <= 1
