"""The KV connector interface on its own: the off connector, and MultiKVConnector's routing
(saves handed back by part, a load plan admitted by the part that made it, reports merged)."""

from __future__ import annotations

import pytest
from fake_runner import make_engine

from servelm.core.contract import KVBlock
from servelm.engine.kv_connector import (KVConnector, MultiKVConnector, NoKVConnector,
                                         combine, find_connector)
from servelm.protocol import EngineRequest, SamplingParams


class Plan:
    def __init__(self, num_blocks: int):
        self.num_blocks, self.is_pending = num_blocks, False


class Recorder(KVConnector):
    """Saves the blocks it is told to, plans a load of `plan_blocks` (None: no plan)."""

    def __init__(self, name: str, saves=(), plan_blocks=None):
        self.name, self.saves, self.plan_blocks = name, list(saves), plan_blocks
        self.saved: list[KVBlock] = []
        self.admitted: list[int] = []
        self.finished: list[int] = []

    def take_saves(self):
        saves, self.saves = self.saves, []
        return saves

    def on_saved(self, saved):
        self.saved.extend(saved)

    def plan_load(self, seq, match):
        return None if self.plan_blocks is None else Plan(self.plan_blocks)

    def on_admitted(self, seq, num_matched_blocks, plan):
        self.admitted.append(seq.seq_id)

    def on_finish(self, seq, status):
        self.finished.append(seq.seq_id)

    def report(self):
        return {f"kv_{self.name}": {"n": 1.0}}


def test_an_engine_without_a_connector_gets_the_no_op_one():
    engine = make_engine()
    assert isinstance(engine.kv_connector, NoKVConnector)
    assert isinstance(engine.scheduler.kv_connector, NoKVConnector)
    assert isinstance(combine([]), NoKVConnector)
    one = Recorder("a")
    assert combine([one]) is one


def test_saved_bytes_go_back_to_the_part_that_asked():
    a, b = Recorder("a", saves=[3, 5]), Recorder("b", saves=[7])
    multi = MultiKVConnector([a, b])
    assert multi.take_saves() == [3, 5, 7]
    multi.on_saved([KVBlock(3, b"x"), KVBlock(5, b"y"), KVBlock(7, b"z")])
    assert [k.block_id for k in a.saved] == [3, 5] and [k.block_id for k in b.saved] == [7]
    assert multi.take_saves() == []
    with pytest.raises(RuntimeError, match="saved blocks"):
        multi.on_saved([KVBlock(9, b"w")])


def test_the_part_that_planned_a_load_is_told_of_the_admission():
    none, planner = Recorder("a"), Recorder("b", plan_blocks=0)
    multi = MultiKVConnector([none, MultiKVConnector([planner])])  # nested: flattened
    assert find_connector(multi, Recorder) is none and len(multi.parts) == 2
    engine = make_engine(prefix_caching=True, kv_connector=multi)
    engine.add_request(EngineRequest("r", [11, 12, 13, 14, 15],
                                     SamplingParams(max_tokens=2, temperature=0.0)))
    while engine.has_unfinished:
        engine.step()
    assert len(planner.admitted) == 1 and none.admitted == []
    assert none.finished == planner.finished == planner.admitted
    assert multi.report() == {"kv_a": {"n": 1.0}, "kv_b": {"n": 1.0}}


def test_two_parts_reporting_the_same_field_is_refused():
    with pytest.raises(RuntimeError, match="kv_a"):
        MultiKVConnector([Recorder("a"), Recorder("a")]).report()
