"""Images through the HTTP server with the official openai client, on a tiny Qwen2-VL
directory written here: a data-URL image answered; the same image in another request hits
the encoder cache (/metrics); broken, oversized, wrong-type and remote images get a 400
naming the content part while a text stream beside them runs to its end."""

from __future__ import annotations

import base64
import re
import sys
import threading
from pathlib import Path

import openai
import pytest

from tiny_vlm import data_url, make_qwen2_vl, random_image, write_model_dir

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from live_server import MODEL, LiveServer  # noqa: E402

# limits low enough for small test images to cross them
MAX_BYTES = 40_000
MAX_PIXELS = 200 * 200


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from servelm.config import EngineArgs
    from servelm.engine_builder import build_engine

    path = write_model_dir(make_qwen2_vl(seed=0), tmp_path_factory.mktemp("tiny-qwen2-vl"))
    engine = build_engine(EngineArgs(model=str(path), num_blocks=256, block_size=4,
                                     prepared_weights_cache=False))
    s = LiveServer(engine, max_image_bytes=MAX_BYTES, max_image_pixels=MAX_PIXELS)
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _chat(client, parts, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=kw.pop(
            "max_tokens", 4), temperature=0.0, **kw)


def _image_part(url):
    return {"type": "image_url", "image_url": {"url": url}}


def _metric(server, name: str) -> float:
    with server.client() as c:
        text = c.get("/metrics").text
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_data_url_image_is_answered(client):
    image = random_image(90, 60, seed=1)  # 90x60 -> 84x56 -> 6x4 patches -> 6 tokens
    out = _chat(client, [{"type": "text", "text": "w5 w6"}, _image_part(data_url(image))])
    assert out.choices[0].message.content
    # <|im_start|> user w5 w6 <|vision_start|> 6 x <|image_pad|> <|vision_end|> <|im_end|>
    # <|im_start|> assistant: 15 tokens
    assert out.usage.prompt_tokens == 15
    jpeg = _chat(client, [_image_part(data_url(image, "JPEG"))])  # other encodings too
    webp = _chat(client, [_image_part(data_url(image, "WEBP"))])
    assert jpeg.usage.prompt_tokens == webp.usage.prompt_tokens == 13


def test_same_image_again_hits_the_encoder_cache(server, client):
    image = data_url(random_image(56, 56, seed=7))
    hits, encoded = (_metric(server, "servelm_encoder_cache_hits_total"),
                     _metric(server, "servelm_encoder_images_total"))
    first = _chat(client, [{"type": "text", "text": "w1"}, _image_part(image)])
    assert _metric(server, "servelm_encoder_images_total") == encoded + 1
    # other text before it: no prefix-cache hit over the image, so it is looked up
    _chat(client, [{"type": "text", "text": "w2 w3"}, _image_part(image)])
    assert _metric(server, "servelm_encoder_cache_hits_total") == hits + 1
    assert _metric(server, "servelm_encoder_images_total") == encoded + 1
    assert _metric(server, "servelm_request_images_count") >= 2
    assert first.choices[0].message.content


def _png_bytes(image) -> bytes:
    return base64.b64decode(data_url(image).split(",", 1)[1])


BAD = {
    "truncated": ("data:image/png;base64," + base64.b64encode(
        _png_bytes(random_image(64, 64, seed=3))[:300]).decode(), "invalid_image"),
    "too_large_bytes": (data_url(random_image(150, 150, seed=4)), "image_too_large"),
    "too_many_pixels": (data_url(random_image(250, 250, seed=5).reduce(25).resize((250, 250))),
                        "image_too_large"),
    "wrong_type": ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", "unsupported_image_type"),
    "png_sent_as_jpeg": (data_url(random_image(32, 32)).replace("image/png", "image/jpeg"),
                         "invalid_image"),
    "not_base64": ("data:image/png;base64,@@@@", "invalid_image"),
    "remote_url": ("https://example.com/cat.png", "remote_image_refused"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_image_is_a_400_naming_the_part(client, case):
    url, code = BAD[case]
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, [{"type": "text", "text": "w1"}, _image_part(url)])
    err = info.value.body
    assert err["param"] == "messages[0].content[1]", err
    assert err["code"] == code, err
    assert "messages[0].content[1]" in err["message"]


def test_bad_parts_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, [{"type": "image_url", "image_url": {
            "url": data_url(random_image(32, 32)), "detail": "high"}}])
    assert info.value.body["param"] == "messages[0].content[0]"
    assert "detail" in info.value.body["message"]


def test_other_requests_unaffected(server, client):
    """A text stream runs to its end while bad images are refused beside it."""
    done = {}

    def stream():
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "w1 w2 w3"}], max_tokens=24,
            temperature=0.0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        done["tokens"] = [c.usage.completion_tokens for c in chunks if c.usage][0]

    t = threading.Thread(target=stream)
    t.start()
    for case in sorted(BAD):
        with pytest.raises(openai.BadRequestError):
            _chat(client, [_image_part(BAD[case][0])])
    t.join(60)
    assert done.get("tokens") == 24
    ok = _chat(client, [_image_part(data_url(random_image(60, 40, seed=8)))])
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_served_by_the_engine_core_process(tmp_path):
    """`servelm serve DIR` (engine core in its own process): the VisionConfig reaches the
    front end in the core's Ready message and the images reach the runner over the codec."""
    from serve_process import ServeProcess

    path = write_model_dir(make_qwen2_vl(seed=1), tmp_path / "tiny-qwen2-vl")
    srv = ServeProcess("--block-size", "4", "--max-image-pixels", str(MAX_PIXELS),
                       model=str(path))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        name = c.models.list().data[0].id
        image = _image_part(data_url(random_image(90, 60, seed=1)))
        out = c.chat.completions.create(model=name, max_tokens=3, messages=[
            {"role": "user", "content": [{"type": "text", "text": "w5 w6"}, image]}])
        assert out.usage.prompt_tokens == 15
        assert srv.metric("servelm_encoder_images_total") == 1
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model=name, max_tokens=3, messages=[
                {"role": "user", "content": [_image_part(BAD["too_many_pixels"][0])]}])
        assert info.value.body["param"] == "messages[0].content[0]"
    finally:
        srv.proc.terminate()
        srv.proc.wait(30)
