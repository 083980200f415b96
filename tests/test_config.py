"""The flags take their defaults from the dataclasses (EngineArgs, ServerConfig), and the
default model is named in one place."""

from __future__ import annotations

import argparse
import dataclasses

from servelm.config import EngineArgs, add_engine_cli_args, engine_args_from_cli


def test_engine_flags_default_to_engine_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    add_engine_cli_args(parser)
    assert engine_args_from_cli(parser.parse_args(["m"])) == EngineArgs(model="m")


def test_serve_flags_default_to_server_config_and_engine_args():
    from servelm.cli import build_parser
    from servelm.loader.model_cache import DEFAULT_MODEL, REGISTRY
    from servelm.server.server_config import ServerConfig

    args = build_parser().parse_args(["serve"])
    assert args.model == DEFAULT_MODEL and DEFAULT_MODEL in REGISTRY
    for f in dataclasses.fields(ServerConfig):
        if hasattr(args, f.name):
            assert getattr(args, f.name) in (f.default, None), f.name
    assert engine_args_from_cli(args) == EngineArgs(model=DEFAULT_MODEL)


def test_every_command_defaults_to_the_one_default_model():
    from servelm.cli import build_parser
    from servelm.loader.model_cache import DEFAULT_MODEL

    parser = build_parser()
    for argv in (["chat"], ["bench", "offline"], ["bench", "spec"]):
        assert parser.parse_args(argv).model == DEFAULT_MODEL, argv
