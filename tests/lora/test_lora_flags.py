"""The LoRA engine flags: --lora NAME=PATH (repeatable), --enable-lora, --max-loras,
--max-lora-rank reach EngineArgs; a malformed --lora is refused naming it; engines refuse
LoRA where it cannot work."""

import argparse

import pytest

from servelm.config import EngineArgs, add_engine_cli_args, engine_args_from_cli


def _args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("model")
    add_engine_cli_args(p)
    return engine_args_from_cli(p.parse_args(argv))


def test_flags_reach_engine_args():
    args = _args(["m", "--lora", "sql=/a/sql", "--lora", "chat=/a/chat", "--max-loras", "2",
                  "--max-lora-rank", "64"])
    assert args.lora_modules == ("sql=/a/sql", "chat=/a/chat")
    assert args.lora_adapters() == [("sql", "/a/sql"), ("chat", "/a/chat")]
    assert args.is_lora_enabled and args.max_loras == 2 and args.max_lora_rank == 64
    off = _args(["m"])
    assert off.lora_modules == () and not off.is_lora_enabled
    assert _args(["m", "--enable-lora"]).is_lora_enabled


def test_malformed_lora_flag_is_refused():
    with pytest.raises(ValueError, match="lora: expected name=path"):
        EngineArgs(model="m", lora_modules=("no-path",))


def test_engines_refuse_lora_where_it_cannot_work(base_hf):
    from tiny_models import make_tiny_engine

    from servelm.protocol import InvalidParameterError

    with pytest.raises(InvalidParameterError) as info:
        make_tiny_engine(base_hf, enable_lora=True, speculative_method="ngram")
    assert info.value.param == "speculative_method"
    with pytest.raises(InvalidParameterError) as info:
        make_tiny_engine(base_hf, enable_lora=True, max_loras=0)
    assert info.value.param == "max_loras"
    engine = make_tiny_engine(base_hf)  # LoRA off: naming an adapter is a 404-style error
    from servelm.protocol import EngineRequest, SamplingParams

    with pytest.raises(InvalidParameterError) as info:
        engine.add_request(EngineRequest("r", [1, 2], SamplingParams(max_tokens=2),
                                         lora_name="a0"))
    assert info.value.code == "model_not_found"
