"""The LoRA parts of the wire format survive a round trip (servelm/core/codec.py)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from servelm.config import EngineArgs
from servelm.core import codec
from servelm.core.codec import AddRequest, LoadLora, LoraResult, Start, UnloadLora
from servelm.core.contract import (LoraAdapterRef, LoraDeltas, NewSequence, ScheduledSequence,
                                   StepDescription, StepReport)
from servelm.protocol import EngineRequest, SamplingParams

names = st.text(min_size=1, max_size=12)
small = st.integers(0, 10_000)


def _round_trip(msg, decoder):
    data = codec.frame(msg)
    return decoder.decode(data[codec.HEADER_BYTES:])


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.builds(LoadLora, small, names, names), st.builds(UnloadLora, small, names)))
def test_lora_commands_round_trip(msg):
    assert _round_trip(msg, codec.frontend_decoder) == msg


@settings(max_examples=60, deadline=None)
@given(st.builds(LoraResult, small, st.lists(names, max_size=4), st.none() | names,
                 st.none() | names, st.none() | names))
def test_lora_results_round_trip(msg):
    assert _round_trip(msg, codec.core_decoder) == msg


@settings(max_examples=60, deadline=None)
@given(st.builds(LoraDeltas, st.lists(st.builds(LoraAdapterRef, small, names, names),
                                      max_size=3),
                 st.lists(small, max_size=3), st.dictionaries(small, small, max_size=3)),
       st.none() | small)
def test_steps_carry_adapters(deltas, lora_id):
    seq = ScheduledSequence(1, 0, 3, [1, 2, 3], 0, [4], 0,
                            NewSequence(SamplingParams(max_tokens=4), 3, None, lora_id))
    step = StepDescription(7, [seq], lora=deltas)
    back = codec.step_decoder.decode(codec.encode(step))
    assert back == step and back.seqs[0].new.lora_id == lora_id


def test_requests_args_and_reports_carry_lora_fields():
    req = AddRequest(EngineRequest("r", [1, 2], SamplingParams(max_tokens=2), lora_name="a0"))
    assert _round_trip(req, codec.frontend_decoder).request.lora_name == "a0"
    args = EngineArgs(model="m", lora_modules=["a=/x", "b=/y"], max_loras=3, max_lora_rank=32)
    back = _round_trip(Start(args), codec.frontend_decoder).engine_args
    assert back == args and back.lora_adapters() == [("a", "/x"), ("b", "/y")]
    report = StepReport(lora_num_adapters=3, lora_num_resident=2, lora_num_loads=9,
                        lora_num_evictions=4)
    assert msgspec_round(report) == report


def msgspec_round(obj):
    import msgspec

    return msgspec.msgpack.decode(msgspec.msgpack.encode(obj), type=type(obj))
