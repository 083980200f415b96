"""The GGUF-built tokenizer against transformers' conversion of the same GGUF vocabulary.

Known divergence: SmolLM2's original tokenizer.json (and llama.cpp's "smollm" pre-tokenizer)
isolates every numeric character (`Digits(individual_digits=True)`) before GPT-2's split;
transformers' GGUF conversion has no "smollm" entry and uses GPT-2's split alone. The vocabulary
has no merges involving ASCII digits, so the two agree on ASCII digits, but not on other numeric
characters (`²`, `½`, `①`) after a space, where GPT-2's split keeps ` ²` as one piece. For
those texts we check the rule itself: our ids equal transformers' ids for each piece that
`Digits` produces, concatenated.
"""

import pytest
from tokenizers import pre_tokenizers

TEXTS = [
    "Hello world",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # recursion\n\n\tpass",
    "I'm HERE, you'RE there; they'll've WON'T it's",
    "数学 日本語の文章 한국어 中文标点，句号。",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "   leading and trailing   ",
    "a\n\n\nb\r\n c\t\t d  \n  e",
    "12345 3.14159 1,000,000 x2y3 2024-01-01 0x1F",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>tail<file_sep>",
    "naïve café ﬁ Ω≈ç√∫ \u00a0nbsp",
    "x² H₂O",
    "",
]
DIVERGENT_TEXTS = [" ² ½ ①", "area is 5 m² or ½ acre"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(gguf_tokenizer, reference_tokenizer, text, add_special_tokens):
    ours = gguf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
    ref = reference_tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    assert ours == ref


@pytest.mark.parametrize("text", TEXTS + DIVERGENT_TEXTS)
def test_round_trip_decode(gguf_tokenizer, reference_tokenizer, text):
    ids = gguf_tokenizer.encode(text)
    assert gguf_tokenizer.decode(ids, skip_special_tokens=False) == text
    for skip in (True, False):
        assert gguf_tokenizer.decode(ids, skip_special_tokens=skip) == reference_tokenizer.decode(
            ids, skip_special_tokens=skip
        )


@pytest.mark.parametrize("text", DIVERGENT_TEXTS)
def test_numeric_characters_are_isolated_like_the_original(
    gguf_tokenizer, reference_tokenizer, text
):
    pieces = [p for p, _ in pre_tokenizers.Digits(individual_digits=True).pre_tokenize_str(text)]
    expected = [
        i for p in pieces for i in reference_tokenizer(p, add_special_tokens=False)["input_ids"]
    ]
    assert gguf_tokenizer.encode(text) == expected
    # ...which is where transformers' GGUF conversion parts ways (documented above).
    assert reference_tokenizer(text)["input_ids"] != expected


def test_no_bos_added(gguf_tokenizer):
    # SmolLM2's HF tokenizer adds no BOS; the GGUF's add_bos_token flag agrees.
    assert gguf_tokenizer.encode("hi")[0] != gguf_tokenizer.bos_token_id
    assert gguf_tokenizer.encode("") == []


def test_special_tokens(gguf_tokenizer, reference_tokenizer):
    tok = gguf_tokenizer
    assert tok.vocab_size == len(reference_tokenizer) == 49152
    assert tok.bos_token_id == reference_tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert tok.eos_token_ids == (2, 0)
    assert tok.eos_token_id == reference_tokenizer.eos_token_id
    assert [i for i in range(100) if tok.is_special(i)] == list(range(17))
    assert tok.encode("<|im_end|>") == [2]
    ids = [1, *tok.encode("hello"), 2]
    assert tok.decode(ids) == "hello"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hello<|im_end|>"


def test_convert_ids_to_tokens(gguf_tokenizer, reference_tokenizer):
    ids = gguf_tokenizer.encode("Hello, world! <|im_end|> 😀")
    assert gguf_tokenizer.convert_ids_to_tokens(ids) == reference_tokenizer.convert_ids_to_tokens(
        ids
    )
    assert "Ġworld" in gguf_tokenizer.convert_ids_to_tokens(ids)


def test_all_token_ids_below_vocab_size(gguf_tokenizer):
    ids = gguf_tokenizer.encode(" ".join(TEXTS + DIVERGENT_TEXTS))
    assert ids and max(ids) < gguf_tokenizer.vocab_size
