"""GrammarMasks and GrammarCompiler on the default model's vocabulary: masks follow the
grammar, draft rows see the grammar after the drafts before them, the compile cache holds,
and a speculating engine's structured output equals the unspeculated one."""

from __future__ import annotations

import dataclasses
import json

import pytest

from servelm.core.runner_state import RunnerSequence
from servelm.protocol import InvalidParameterError, SamplingParams, StructuredOutput
from servelm.structured import GrammarCompiler, GrammarMasks

DIGITS = StructuredOutput("regex", "[0-9]{2}x", param="structured_outputs")


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from servelm.loader import load_tokenizer, resolve_model
    from servelm.loader.model_cache import DEFAULT_MODEL

    return load_tokenizer(resolve_model(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def _seq(seq_id, tokenizer, output_text="", so=DIGITS):
    prompt = tokenizer.encode("Number:", add_special_tokens=False)
    out = tokenizer.encode(output_text, add_special_tokens=False) if output_text else []
    return RunnerSequence(seq_id, SamplingParams(structured=so), len(prompt), None,
                          prompt + out)


def _texts(tokenizer, row) -> set[str]:
    return {tokenizer.decode([int(i)], skip_special_tokens=False)
            for i in row.nonzero()[0].tolist()}


def test_masks_follow_the_tokens_the_sequence_has(tokenizer, compiler):
    masks = GrammarMasks(compiler)
    seq = _seq(1, tokenizer)
    first = masks.masks([(seq, [])])[1]
    assert first.shape == (1, compiler.vocab_size)
    allowed = _texts(tokenizer, first[0])
    assert allowed and all(t and t[0].isdigit() for t in allowed)
    seq.token_ids += tokenizer.encode("12", add_special_tokens=False)
    after = _texts(tokenizer, masks.masks([(seq, [])])[1][0])
    assert after == {"x"}
    seq.token_ids += tokenizer.encode("x", add_special_tokens=False)
    done = masks.masks([(seq, [])])[1][0]
    assert set(done.nonzero()[0].tolist()) <= set(tokenizer.eos_token_ids)


def test_draft_rows_reject_what_the_grammar_forbids(tokenizer, compiler):
    masks = GrammarMasks(compiler)
    seq = _seq(2, tokenizer)
    one, = tokenizer.encode("1", add_special_tokens=False)
    letter, = tokenizer.encode("a", add_special_tokens=False)
    rows = masks.masks([(seq, [one, letter, one])])[2]
    assert rows.shape[0] == 4
    assert rows[0, one] and rows[1, one]  # "1" then "1" is allowed ...
    assert not rows[1, letter]  # ... "1" then "a" is not: verification rejects that draft
    # the drafts were scored, not consumed: the next step starts from the real tokens
    again = masks.masks([(seq, [])])[2]
    assert (again[0] == rows[0]).all()


def test_a_spec_compiles_once(compiler):
    so = StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {
        "a": {"type": "integer"}}}))
    assert compiler.grammar(so) is compiler.grammar(StructuredOutput(so.kind, so.spec))


@pytest.mark.parametrize("so", [
    StructuredOutput("json_schema", '{"type": "frobnicate"}'),
    StructuredOutput("json_schema", "{not json"),
    StructuredOutput("regex", "(", param="structured_outputs"),
    StructuredOutput("grammar", "start: nothing_here", param="structured_outputs"),
])
def test_uncompilable_specs_name_their_field(compiler, so):
    with pytest.raises(InvalidParameterError) as exc:
        compiler.grammar(so)
    assert exc.value.param == so.param


@pytest.mark.slow  # builds engines of the default model
def test_speculative_structured_output_matches_plain(default_model_path):
    from servelm.config import EngineArgs
    from servelm.engine_builder import build_engine
    from servelm.llm import LLM

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    example = '{"name": "Ann", "age": 31}'
    messages = [{"role": "user", "content": f"Here is a person: {example}. Write another "
                                            "person as JSON in the same form."}]
    params = SamplingParams(max_tokens=40, temperature=0,
                            structured=StructuredOutput("json_schema", json.dumps(schema)))
    outs = {}
    for method in (None, "ngram"):
        engine = build_engine(EngineArgs(model="smollm2-135m-instruct",
                                         kv_cache_memory=32 * 2**20, speculative_method=method,
                                         spec_adaptive=False, num_speculative_tokens=3))
        outs[method] = LLM(engine=engine).chat(messages, params)[0].outputs[0]
        if method is not None:
            assert engine.stats.spec_num_proposed > 0  # drafts were scored under the mask
            # sampled verification (rejection sampling against the masked distribution)
            sampled = LLM(engine=engine).chat(messages, dataclasses.replace(
                params, temperature=0.9, seed=4, n=3))[0].outputs
            for o in sampled:
                if o.finish_reason.value == "stop":
                    assert set(json.loads(o.text)) == {"name", "age"}
                else:
                    assert len(o.token_ids) == params.max_tokens
            # logit processors that verification does not apply keep the request unspeculated
            (banana,) = engine.tokenizer.encode(" banana", add_special_tokens=False)
            proposed = engine.stats.spec_num_proposed
            biased = LLM(engine=engine).generate(
                example + example, SamplingParams(max_tokens=8, temperature=0,
                                                  logit_bias={banana: 100}))[0].outputs[0]
            assert biased.token_ids == [banana] * 8
            assert engine.stats.spec_num_proposed == proposed
    assert outs["ngram"].token_ids == outs[None].token_ids
    assert outs["ngram"].finish_reason.value == "stop"
    obj = json.loads(outs["ngram"].text)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int)


def test_the_constraint_crosses_the_core_boundary():
    from servelm.core.codec import AddRequest, Decoder, FrontendMessage, encode
    from servelm.protocol import EngineRequest

    so = StructuredOutput("choice", '["a", "b"]', param="structured_outputs")
    msg = AddRequest(EngineRequest("r", [1, 2], SamplingParams(structured=so)))
    back = Decoder(FrontendMessage).decode(encode(msg))
    assert back.request.sampling_params.structured == so


@pytest.mark.slow  # builds engines of the default model
def test_preempted_structured_sequences_resume_in_their_grammar(default_model_path):
    """A preempted sequence's matcher follows its tokens, not the KV: recomputed after
    preemption, the outputs are the ones a roomy engine gives, and they validate."""
    from servelm.config import EngineArgs
    from servelm.engine_builder import build_engine
    from servelm.llm import LLM

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "rank": {"type": "integer"}},
              "required": ["city", "rank"], "additionalProperties": False}
    params = SamplingParams(max_tokens=36, temperature=0,
                            structured=StructuredOutput("json_schema", json.dumps(schema)))
    chats = [[{"role": "user", "content": f"A city and its rank, number {i}, as JSON."}]
             for i in range(4)]
    outs = {}
    for num_blocks in (None, 40):  # 40 blocks of 4 tokens hold ~2 of the 4 whole sequences
        engine = build_engine(EngineArgs(model="smollm2-135m-instruct", block_size=4,
                                         kv_cache_memory=32 * 2**20, num_blocks=num_blocks,
                                         enable_prefix_caching=False))
        outs[num_blocks] = [r.outputs[0] for r in LLM(engine=engine).chat(chats, params)]
        if num_blocks is not None:
            assert engine.scheduler.num_preemptions > 0
    for tight, roomy in zip(outs[40], outs[None]):
        assert tight.token_ids == roomy.token_ids
        if tight.finish_reason.value == "stop":
            assert set(json.loads(tight.text)) == {"city", "rank"}
