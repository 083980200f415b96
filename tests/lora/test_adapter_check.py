"""Bad adapters are refused at load with an error naming the field (servelm/lora/adapter.py),
and an engine keeps serving what it had."""

import json
import math

import pytest
from conftest import save_adapter
from tiny_models import make_tiny_engine, make_tiny_hf_model

from servelm.config import ModelConfig
from servelm.llm import LLM
from servelm.lora.adapter import LoraAdapterError, read_adapter
from servelm.protocol import InvalidParameterError, SamplingParams


@pytest.fixture(scope="module")
def good(base_hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "ad"
    save_adapter(base_hf, path, r=8, targets=["q_proj", "k_proj", "up_proj"], alpha=16)
    return path


@pytest.fixture(scope="module")
def config(base_hf):
    return ModelConfig.from_hf_config(base_hf.config.to_dict())


def _edit_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_good_adapter_is_mapped_onto_fused_slices(good, config):
    spec = read_adapter(str(good), config, 16)
    assert spec.rank == 8 and spec.scaling == 2.0
    assert set(spec.targets) == {(layer, lin, s) for layer in range(2)
                                 for lin, s in [("qkv_proj", 0), ("qkv_proj", 1),
                                                ("gate_up_proj", 1)]}
    assert spec.target_modules == ["k_proj", "q_proj", "up_proj"]


def test_rslora_scaling(good, config, tmp_path):
    path = _edit_config(good, tmp_path / "rs", use_rslora=True)
    assert read_adapter(str(path), config, 16).scaling == pytest.approx(16 / math.sqrt(8))


@pytest.mark.parametrize("field,value", [
    ("use_dora", True), ("bias", "all"), ("modules_to_save", ["lm_head"]),
    ("fan_in_fan_out", True), ("rank_pattern", {"q_proj": 4}), ("peft_type", "IA3"),
    ("lora_bias", True), ("target_modules", ["embed_tokens", "q_proj"]),
])
def test_unsupported_fields_are_refused_by_name(good, config, tmp_path, field, value):
    path = _edit_config(good, tmp_path / "bad", **{field: value})
    with pytest.raises(LoraAdapterError, match=field) as info:
        read_adapter(str(path), config, 16)
    assert info.value.param == field


def test_rank_above_max_is_refused(good, config):
    with pytest.raises(LoraAdapterError, match="max-lora-rank 4") as info:
        read_adapter(str(good), config, 4)
    assert info.value.param == "r"


def test_corrupt_and_missing_files(good, config, tmp_path):
    import shutil

    bad = tmp_path / "corrupt"
    shutil.copytree(good, bad)
    data = (bad / "adapter_model.safetensors").read_bytes()
    (bad / "adapter_model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(LoraAdapterError, match="not a valid safetensors") as info:
        read_adapter(str(bad), config, 16)
    assert info.value.param == "adapter_model.safetensors"
    (bad / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(LoraAdapterError, match="not a valid safetensors"):
        read_adapter(str(bad), config, 16)
    (bad / "adapter_model.safetensors").unlink()
    (bad / "adapter_model.safetensors").mkdir()  # unreadable as a file
    with pytest.raises(LoraAdapterError, match="cannot be read"):
        read_adapter(str(bad), config, 16)
    (bad / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraAdapterError, match="not valid JSON"):
        read_adapter(str(bad), config, 16)
    with pytest.raises(LoraAdapterError, match="not a directory") as info:
        read_adapter(str(tmp_path / "nowhere"), config, 16)
    assert info.value.param == "lora_path"


def test_wrong_base_shape_and_unknown_target(base_hf, config, tmp_path):
    wider = make_tiny_hf_model("llama", seed=3, hidden_size=96)
    save_adapter(wider, tmp_path / "wide", r=4)
    with pytest.raises(LoraAdapterError, match="another base model") as info:
        read_adapter(str(tmp_path / "wide"), config, 16)
    assert info.value.param == "lora_path"
    save_adapter(base_hf, tmp_path / "head", r=4, targets=["q_proj", "lm_head"])
    with pytest.raises(LoraAdapterError, match="lm_head"):
        read_adapter(str(tmp_path / "head"), config, 16)
    deeper = make_tiny_hf_model("llama", seed=3, num_hidden_layers=3)
    save_adapter(deeper, tmp_path / "deep", r=4)
    with pytest.raises(LoraAdapterError, match="layer 2 is beyond"):
        read_adapter(str(tmp_path / "deep"), config, 16)


def test_dora_tensors_are_refused(base_hf, config, tmp_path):
    from peft import LoraConfig, get_peft_model
    import copy

    model = get_peft_model(copy.deepcopy(base_hf), LoraConfig(r=4, target_modules=["q_proj"],
                                                              use_dora=True))
    model.save_pretrained(str(tmp_path / "dora"))
    with pytest.raises(LoraAdapterError, match="use_dora"):
        read_adapter(str(tmp_path / "dora"), config, 16)


def test_bad_load_leaves_the_engine_serving(base_hf, good, tmp_path):
    engine = make_tiny_engine(base_hf, lora_modules=(f"good={good}",), max_loras=1)
    llm = LLM(engine=engine)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    want = llm.generate([[1, 2, 3]], greedy, lora="good", use_tqdm=False)[0].outputs[0]
    bad = _edit_config(good, tmp_path / "dora", use_dora=True)
    with pytest.raises(LoraAdapterError, match="use_dora"):
        llm.load_lora("dora", str(bad))
    with pytest.raises(InvalidParameterError, match="already loaded") as info:
        llm.load_lora("good", str(good))
    assert info.value.param == "lora_name"
    with pytest.raises(InvalidParameterError, match="does not exist") as info:
        llm.generate([[1, 2, 3]], greedy, lora="nope", use_tqdm=False)
    assert info.value.code == "model_not_found"
    assert engine.lora_names() == ["good"]
    again = llm.generate([[1, 2, 3]], greedy, lora="good", use_tqdm=False)[0].outputs[0]
    assert again.token_ids == want.token_ids
