"""Hub names and file choice: `ORG/NAME[:TAG][@REVISION]` parsed, and which files of a
repository listing are fetched for safetensors and for GGUF."""

import pytest

from servelm.loader import ModelNotFoundError
from servelm.loader.hub_ref import (
    HubFiles,
    HubModelError,
    HubRef,
    looks_like_hub_name,
    parse_hub_name,
    select_hub_files,
)
from servelm.protocol import InvalidParameterError


@pytest.mark.parametrize("name, ref", [
    ("org/name", HubRef("org/name", None, None)),
    ("Org-1/Name_2.5", HubRef("Org-1/Name_2.5", None, None)),
    ("org/name:Q4_K_M", HubRef("org/name", "Q4_K_M", None)),
    ("org/name:q8_0", HubRef("org/name", "q8_0", None)),
    ("org/name:UD-Q4_K_XL", HubRef("org/name", "UD-Q4_K_XL", None)),
    ("org/name:model.Q4_1.gguf", HubRef("org/name", "model.Q4_1.gguf", None)),
    ("org/name:Q4_K_M/part.gguf", HubRef("org/name", "Q4_K_M/part.gguf", None)),
    ("org/name@main", HubRef("org/name", None, "main")),
    ("org/name@refs/pr/1", HubRef("org/name", None, "refs/pr/1")),
    ("org/name:Q4_1@v1.0", HubRef("org/name", "Q4_1", "v1.0")),
    ("org/name@" + "a" * 40, HubRef("org/name", None, "a" * 40)),
])
def test_parse(name, ref):
    assert looks_like_hub_name(name)
    assert parse_hub_name(name) == ref


@pytest.mark.parametrize("name", [
    "smollm2-135m-instruct", "/abs/org/name", "./org/name", "~/org/name", "a/b/c",
    "model.gguf", "org\\name/x",
])
def test_paths_and_plain_names_are_not_hub_names(name):
    assert not looks_like_hub_name(name)


@pytest.mark.parametrize("name, says", [
    ("org/", "not a Hugging Face repository id"),
    ("/name", "not a Hugging Face repository id"),
    ("org/na me", "not a Hugging Face repository id"),
    ("org/-name", "not a Hugging Face repository id"),
    ("org/na--me", "not a Hugging Face repository id"),
    ("org/na..me", "not a Hugging Face repository id"),
    ("org/name.git", "not a Hugging Face repository id"),
    ("org/" + "n" * 97, "not a Hugging Face repository id"),
    ("org/name:", "empty tag"),
    ("org/name@", "empty revision"),
    ("org/name@main:Q4_K_M", "put the tag before it"),
    ("org/name:Q4 K", "neither a quantization"),
    ("org/name:!x", "neither a quantization"),
])
def test_invalid_names_say_why_and_name_model(name, says):
    with pytest.raises(HubModelError, match=says) as err:
        parse_hub_name(name)
    e = err.value
    assert isinstance(e, ModelNotFoundError) and isinstance(e, InvalidParameterError)
    assert isinstance(e, ValueError) and e.param == "model"
    assert repr(name) in str(e) and "\n" not in str(e)


SAFETENSORS_REPO = [
    ".gitattributes", "README.md", "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "chat_template.jinja", "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors", "model.safetensors.index.json",
    "consolidated.safetensors", "params.json", "pytorch_model.bin", "original/consolidated.00.pth",
    "onnx/model.onnx", "images/logo.png",
]


def _select(files, name="org/name"):
    return select_hub_files(files, parse_hub_name(name), name)


def test_safetensors_repo_fetches_config_tokenizer_and_shards_only():
    chosen = _select(SAFETENSORS_REPO)
    assert chosen.format == "safetensors"
    assert set(chosen.files) == {
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "chat_template.jinja", "model.safetensors.index.json",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "consolidated.safetensors",  # until the index is read: see the next test
    }


def test_an_autogptq_repo_fetches_its_quantize_config():
    """Older AutoGPTQ repositories keep the GPTQ settings in quantize_config.json."""
    chosen = _select(["config.json", "quantize_config.json", "tokenizer.json",
                      "model.safetensors", "README.md"])
    assert set(chosen.files) == {"config.json", "quantize_config.json", "tokenizer.json",
                                 "model.safetensors"}


def test_index_narrows_to_its_shards():
    chosen = _select(SAFETENSORS_REPO)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}
    weights = [f for f in chosen.with_index(index).files if f.endswith(".safetensors")]
    assert weights == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert "config.json" in chosen.with_index(index).files


def test_single_safetensors_file_and_mistral_layout():
    assert _select(["config.json", "model.safetensors", "model.fp16.safetensors"]).files == (
        "config.json", "model.safetensors")
    mistral = ["config.json", "consolidated.safetensors", "a-1.safetensors", "tokenizer.json"]
    assert _select(mistral).files == ("config.json", "tokenizer.json", "a-1.safetensors")


GGUF_REPO = [
    ".gitattributes", "README.md", "mmproj-model-f16.gguf",
    "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_K.gguf",
    "SmolLM2-135M-Instruct.Q4_K_M.gguf", "SmolLM2-135M-Instruct.Q8_0.gguf",
    "smollm2-135m-instruct-f16.gguf",
    "Q6_K/big-Q6_K-00001-of-00002.gguf", "Q6_K/big-Q6_K-00002-of-00002.gguf",
]


@pytest.mark.parametrize("tag, file", [
    ("Q4_1", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ("q4_1", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ("Q4_K", "SmolLM2-135M-Instruct.Q4_K.gguf"),  # not Q4_K_M: '_' continues a tag
    ("Q4_K_M", "SmolLM2-135M-Instruct.Q4_K_M.gguf"),
    ("F16", "smollm2-135m-instruct-f16.gguf"),
    ("SmolLM2-135M-Instruct.Q8_0.gguf", "SmolLM2-135M-Instruct.Q8_0.gguf"),
    ("smollm2-135m-instruct.q8_0.gguf", "SmolLM2-135M-Instruct.Q8_0.gguf"),
])
def test_tag_picks_one_gguf_file(tag, file):
    assert _select(GGUF_REPO, f"org/name:{tag}") == HubFiles("gguf", (file,))


def test_no_tag_gguf_repo_takes_q4_k_m_or_its_only_file():
    assert _select(GGUF_REPO).files == ("SmolLM2-135M-Instruct.Q4_K_M.gguf",)
    assert _select(["README.md", "mmproj-x.gguf", "x.Q5_0.gguf"]).files == ("x.Q5_0.gguf",)


def test_tag_asks_for_gguf_even_beside_safetensors():
    files = SAFETENSORS_REPO + ["model-Q4_1.gguf"]
    assert _select(files, "org/name:Q4_1") == HubFiles("gguf", ("model-Q4_1.gguf",))
    assert _select(files).format == "safetensors"


@pytest.mark.parametrize("name, files, says", [
    ("org/name:Q3_K_S", GGUF_REPO, "no GGUF file of org/name is tagged 'Q3_K_S'"),
    ("org/name:Q6_K", GGUF_REPO, "split into 2 parts"),
    ("org/name:other.gguf", GGUF_REPO, "no single file 'other.gguf'"),
    ("org/name", [f for f in GGUF_REPO if "Q4_K_M" not in f], "none is Q4_K_M"),
    ("org/name:Q4_1", ["a-Q4_1.gguf", "b-Q4_1.gguf"], "matches several GGUF files"),
    ("org/name:Q4_1", SAFETENSORS_REPO, "has no .gguf file"),
])
def test_gguf_choice_errors_list_the_files(name, files, says):
    with pytest.raises(HubModelError, match=says) as err:
        _select(files, name)
    assert err.value.param == "model" and "\n" not in str(err.value)


def test_no_supported_format_lists_what_the_repo_has():
    files = ["README.md", "config.json", "pytorch_model.bin", "tokenizer.json"]
    with pytest.raises(HubModelError) as err:
        _select(files)
    message = str(err.value)
    assert "no weights servelm can serve" in message and "'org/name'" in message
    for f in files:
        assert f in message
    assert err.value.code == "model_format_unsupported"


def test_long_listings_are_cut():
    files = [f"shard_{i:03d}.bin" for i in range(40)]
    with pytest.raises(HubModelError, match="and 28 more"):
        _select(files)
