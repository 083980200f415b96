"""`servelm serve --config FILE.yaml` and `servelm config show`, at the parse level (no
model is loaded), plus one `serve` that reaches the engine build with the file's model."""

from __future__ import annotations

import argparse

import pytest
import yaml

from servelm.cli import build_parser, main
from servelm.serve import config_file
from servelm.serve.config_file import TOPOLOGY_KEYS, serve_options, serve_parser

_NOT_OPTIONS = ("func", "command", "verbose", "config", "option_sources", "config_command")


def _write(tmp_path, text: str, name: str = "serve.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _serve_args(argv: list[str]) -> argparse.Namespace:
    """The options `servelm serve ARGV` runs with, as main() hands them to the handler."""
    argv = ["serve", *argv]
    args = build_parser(argv).parse_args(argv)
    return config_file.with_config_file(args, argv)


def _options(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k not in _NOT_OPTIONS}


def _show(capsys, argv: list[str]) -> str:
    assert main(["config", "show", *argv]) == 0
    return capsys.readouterr().out


def _error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        _serve_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_file_values_under_command_line_flags(tmp_path):
    path = _write(tmp_path, "port: 9001\nmax_n: 3\nmax-queue: 7\n"
                            "no-prefix-cache: true\nlog-requests: false\n")
    defaults = _serve_args([])
    args = _serve_args(["--port", "9002", "--config", path, "--max-queue", "1024"])
    assert args.port == 9002  # the command line wins, before or after --config
    assert args.max_queue == 1024  # even when it gives the default's value
    assert args.max_n == 3 and args.enable_prefix_caching is False and args.log_requests is False
    assert args.max_body_bytes == defaults.max_body_bytes
    assert _serve_args(["--config", path]).port == 9001


def test_bad_value_gets_the_flags_error_naming_key_and_file(tmp_path, capsys):
    path = _write(tmp_path, "port: abc\n")
    err = _error(capsys, ["--config", path])
    assert f"{path}: port: invalid int value: 'abc'" in err
    path = _write(tmp_path, "reasoning-parser: nope\n", "choice.yaml")
    err = _error(capsys, ["--config", path])
    assert f"{path}: reasoning-parser: invalid choice: 'nope'" in err
    path = _write(tmp_path, "cuda-graphs: maybe\n", "bool.yaml")
    assert "cuda-graphs: expected true or false" in _error(capsys, ["--config", path])


def test_unknown_key_is_refused_with_a_suggestion(tmp_path, capsys):
    path = _write(tmp_path, "max_queu: 3\n")
    err = _error(capsys, ["--config", path])
    assert f"{path}: max-queu: unknown key (did you mean 'max-queue'?)" in err
    path = _write(tmp_path, "zzzz: 1\n", "far.yaml")
    assert "zzzz: unknown key\n" in _error(capsys, ["--config", path])


def test_topology_section(tmp_path, capsys):
    path = _write(tmp_path, "topology:\n  tensor-parallel-size: 2\n  data_parallel_size: 3\n"
                            "  role: prefill\n  enable-expert-parallel: true\n")
    args = _serve_args(["--config", path])
    assert (args.tensor_parallel_size, args.data_parallel_size) == (2, 3)
    assert args.disagg_role == "prefill" and args.enable_expert_parallel is True
    # One place per key: topology options only under topology:, the others only outside it.
    path = _write(tmp_path, "tensor-parallel-size: 2\n", "top.yaml")
    assert "tensor-parallel-size: a topology option, which belongs under `topology:`" \
        in _error(capsys, ["--config", path])
    path = _write(tmp_path, "topology:\n  port: 1\n", "under.yaml")
    assert "port: a serve option, which belongs at the top level" \
        in _error(capsys, ["--config", path])


def test_every_serve_flag_is_a_key():
    parser = serve_parser()
    options = serve_options(parser)
    keyed = {o.action.dest for o in options.values()}
    flags = {a.dest for a in parser._actions if a.help != argparse.SUPPRESS} - {"help", "config"}
    assert flags == keyed
    assert set(TOPOLOGY_KEYS) <= set(options)  # a renamed topology flag fails here
    assert options["threads"].action.dest == "num_threads"  # keys are flag names, not dests


def test_config_show_sources_and_round_trip(tmp_path, capsys):
    path = _write(tmp_path, "model: some/model\nmax-n: 3\nallowed-image-hosts: a.com,B.org\n"
                            "lora: [x=/tmp/x]\nno-chunked-prefill: true\n"
                            "topology:\n  tensor-parallel-size: 2\n")
    out = _show(capsys, ["--config", path, "--port", "9100", "--no-log-requests"])
    lines = out.splitlines()
    assert "port: 9100  # command line" in lines
    assert "log-requests: false  # command line" in lines
    assert "max-n: 3  # file" in lines and "host: 127.0.0.1  # default" in lines
    assert "  tensor-parallel-size: 2  # file" in lines
    shown = _write(tmp_path, out, "shown.yaml")
    again = _serve_args(["--config", shown])
    assert _options(again) == _options(_serve_args(["--config", path, "--port", "9100",
                                                    "--no-log-requests"]))
    assert again.allowed_image_hosts == ("a.com", "b.org")
    assert again.lora_modules == ["x=/tmp/x"]
    assert again.enable_chunked_prefill is False
    assert yaml.safe_load(_show(capsys, ["--config", shown])) == yaml.safe_load(out)
    assert yaml.safe_load(out)["topology"]["role"] == "colocated"


def test_serve_with_a_config_file_reaches_the_engine_build(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SERVELM_HOME", str(tmp_path))
    missing = str(tmp_path / "model-from-the-file")
    path = _write(tmp_path, f"model: {missing}\nport: 0\n"
                            f"state-store: sqlite:///{tmp_path}/s.db\n"
                            "topology:\n  engine-core: thread\n")
    assert main(["serve", "--config", path]) == 2
    assert f"cannot load model '{missing}'" in capsys.readouterr().err


def test_a_files_flags_count_as_given_for_the_ray_replica_shape(tmp_path):
    from servelm.router.ray_backend import ReplicaShape

    path = _write(tmp_path, "topology:\n  tensor-parallel-size: 2\n  backend: ray\n"
                            "  parallel-launcher: process\n")
    args = _serve_args(["--config", path])
    assert set(config_file.file_flags(args)) == {"--backend", "--tensor-parallel-size",
                                                 "--parallel-launcher"}
    # An explicit process launcher keeps a replica's ranks its own processes, file or flag.
    shape = ReplicaShape.from_args(args, config_file.file_flags(args))
    assert shape.is_grouped is False
    assert ReplicaShape.from_args(args, []).is_grouped is True


def test_config_show_hides_the_api_key_unless_asked(capsys):
    out = _show(capsys, ["--api-key", "sk-secret-1"])
    assert "sk-secret-1" not in out
    assert "api-key: null  # command line; set, hidden (--show-secrets prints it)" in \
        out.splitlines()
    assert "api-key: sk-secret-1  # command line" in \
        _show(capsys, ["--api-key", "sk-secret-1", "--show-secrets"]).splitlines()
