"""resolve_model: names, paths, and errors that name `model`."""

import pytest

from servelm.loader import ModelNotFoundError, resolve_model
from servelm.protocol import InvalidParameterError


def test_registry_name_resolves_to_cached_gguf(default_model_path):
    source = resolve_model("smollm2-135m-instruct")
    assert source == ("gguf", default_model_path, "smollm2-135m-instruct")


def test_gguf_path(default_model_path):
    source = resolve_model(str(default_model_path))
    assert source.kind == "gguf" and source.path == default_model_path
    assert source.name == "SmolLM2-135M-Instruct.Q4_1"


def test_known_but_not_pulled_says_how_to_pull(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELM_HOME", str(tmp_path))
    with pytest.raises(
        ModelNotFoundError, match="servelm models pull smollm2-135m-instruct"
    ) as err:
        resolve_model("smollm2-135m-instruct")
    assert err.value.param == "model"


@pytest.mark.parametrize("kind", ["missing", "empty_dir", "not_gguf", "empty_string"])
def test_errors_name_model(tmp_path, kind):
    target = {
        "missing": str(tmp_path / "nope"),
        "empty_dir": str(tmp_path),
        "not_gguf": str(tmp_path / "fake.gguf"),
        "empty_string": "",
    }[kind]
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model(target)
    assert isinstance(err.value, InvalidParameterError) and isinstance(err.value, ValueError)
    assert err.value.param == "model"
    if kind != "empty_string":
        assert target in str(err.value) and ".gguf" in str(err.value)
