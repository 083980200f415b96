"""SentencePiece GGUF vocabularies (tokenizer.ggml.model == "llama"), against transformers.

A tiny Llama-2-style vocabulary (scores, no merges, `<0xNN>` byte tokens) is written with
GGUFWriter; transformers' own GGUF conversion of the same file is the reference.
"""

import gguf
import pytest

from servelm.loader import load_tokenizer, resolve_model

PIECES = [
    "▁",
    "t",
    "h",
    "e",
    "l",
    "o",
    "w",
    "r",
    "d",
    "x",
    "▁t",
    "he",
    "▁the",
    "ll",
    "▁he",
    "llo",
    "▁hello",
    "▁w",
    "or",
    "▁wor",
    "ld",
    "▁world",
    "数",
    "▁x",
    # "abc" can merge as a+bc or ab+c: only the score order decides (bc scores higher).
    "a",
    "b",
    "c",
    "bc",
    "ab",
]
TEXTS = [
    "hello world",
    "the  hello",
    " leading space",
    "数学 x",
    "<s>hello</s> world",
    "line\n\ttab",
    "héllo wörld",
    "<think>the",
    "abc cab",
    "",
]


def _write_spm_gguf(path, add_bos=None):
    tokens = ["<unk>", "<s>", "</s>", "<think>"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    types = [2, 3, 3, 4] + [6] * 256 + [1] * len(PIECES)
    scores = [0.0] * (4 + 256) + [-float(i) for i in range(len(PIECES))]
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("spm") / "tiny-spm.gguf"
    _write_spm_gguf(path)
    ours = load_tokenizer(resolve_model(str(path)))
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ours, ref


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(spm, text, add_special_tokens):
    ours, ref = spm
    expected = ref(text, add_special_tokens=add_special_tokens)["input_ids"]
    assert ours.encode(text, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(spm, text):
    ours, ref = spm
    ids = ours.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
            ids, skip_special_tokens=skip
        )


def test_bos_byte_fallback_and_specials(spm):
    ours, _ = spm
    ids = ours.encode("héllo")
    # BOS by default for SentencePiece; é is not in the vocabulary, so its two UTF-8 bytes.
    assert ids[0] == 1
    assert ours.convert_ids_to_tokens(ids)[1:5] == ["▁", "h", "<0xC3>", "<0xA9>"]
    assert ours.decode(ids) == "héllo"
    assert ours.is_special(0) and ours.is_special(1) and not ours.is_special(3)
    assert ours.eos_token_ids == (2,)


def test_merge_order_follows_scores(spm):
    ours, _ = spm
    assert ours.convert_ids_to_tokens(ours.encode("abc", add_special_tokens=False)) == [
        "▁",
        "a",
        "bc",
    ]


def test_add_bos_flag_is_honoured(tmp_path):
    path = tmp_path / "nobos.gguf"
    _write_spm_gguf(path, add_bos=False)
    assert load_tokenizer(resolve_model(str(path))).encode("hello") == [
        4 + 256 + PIECES.index("▁hello")
    ]
