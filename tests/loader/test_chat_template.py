"""Chat template rendering: same prompt as transformers' apply_chat_template; bad input named."""

import pytest

from servelm.loader.chat_template import render_chat_template
from servelm.protocol import InvalidParameterError

CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Tell me a joke"},
        {"role": "assistant", "content": "Why did the GPU cross the bus?"},
        {"role": "user", "content": "Why?  \n  数学 😀"},
    ],
]


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(
    gguf_tokenizer, reference_tokenizer, messages, add_generation_prompt
):
    ours = gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = reference_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == ref
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_default_system_prompt_is_inserted(gguf_tokenizer):
    prompt = gguf_tokenizer.apply_chat_template(CHATS[0])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": [{"type": "text", "text": "parts"}]}],
        [{"role": "", "content": "x"}],
        ["not a dict"],
    ],
)
def test_bad_messages_name_the_parameter(gguf_tokenizer, messages):
    with pytest.raises(InvalidParameterError) as err:
        gguf_tokenizer.apply_chat_template(messages)
    assert err.value.param == "messages"


def test_template_helpers_and_sandbox():
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'tool' %}"
        "{{ raise_exception('tool messages are not supported') }}{% endif %}"
        "{{ m.content | tojson }}{% endfor %}{{ strftime_now('%Y') | length }}"
        "{% if add_generation_prompt %}>{% endif %}{{ eos_token }}"
    )
    out = render_chat_template(
        template, [{"role": "user", "content": 'é"<'}], bos_token="<s>", eos_token="</s>"
    )
    assert out == '<s>"é\\"<"4></s>'
    with pytest.raises(InvalidParameterError, match="tool messages") as err:
        render_chat_template(template, [{"role": "tool", "content": "x"}])
    assert err.value.param == "messages"
    # The sandbox refuses attribute access a template must never have.
    import jinja2.exceptions

    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat_template("{{ messages.__class__.__mro__ }}", [{"role": "u", "content": "x"}])


def test_model_without_template_is_a_named_error(gguf_tokenizer):
    from servelm.loader.tokenizer import Tokenizer

    base = Tokenizer(gguf_tokenizer.backend, bos_token_id=None, eos_token_ids=(0,))
    with pytest.raises(InvalidParameterError, match="no chat template") as err:
        base.apply_chat_template([{"role": "user", "content": "hi"}])
    assert err.value.param == "messages"
