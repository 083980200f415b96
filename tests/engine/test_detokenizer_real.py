"""The incremental detokenizer on the default model's real tokenizer: streamed text equals
the one-shot decode, for emoji, CJK, accents, code and whitespace runs."""

import pytest

from servelm.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! 👋🏽 Family: 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "日本語のテキストと中文混合，还有한국어 텍스트。",
    "naïve café – “quotes” — ½ ² ① ∑ ∫",
    "def f(x):\n\t\treturn   x ** 2  # trailing   spaces   \n\n\n",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from servelm.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("smollm2-135m-instruct"))


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_one_shot_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=[])
    pieces = [detok.add_token(t).text for t in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_inside_multibyte_run(tokenizer):
    text = "before 世界 after"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["界 a"])
    out = ""
    for t in ids:
        m = detok.add_token(t)
        out += m.text
        if m.stopped:
            break
    assert m.stopped and out == "before 世"
