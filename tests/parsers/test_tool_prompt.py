"""Tools in the prompt: a template that reads `tools` / `tool_calls` gets them as variables;
one that does not gets them written in the tool parser's format."""

from __future__ import annotations

import json

from servelm.loader.chat_template import render_chat_template
from servelm.parsers import get_tool_parser
from servelm.parsers.tool_prompt import tool_prompt

# The shape of Qwen 2.5's template: tools in the system turn, calls as <tool_call> blocks.
QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{%- for tool in tools %}\n"
    "{{ tool | tojson }}{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- if message.tool_calls %}{%- for tc in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
PLAIN = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
         "{{ message['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CHAT = [{"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"sky": "sunny"}', "tool_call_id": "call_1"}]


def _render(template, parser_name="hermes"):
    messages, extra = tool_prompt(template, CHAT, TOOLS, get_tool_parser(parser_name))
    return render_chat_template(template, messages, **extra), extra


def test_a_template_that_reads_tools_gets_them():
    text, extra = _render(QWEN_LIKE)
    assert extra == {"tools": TOOLS}
    assert '{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "You can call these functions" not in text


def test_a_template_that_ignores_tools_gets_them_in_the_parsers_format():
    text, extra = _render(PLAIN)
    assert extra == {}
    assert text.startswith("<|im_start|>system\nYou can call these functions:")
    assert json.dumps(TOOLS[0]["function"]) in text and "<tool_call>" in text
    # the assistant's earlier call is in its content, as the parser reads it back
    assistant = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert get_tool_parser("hermes").parse(assistant)[1][0].name == "get_weather"
    assert '<|im_start|>tool\n{"sky": "sunny"}' in text


def test_other_formats_and_no_tools():
    text, _ = _render(PLAIN, "mistral")
    assert "[TOOL_CALLS]" in text
    messages, extra = tool_prompt(PLAIN, CHAT[:1], None, get_tool_parser("hermes"))
    assert messages == CHAT[:1] and extra == {}
