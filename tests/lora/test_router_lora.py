"""`servelm router` passes adapter names through as model names: the openai client through
the router reaches a replica's adapter, /v1/models lists it, an unknown name comes back as
the replica's 404 model_not_found (model-free replica engines)."""

import sys
from pathlib import Path

import openai
import pytest
from conftest import save_adapter

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS / "router"))
from fake_runner import FakeRunner  # noqa: E402
from test_router import _Uvicorn, _port, _router  # noqa: E402


@pytest.fixture
def fleet(base_hf, tmp_path):
    from servelm.config import ModelConfig, SchedulerConfig
    from servelm.engine.block_manager import BlockManager
    from servelm.engine.engine import Engine
    from servelm.lora.slots import LoraSlots
    from servelm.server.app import ServerConfig, build_app

    save_adapter(base_hf, tmp_path / "a0", r=2, targets=["q_proj"])
    loras = LoraSlots(2, 8, ModelConfig.from_hf_config(base_hf.config.to_dict()))
    loras.register("a0", str(tmp_path / "a0"))
    engine = Engine(FakeRunner(block_size=4), None, BlockManager(256, 4, False),
                    SchedulerConfig(64, 8, True), 512, 1000, (1,), loras=loras)
    replica = _Uvicorn(build_app(engine, ServerConfig(served_model_name="fake")), _port())
    router = _router([replica.url])
    yield router, loras
    router.stop()
    replica.stop()


def test_adapter_names_pass_through_the_router(fleet):
    router, loras = fleet
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused")
    out = client.completions.create(model="a0", prompt=[5, 6, 7], max_tokens=4,
                                    temperature=0)
    assert out.model == "a0" and out.usage.completion_tokens == 4
    assert loras.num_loads == 1  # the replica's engine put a0 in a slot for it
    models = {m.id: m for m in client.models.list().data}
    assert models["a0"].model_extra["parent"] == "fake"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="a9", prompt=[5, 6], max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
