"""Fixtures of the HTTP tests: the default model loaded once per session, one live server
per test module (see live_server.py)."""

from __future__ import annotations

import pytest

from live_server import MODEL, LiveServer


@pytest.fixture(scope="session")
def engine(default_model_path):
    from servelm.config import EngineArgs
    from servelm.engine_builder import build_engine

    # float32: the limits, costs and logprobs these tests check are float32's (a bfloat16
    # pool holds twice the tokens in the same bytes)
    return build_engine(EngineArgs(model=MODEL, kv_cache_memory=192 * 2**20, max_num_seqs=64,
                                   dtype="float32"))


@pytest.fixture(scope="module")
def server(engine):
    s = LiveServer(engine)
    yield s
    s.stop()
