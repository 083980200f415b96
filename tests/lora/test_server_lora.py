"""LoRA through `servelm serve`'s app and the engine core process, with the official openai
client, on the default model: adapters listed by /v1/models with their parent, addressed by
name, loaded and unloaded at run time behind the API key (crossing the codec), refused with
the OpenAI error shape, and in-flight requests undisturbed by a refused load."""

import json
import shutil
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from live_server import MODEL, LiveServer  # noqa: E402

pytestmark = pytest.mark.slow  # the default model in a core process: ~1-2 min on 2 cores

KEY = "lora-test-key"
PROMPT = "The three most useful things to pack for a week of hiking are"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, default_model_path):
    from servelm.bench.lora_adapters import write_random_adapter
    from servelm.loader import load_model_config, resolve_model

    config = load_model_config(resolve_model(MODEL))
    root = tmp_path_factory.mktemp("http_adapters")
    for i, targets in enumerate([("q_proj", "v_proj"), ("o_proj", "down_proj", "up_proj"),
                                 ("k_proj", "gate_proj")]):
        write_random_adapter(str(root / f"a{i}"), config, rank=8, targets=targets, seed=i,
                             scale=0.06)
    bad = root / "dora"
    shutil.copytree(root / "a0", bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    return root


@pytest.fixture(scope="module")
def server(adapters):
    from servelm.config import EngineArgs
    from servelm.core_process.client import CoreClient
    from servelm.loader import load_tokenizer, resolve_model

    args = EngineArgs(model=MODEL, kv_cache_memory=64 * 2**20, max_loras=1,
                      lora_modules=(f"a0={adapters / 'a0'}", f"a1={adapters / 'a1'}"))
    client = CoreClient.spawn(args, load_tokenizer(resolve_model(MODEL)))
    s = LiveServer(client, api_key=KEY)
    yield s
    s.stop()


def _complete(oai, model, max_tokens=12):
    out = oai.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                 temperature=0)
    assert out.model == model
    return out.choices[0].text


def test_adapters_are_models_through_the_core_process(server, adapters):
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    models = {m.id: m for m in oai.models.list().data}
    assert set(models) == {MODEL, "a0", "a1"}
    assert models["a0"].model_extra["parent"] == MODEL
    base, a0, a1 = (_complete(oai, m) for m in (MODEL, "a0", "a1"))
    assert len({base, a0, a1}) == 3  # each adapter changes the output
    assert _complete(oai, "a0") == a0  # one slot: a1 evicted a0, loaded again, same output
    with pytest.raises(openai.NotFoundError) as info:
        _complete(oai, "a9")
    assert info.value.body["code"] == "model_not_found"
    assert info.value.body["param"] == "model"
    chat = oai.chat.completions.create(model="a1", max_tokens=4, temperature=0,
                                       messages=[{"role": "user", "content": "hi"}])
    assert chat.model == "a1"
    metrics = httpx.get(server.url + "/metrics",
                        headers={"Authorization": f"Bearer {KEY}"}).text
    assert 'servelm_lora_requests_total{adapter="a0"} 2.0' in metrics
    assert "servelm_lora_evictions_total" in metrics
    evictions = [line for line in metrics.splitlines()
                 if line.startswith("servelm_lora_evictions_total ")]
    assert evictions and float(evictions[0].split()[1]) >= 2


def test_load_and_unload_at_run_time(server, adapters):
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    body = {"lora_name": "a2", "lora_path": str(adapters / "a2")}
    assert httpx.post(server.url + "/v1/load_lora_adapter", json=body).status_code == 401
    with server.client() as http:
        r = http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 200, r.text
        assert "a2" in {m.id for m in oai.models.list().data}
        a2 = _complete(oai, "a2")
        assert a2 != _complete(oai, MODEL)
        again = http.post("/v1/load_lora_adapter", json=body)
        assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
        missing = http.post("/v1/load_lora_adapter", json={"lora_name": "x"})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert r.status_code == 200, r.text
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        _complete(oai, "a2")


def test_a_refused_load_leaves_requests_in_flight_alone(server, adapters):
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    want = _complete(oai, "a1", max_tokens=24)
    got, errors = [], []

    def stream():
        try:
            chunks = oai.completions.create(model="a1", prompt=PROMPT, max_tokens=24,
                                            temperature=0, stream=True)
            got.append("".join(c.choices[0].text for c in chunks if c.choices))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    t = threading.Thread(target=stream)
    t.start()
    with server.client() as http:
        bad = http.post("/v1/load_lora_adapter",
                        json={"lora_name": "dora", "lora_path": str(adapters / "dora")})
        wrong = http.post("/v1/load_lora_adapter",
                          json={"lora_name": "w", "lora_path": str(adapters / "nowhere")})
    t.join(120)
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "use_dora" and "use_dora" in \
        bad.json()["error"]["message"]
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "lora_path"
    assert not errors and got == [want]
