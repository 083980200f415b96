"""The codec: every message survives a round trip; bad frames and other versions are refused."""

from __future__ import annotations

import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelm.config import EngineArgs, ModelConfig
from servelm.core import codec
from servelm.core.codec import (Abort, AddRequest, Admitted, CodecError, CoreInfo, Fatal, Hello,
                                Outputs, Ready, Rejected, Shutdown, Start)
from servelm.core.contract import (CONTRACT_VERSION, KVBlock, NewSequence, SampledToken,
                                   ScheduledSequence, SpecOutcome, StepDescription, StepReport,
                                   StepResult)
from servelm.core_process.process import recv_frame
from servelm.protocol import (EngineRequest, FinishReason, Logprob, RequestTimings,
                              SamplingParams, TokenDelta)

ids = st.lists(st.integers(0, 2**31 - 1), max_size=20)
small = st.integers(0, 10_000)
floats = st.floats(allow_nan=False, allow_infinity=False, width=64)

params = st.builds(
    SamplingParams, n=st.integers(1, 4), max_tokens=st.none() | st.integers(1, 4096),
    temperature=st.floats(0, 2), top_p=st.floats(0.01, 1), top_k=st.sampled_from([-1, 1, 50]),
    min_p=st.floats(0, 1), seed=st.none() | st.integers(0, 2**40),
    stop=st.lists(st.text(min_size=1, max_size=8), max_size=3),
    stop_token_ids=st.lists(st.integers(0, 1000), max_size=3),
    logprobs=st.none() | st.integers(0, 20), cache_salt=st.none() | st.text(max_size=10),
    speculative=st.booleans())
logprob = st.builds(Logprob, st.integers(0, 1000), floats,
                    st.lists(st.tuples(st.integers(0, 1000), floats), max_size=3))
scheduled = st.builds(
    ScheduledSequence, seq_id=small, start=small, num_new_tokens=st.integers(1, 512),
    new_token_ids=ids, num_kept_blocks=small, new_block_ids=ids, num_spec=st.integers(0, 8),
    new=st.none() | st.builds(NewSequence, params, small, st.none() | st.integers(0, 2**40)))
kv_blocks = st.lists(st.builds(KVBlock, small, st.binary(max_size=64)), max_size=3)
steps = st.builds(StepDescription, step_id=small, seqs=st.lists(scheduled, max_size=6),
                  finished_seq_ids=ids, preempted_seq_ids=ids, kv_saves=ids,
                  kv_loads=kv_blocks)
results = st.builds(
    StepResult, sampled=st.lists(st.builds(SampledToken, small, small, st.none() | logprob),
                                 max_size=6),
    spec=st.dictionaries(small, st.builds(SpecOutcome, small, small), max_size=3),
    forward_s=floats, draft_s=floats, kv_saved=kv_blocks)
reports = st.builds(StepReport, step_s=st.none() | floats, last_num_seqs=small,
                    num_preemptions=small, spec_k=st.none() | small, num_free_blocks=small)
timings = st.builds(RequestTimings, arrival_time=floats, first_token_time=st.none() | floats,
                    num_preemptions=small, prefill_time=floats)
deltas = st.builds(
    TokenDelta, request_id=st.text(max_size=12), index=small, text=st.text(max_size=20),
    token_ids=ids, logprobs=st.none() | st.lists(logprob, max_size=3),
    finish_reason=st.none() | st.sampled_from(list(FinishReason)), num_prompt_tokens=small,
    num_output_tokens=small, timings=st.none() | timings, error=st.none() | st.text(max_size=8))
requests = st.builds(EngineRequest, request_id=st.text(max_size=12), prompt_token_ids=ids,
                     sampling_params=params, prompt=st.none() | st.text(max_size=20),
                     arrival_time=st.none() | floats)
MODEL = ModelConfig("llama", 384, 64, 128, 2, 4, 2, 16, 1024,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0}, eos_token_ids=(1, 2))
INFO = CoreInfo("tiny", MODEL, 1024, 384, 64, 16, "float32", None, "auto", "cpu", False)
frontend_messages = st.one_of(
    st.builds(Hello, st.integers(0, 9), st.sampled_from(["frontend", "core"]), small),
    st.builds(AddRequest, requests), st.builds(Abort, st.text(max_size=12)),
    st.just(Shutdown()),
    st.builds(Start, st.builds(EngineArgs, model=st.text(min_size=1, max_size=10),
                               max_num_seqs=st.integers(1, 256), seed=small)))
core_messages = st.one_of(
    st.builds(Admitted, st.text(max_size=12)),
    st.builds(Rejected, st.text(max_size=12), st.text(max_size=30),
              st.none() | st.text(max_size=8), st.none() | st.text(max_size=8)),
    st.builds(Outputs, st.lists(deltas, max_size=4), st.none() | reports),
    st.builds(Fatal, st.text(max_size=30)), st.just(Ready(INFO)))


def _round_trip(msg, decoder):
    data = codec.frame(msg)
    assert codec.frame_length(data[:codec.HEADER_BYTES]) == len(data) - codec.HEADER_BYTES
    return decoder.decode(data[codec.HEADER_BYTES:])


@settings(max_examples=150, deadline=None)
@given(steps)
def test_step_descriptions_round_trip(step):
    assert _round_trip(step, codec.step_decoder) == step


@settings(max_examples=150, deadline=None)
@given(results)
def test_step_results_round_trip(result):
    assert _round_trip(result, codec.result_decoder) == result


@settings(max_examples=150, deadline=None)
@given(frontend_messages)
def test_frontend_messages_round_trip(msg):
    back = _round_trip(msg, codec.frontend_decoder)
    assert type(back) is type(msg) and back == msg


@settings(max_examples=150, deadline=None)
@given(core_messages)
def test_core_messages_round_trip(msg):
    back = _round_trip(msg, codec.core_decoder)
    assert type(back) is type(msg) and back == msg


def test_a_decoded_request_is_validated_like_a_constructed_one():
    """The schema is checked on decode: a frame cannot smuggle in parameters that the
    constructor would refuse, nor a field of the wrong type."""
    good = codec.encode(AddRequest(EngineRequest("r", [1, 2], SamplingParams(top_p=0.5))))
    bad_value = good.replace(b"\xcb?\xe0\x00\x00\x00\x00\x00\x00", b"\xcb@\x14\x00\x00\x00\x00\x00\x00")
    assert bad_value != good  # top_p 0.5 -> 5.0
    with pytest.raises(CodecError, match="top_p"):
        codec.frontend_decoder.decode(bad_value)
    with pytest.raises(CodecError, match="malformed"):
        codec.frontend_decoder.decode(codec.encode({"type": "AddRequest", "request": 3}))
    with pytest.raises(CodecError, match="malformed"):  # a core message is not a front end's
        codec.frontend_decoder.decode(codec.encode(Admitted("r")))


def test_oversized_frames_are_refused_before_reading_them():
    header = (codec.MAX_FRAME_BYTES + 1).to_bytes(4, "big")
    with pytest.raises(CodecError, match="exceeds"):
        codec.frame_length(header)


def test_other_versions_and_roles_refuse_each_other():
    ok = Hello(CONTRACT_VERSION, "core", 7)
    assert codec.check_hello(ok, "core") is ok
    with pytest.raises(CodecError, match=rf"version mismatch.*version {CONTRACT_VERSION}.*"
                                         rf"speaks {CONTRACT_VERSION + 1}"):
        codec.check_hello(Hello(CONTRACT_VERSION + 1, "core", 7), "core")
    with pytest.raises(CodecError, match="expected a frontend"):
        codec.check_hello(ok, "frontend")
    with pytest.raises(CodecError, match="Hello frame first"):
        codec.check_hello(Abort("x"), "core")


def test_frames_cross_a_socket_whole_and_a_cut_frame_is_an_error():
    a, b = socket.socketpair()
    with a, b:
        msgs = [Admitted("x"), Outputs([TokenDelta("x", 0, "hi", [5])], StepReport(step_s=0.1))]
        for m in msgs:
            a.sendall(codec.frame(m))
        assert [recv_frame(b, codec.core_decoder) for _ in msgs] == msgs
        data = codec.frame(Fatal("bye"))
        a.sendall(data[:-2])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(CodecError, match="inside a frame"):
            recv_frame(b, codec.core_decoder)
