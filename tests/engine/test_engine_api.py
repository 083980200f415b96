"""Engine behaviour through the Python API on a tiny model: admission errors name the
parameter and leave other requests untouched; n > 1; seeds; min_tokens; stop ids; abort."""

import math

import pytest

from servelm.llm import LLM
from servelm.protocol import EngineRequest, InvalidParameterError, SamplingParams


@pytest.fixture(scope="module")
def llm():
    from tiny_models import make_tiny_engine, make_tiny_hf_model

    return LLM(engine=make_tiny_engine(make_tiny_hf_model("llama"), num_blocks=64,
                                       max_model_len=200))


@pytest.mark.parametrize("kwargs,param", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(n=0), "n"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logprobs=99), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(seed="x"), "seed"),
])
def test_bad_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("prompt,params,param", [
    ([], SamplingParams(), "prompt"),
    ([5, 384], SamplingParams(), "prompt"),  # vocab is 384
    ([5, -1], SamplingParams(), "prompt"),
    ([5] * 190, SamplingParams(max_tokens=20), "max_tokens"),  # context is 200
    ([5] * 200, SamplingParams(max_tokens=1), "prompt"),
])
def test_requests_that_can_never_fit_are_rejected_at_once(llm, prompt, params, param):
    with pytest.raises(InvalidParameterError) as e:
        llm.generate([prompt, [5, 6]], params, use_tqdm=False)
    assert e.value.param == param
    # nothing left behind, and the next request is served
    assert not llm.engine.has_unfinished
    assert llm.generate([5, 6], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("bad", [2.5, "7", None, 384, -3])
def test_a_prompt_id_that_is_not_a_vocabulary_int_is_named(llm, bad):
    ids = [5, 6, bad, 7]
    with pytest.raises(InvalidParameterError, match=f"prompt token id {bad!r} is outside") as e:
        llm.engine.add_request(EngineRequest("bad-id", ids, SamplingParams(max_tokens=2)))
    assert e.value.param == "prompt"
    assert not llm.engine.has_unfinished


def test_request_bigger_than_kv_pool_is_rejected(llm):
    # 64 blocks * 4 tokens = 256 > context 200, so shrink through a new engine's pool.
    from tiny_models import make_tiny_engine, make_tiny_hf_model

    small = LLM(engine=make_tiny_engine(make_tiny_hf_model("llama"), num_blocks=8))
    with pytest.raises(InvalidParameterError, match="KV cache|context") as e:
        small.generate([5] * 20, SamplingParams(max_tokens=20), use_tqdm=False)
    assert e.value.code == "context_length_exceeded"


def test_n_returns_n_distinct_choices(llm):
    out = llm.generate([5, 6, 7], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=3,
                                                 ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_same_seed_same_output_whatever_the_batch(llm):
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    alone = llm.generate([9, 8, 7], p, use_tqdm=False)[0].outputs[0].token_ids
    noise = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    batch = llm.generate([[1, 2], [9, 8, 7], [3, 3, 3, 3]], [noise, p, noise], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other = SamplingParams(max_tokens=12, temperature=1.0, seed=43, ignore_eos=True)
    assert llm.generate([9, 8, 7], other, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_stop_token_ids_and_min_tokens(llm):
    greedy = llm.generate([5, 6, 7], SamplingParams(max_tokens=10, temperature=0,
                                                    ignore_eos=True), use_tqdm=False)
    first = greedy[0].outputs[0].token_ids[0]
    out = llm.generate([5, 6, 7], SamplingParams(max_tokens=10, temperature=0,
                                                 stop_token_ids=[first]), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [first]
    assert out[0].outputs[0].finish_reason.value == "stop"
    out = llm.generate([5, 6, 7], SamplingParams(max_tokens=10, temperature=0, min_tokens=3,
                                                 stop_token_ids=[first]), use_tqdm=False)
    assert out[0].outputs[0].token_ids[0] != first
    assert len(out[0].outputs[0].token_ids) >= 3


def test_abort_frees_blocks_and_reports_abort(llm):
    engine = llm.engine
    engine.add_request(EngineRequest("x", [5, 6, 7, 8], SamplingParams(max_tokens=100,
                                                                        ignore_eos=True)))
    engine.add_request(EngineRequest("y", [5, 6], SamplingParams(max_tokens=5,
                                                                  ignore_eos=True)))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    engine.abort("x")
    reasons = {}
    while engine.has_unfinished:
        for d in engine.step():
            if d.finish_reason:
                reasons[d.request_id] = d.finish_reason.value
    assert reasons == {"x": "abort", "y": "length"}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.check_invariants()


def test_unknown_model_path_names_model(tmp_path):
    with pytest.raises(InvalidParameterError) as e:
        LLM(str(tmp_path / "nope.gguf"))
    assert e.value.param == "model"
