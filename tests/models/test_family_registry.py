"""Families register themselves: each class in a servelm/models module with a `family` name
of its own is found by that name (ModelConfig.architecture), so a new family is one new file
plus its tests; a name claimed twice, or one no module claims, is an error naming it."""

import sys

import pytest

import servelm.models as models
from servelm.models import families, get_model_class
from servelm.models.decoder import DecoderLM

KNOWN = {"llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2",
         "gemma3_text", "phi3", "deepseek_v2", "deepseek_v3", "qwen2_vl", "llava"}


def test_every_family_is_found_by_its_own_name():
    found = families()
    assert set(found) == KNOWN
    for name, cls in found.items():
        assert vars(cls)["family"] == name and get_model_class(name) is cls
        assert cls.__module__.startswith("servelm.models.")


def test_an_unknown_architecture_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match=r"'falcon' is not supported.*'gemma2'"):
        get_model_class("falcon")


def _with_module(monkeypatch, tmp_path, source: str):
    """A family module dropped into the package (a new file), the registry rebuilt."""
    (tmp_path / "zz_new_family.py").write_text(source)
    monkeypatch.setattr(models, "__path__", [*models.__path__, str(tmp_path)])
    monkeypatch.setattr(models, "_registry", None)
    monkeypatch.delitem(sys.modules, "servelm.models.zz_new_family", raising=False)


def test_a_new_module_registers_its_family(monkeypatch, tmp_path):
    _with_module(monkeypatch, tmp_path, (
        "from servelm.models.llama import LlamaForCausalLM\n\n\n"
        "class FalconishForCausalLM(LlamaForCausalLM):\n"
        "    family = 'falconish'\n"))
    cls = get_model_class("falconish")
    assert cls.__name__ == "FalconishForCausalLM" and issubclass(cls, DecoderLM)
    assert get_model_class("llama") is not cls


def test_a_name_claimed_twice_is_an_error(monkeypatch, tmp_path):
    _with_module(monkeypatch, tmp_path, (
        "from servelm.models.decoder import DecoderLM\n\n\n"
        "class Another(DecoderLM):\n"
        "    family = 'llama'\n"))
    with pytest.raises(ValueError, match="'llama' is defined twice"):
        families()
