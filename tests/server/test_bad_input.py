"""Bad input gets a 4xx in the OpenAI error shape, and the next good request still works."""

from __future__ import annotations

import json

import pytest

from live_server import MODEL

GOOD = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
JSON = {"Content-Type": "application/json"}


def _c(**kw):
    return ("/v1/completions", json.dumps({**GOOD, **kw}).encode(), JSON)


def _chat(**kw):
    return ("/v1/chat/completions", json.dumps({**CHAT, **kw}).encode(), JSON)


LONG = "hello " * 7000  # more tokens than the context

CASES = {
    # name: ((path, body bytes, headers), status, param, code)
    "context_length": (_c(prompt=LONG), 400, "prompt", "context_length_exceeded"),
    "prompt_plus_max_tokens": (_c(max_tokens=100_000), 400, "max_tokens",
                               "context_length_exceeded"),
    "temperature_negative": (_c(temperature=-1), 400, "temperature", None),
    "temperature_nan": (("/v1/completions", b'{"prompt": "Hi", "temperature": NaN}', JSON),
                        400, "temperature", None),
    "temperature_bool": (_c(temperature=True), 400, "temperature", None),
    "temperature_string": (_c(temperature="0.5"), 400, "temperature", None),
    "top_p_zero": (_c(top_p=0), 400, "top_p", None),
    "top_p_infinity": (("/v1/completions", b'{"prompt": "Hi", "top_p": Infinity}', JSON),
                       400, "top_p", None),
    "min_p_above_one": (_c(min_p=1.5), 400, "min_p", None),
    "top_k_below_minus_one": (_c(top_k=-5), 400, "top_k", None),
    "presence_penalty": (_c(presence_penalty=3), 400, "presence_penalty", None),
    "frequency_penalty": (_c(frequency_penalty=-2.5), 400, "frequency_penalty", None),
    "repetition_penalty": (_c(repetition_penalty=0), 400, "repetition_penalty", None),
    "max_tokens_zero": (_c(max_tokens=0), 400, "max_tokens", None),
    "max_tokens_string": (_c(max_tokens="ten"), 400, "max_tokens", None),
    "n_zero": (_c(n=0), 400, "n", None),
    "n_above_cap": (_c(n=17), 400, "n", None),
    "logprobs_too_many": (_c(logprobs=21), 400, "logprobs", None),
    "top_logprobs_without_logprobs": (_chat(top_logprobs=2), 400, "top_logprobs", None),
    "five_stop_strings": (_c(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
    "overlong_stop": (_c(stop=["x" * 300]), 400, "stop", None),
    "empty_stop": (_c(stop=[""]), 400, "stop", None),
    "seed_below_int64": (_c(seed=-2**63 - 1), 400, "seed", None),
    "seed_above_int64": (_c(seed=2**63), 400, "seed", None),
    "stop_token_id_outside_vocab": (_c(stop_token_ids=[2, 10**9]), 400, "stop_token_ids",
                                    None),
    "chat_stop_token_id_outside_vocab": (_chat(stop_token_ids=[-1]), 400, "stop_token_ids",
                                         None),
    "unknown_role": (_chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages",
                     None),
    "user_message_without_content": (_chat(messages=[{"role": "user"}]), 400, "messages",
                                     None),
    "user_message_null_content": (_chat(messages=[{"role": "user", "content": None}]), 400,
                                  "messages", None),
    "chat_context_length": (_chat(messages=[{"role": "user", "content": LONG}]), 400,
                            "messages", "context_length_exceeded"),
    "chat_top_logprobs_too_many": (_chat(logprobs=True, top_logprobs=21), 400,
                                   "top_logprobs", None),
    "chat_max_completion_tokens_too_long": (_chat(max_completion_tokens=100_000), 400,
                                            "max_completion_tokens",
                                            "context_length_exceeded"),
    "cache_salt_too_long": (_c(cache_salt="s" * 257), 400, "cache_salt",
                            "cache_salt_too_long"),
    "too_many_prompts": (_c(prompt=["Hi"] * 65), 400, "prompt", "too_many_prompts"),
    "too_many_token_id_prompts": (_c(prompt=[[1, 2]] * 65), 400, "prompt",
                                  "too_many_prompts"),
    "too_many_choices": (_c(prompt=["Hi"] * 20, n=16), 400, "n", "too_many_choices"),
    "token_id_outside_vocab": (_c(prompt=[1, 2, 10**9]), 400, "prompt", None),
    "token_id_negative": (_c(prompt=[-1]), 400, "prompt", None),
    "empty_prompt": (_c(prompt=""), 400, "prompt", None),
    "empty_prompt_list": (_c(prompt=[]), 400, "prompt", None),
    "empty_prompt_in_list": (_c(prompt=["Hi", ""]), 400, "prompt", None),
    "prompt_wrong_type": (_c(prompt={"a": 1}), 400, "prompt", None),
    "missing_prompt": (("/v1/completions", b'{"max_tokens": 2}', JSON), 400, "prompt", None),
    "empty_messages": (_chat(messages=[]), 400, "messages", None),
    "message_without_role": (_chat(messages=[{"content": "x"}]), 400, "messages", None),
    "message_image_part": (_chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400,
        "messages[0].content[0]", "images_not_supported"),
    "unknown_model": (_c(model="gpt-5"), 404, "model", "model_not_found"),
    "unknown_model_chat": (_chat(model="nope"), 404, "model", "model_not_found"),
    "malformed_json": (("/v1/completions", b'{"prompt": "Hi",', JSON), 400, None,
                       "invalid_json"),
    "body_is_a_list": (("/v1/completions", b'["Hi"]', JSON), 400, None, "invalid_json"),
    "body_is_a_string": (("/v1/completions", b'"Hi"', JSON), 400, None, "invalid_json"),
    "empty_body": (("/v1/completions", b"", JSON), 400, None, "invalid_json"),
    "wrong_content_type": (("/v1/completions", json.dumps(GOOD).encode(),
                            {"Content-Type": "text/plain"}), 415, None,
                           "unsupported_media_type"),
    "form_content_type": (("/v1/completions", b"prompt=Hi",
                           {"Content-Type": "application/x-www-form-urlencoded"}), 415, None,
                          "unsupported_media_type"),
    "latin1_charset": (("/v1/completions", json.dumps(GOOD).encode(),
                        {"Content-Type": "application/json; charset=latin-1"}), 415, None,
                       "unsupported_media_type"),
    "oversized_body": (_c(prompt="x" * (2**20 + 10)), 413, None, "request_too_large"),
    "invalid_utf8": (("/v1/completions", b'{"prompt": "\xff\xfe Hi"}', JSON), 400, None,
                     "invalid_utf8"),
    "lone_surrogate": (("/v1/completions", b'{"prompt": "Hi \\ud800 there"}', JSON), 400,
                       None, "invalid_unicode"),
    "lone_surrogate_chat": (("/v1/chat/completions",
                             b'{"messages": [{"role": "user", "content": "\\udfff"}]}', JSON),
                            400, None, "invalid_unicode"),
    "stream_options_without_stream": (_c(stream_options={"include_usage": True}), 400,
                                      "stream_options", None),
    "bad_timeout_header": (("/v1/completions", json.dumps(GOOD).encode(),
                            {**JSON, "timeout": "soon"}), 400, "timeout", None),
    "stream_bad_input": (_c(stream=True, temperature=-3), 400, "temperature", None),
    "stream_context_length": (_c(stream=True, prompt=LONG), 400, "prompt",
                              "context_length_exceeded"),
}


@pytest.fixture(scope="module")
def server(engine):
    from live_server import LiveServer

    s = LiveServer(engine, max_body_bytes=2**20)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gets_4xx_in_openai_shape(http, name):
    (path, body, headers), status, param, code = CASES[name]
    r = http.post(path, content=body, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    good = http.post("/v1/completions", json=GOOD)  # nothing else is affected
    assert good.status_code == 200, good.text


def test_chunked_oversized_body_is_413(http):
    def chunks():
        for _ in range(40):
            yield b"x" * 65536

    r = http.post("/v1/completions", content=chunks(), headers=JSON)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_unknown_route_and_method_are_openai_shaped(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = http.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_bad_input_leaves_no_blocks_held(server, http):
    for name in ("context_length", "token_id_outside_vocab", "stream_context_length"):
        (path, body, headers), status, _, _ = CASES[name]
        assert http.post(path, content=body, headers=headers).status_code == status
    m = server.wait_idle()
    assert m["servelm_kv_blocks_free"] == m["servelm_kv_blocks_total"]
    assert m['servelm_requests_rejected_total{reason="invalid"}'] >= 1
    assert m['servelm_requests_rejected_total{reason="context_length"}'] >= 2


@pytest.mark.parametrize("name, reason", [
    ("too_many_prompts", "too_many_prompts"), ("too_many_choices", "too_many_choices"),
    ("cache_salt_too_long", "cache_salt_too_long"), ("oversized_body", "body_too_large"),
    ("context_length", "context_length"), ("unknown_role", "invalid")])
def test_each_limit_counts_its_rejections(server, http, name, reason):
    key = f'servelm_requests_rejected_total{{reason="{reason}"}}'
    before = server.metrics()[key]
    (path, body, headers), status, _, _ = CASES[name]
    assert http.post(path, content=body, headers=headers).status_code == status
    assert server.metrics()[key] == before + 1


def test_ten_thousand_prompts_are_refused_before_any_work(server, http):
    before = server.metrics()["servelm_prompt_tokens_total"]
    r = http.post("/v1/completions", json={**GOOD, "prompt": ["Hi"] * 10_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert server.metrics()["servelm_prompt_tokens_total"] == before
