"""`servelm serve`'s own flags against the config dataclasses they are built from: one flag
per ServerConfig and TopologyConfig field (but the no_flag ones) and one field per flag,
each with its help and group, and the parsed flags giving those configs back."""

from __future__ import annotations

import argparse
import collections
import dataclasses

import pytest

from servelm.config import EngineArgs
from servelm.config.flags import flag_fields, options_from_cli
from servelm.serve.cli import server_config_from_cli
from servelm.serve.config_file import ENGINE_TOPOLOGY_KEYS, TOPOLOGY_KEYS, serve_parser
from servelm.serve.topology import TopologyConfig
from servelm.server.server_config import ServerConfig

# Flags that are no config field: the positional model (EngineArgs.model, each command's
# own), the config file itself, and the replicas' hidden channel.
NOT_FIELDS = {"help", "model", "config", "options_from_stdin"}


def _actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.dest not in NOT_FIELDS]


def _group_of(parser: argparse.ArgumentParser) -> dict[str, str]:
    return {a.dest: g.title for g in parser._action_groups for a in g._group_actions}


def test_every_serve_flag_sets_one_config_field_and_every_field_has_one():
    fields = {f.name for cls in (ServerConfig, TopologyConfig)
              for f, _ in flag_fields(cls)} | {f.name for f in dataclasses.fields(EngineArgs)}
    dests = [a.dest for a in _actions(serve_parser())]
    assert [d for d, n in collections.Counter(dests).items() if n > 1] == []
    assert set(dests) - fields == set()
    assert fields - set(dests) == {"model"}


def test_the_no_flag_fields_are_only_those_code_sets():
    flagged = {f.name for f, _ in flag_fields(ServerConfig)}
    unflagged = {f.name for f in dataclasses.fields(ServerConfig)} - flagged
    assert unflagged == {"retry_after_s", "idempotency_ttl_s", "idempotency_max_entries"}


def test_every_serve_flag_has_help_and_its_group():
    parser = serve_parser()
    group = _group_of(parser)
    assert [a.option_strings[0] for a in _actions(parser) if not a.help] == []
    for cls in (ServerConfig, TopologyConfig):
        for field, flag in flag_fields(cls):
            assert group[field.name] == {"server": "server", "ray": "replicas on Ray"}[
                flag.group], field.name
    assert group["backend"] == "replicas on Ray" and group["engine_core"] == "server"
    assert group["port"] == "server" and group["max_num_seqs"] == "engine"


def test_defaults_give_the_configs_defaults(monkeypatch):
    monkeypatch.delenv("SERVELM_API_KEY", raising=False)
    args = serve_parser().parse_args([])
    assert server_config_from_cli(args, "m") == ServerConfig(served_model_name="m")
    assert options_from_cli(TopologyConfig, args) == TopologyConfig()


def test_flags_reach_the_configs(monkeypatch):
    monkeypatch.setenv("SERVELM_API_KEY", "from-env")
    args = serve_parser().parse_args([
        "--port", "9001", "--allowed-image-hosts", "A.com, b.org", "--no-log-requests",
        "--reasoning-parser", "deepseek_r1", "--peak-flops", "2e12", "--quota-files", "5",
        "--data-parallel-size", "2", "--backend", "ray", "--replica-cpus", "2.5",
        "--engine-core", "thread"])
    config = server_config_from_cli(args, "m")
    assert (config.port, config.allowed_image_hosts, config.log_requests) == \
        (9001, ("a.com", "b.org"), False)
    assert (config.reasoning_parser, config.peak_flops, config.quota_files) == \
        ("deepseek_r1", 2e12, 5)
    assert config.api_key == "from-env" and config.served_model_name == "m"
    assert options_from_cli(TopologyConfig, args) == TopologyConfig(
        data_parallel_size=2, backend="ray", replica_cpus=2.5, engine_core="thread")


def test_a_bad_choice_is_refused_by_the_flag(capsys):
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--engine-core", "fiber"])
    assert "--engine-core: invalid choice: 'fiber'" in capsys.readouterr().err


def test_topology_keys_are_the_topology_configs_flags_and_the_engines():
    options = {s[2:] for a in serve_parser()._actions for s in a.option_strings}
    own = {f.name.replace("_", "-") for f in dataclasses.fields(TopologyConfig)}
    assert set(TOPOLOGY_KEYS) == own | set(ENGINE_TOPOLOGY_KEYS)
    assert set(ENGINE_TOPOLOGY_KEYS) <= options


def test_a_server_config_names_its_model():
    with pytest.raises(ValueError, match="served_model_name"):
        ServerConfig()
