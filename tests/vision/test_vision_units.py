"""The torch-free pieces of the vision path: the encoder budget's chunk cuts, the encoder
cache's eviction, the engine's checks of image spans, image decoding limits, and images
crossing the engine-core codec."""

from __future__ import annotations

import asyncio
import base64

import msgspec
import pytest

from tiny_vlm import IMAGE_PAD, PROCESSOR, data_url, make_qwen2_vl, random_image

from servelm.config import ModelConfig
from servelm.core import codec
from servelm.core.contract import NewSequence, ScheduledSequence, StepDescription
from servelm.protocol import EngineRequest, ImageInput, InvalidParameterError, SamplingParams
from servelm.vision.budget import EncoderBudget, check_images
from servelm.vision.encoder_cache import EncoderCache
from servelm.vision.image_io import ImageError, ImageLimits, load_image
from servelm.vision.parts import ImagePart
from servelm.vision.pipeline import ImagePipeline


class _Seq:
    def __init__(self, images, num_prompt_tokens=100):
        self.images = images
        self.num_prompt_tokens = num_prompt_tokens


def _img(offset, n, key="h"):
    return ImageInput(key * 32, offset, n, b"", [0])


def test_budget_cuts_the_chunk_before_an_image_that_does_not_fit():
    seq = _Seq([_img(10, 30), _img(50, 30)])
    budget = EncoderBudget(40)
    assert budget.fit(seq, 0, 100, resumed=False) == 50  # the second image waits
    assert (budget.used, budget.num_started) == (30, 1)
    budget.reset()
    assert budget.fit(seq, 50, 50, resumed=False) == 50  # next step: it starts


def test_budget_always_lets_a_step_start_one_image():
    seq = _Seq([_img(0, 500)])
    budget = EncoderBudget(16)
    assert budget.fit(seq, 0, 64, resumed=False) == 64  # larger than the budget, alone
    other = _Seq([_img(4, 8)])
    assert budget.fit(other, 0, 32, resumed=False) == 4  # the step's budget is gone


def test_budget_counts_a_resumed_chunk_inside_an_image_but_not_a_continuation():
    seq = _Seq([_img(10, 30)])
    budget = EncoderBudget(100)
    assert budget.fit(seq, 20, 10, resumed=False) == 10
    assert budget.used == 0  # encoded with the earlier chunk of this run
    assert budget.fit(seq, 20, 10, resumed=True) == 10
    assert budget.used == 30  # after a prefix hit or a preemption: encoded again


def test_budget_off_and_text_only():
    assert EncoderBudget(0).fit(_Seq([_img(0, 10**6), _img(10**6, 10**6)], 3 * 10**6), 0,
                                2 * 10**6, False) == 2 * 10**6
    assert EncoderBudget(1).fit(_Seq([]), 0, 7, False) == 7


def test_encoder_cache_evicts_least_recently_used_by_tokens():
    cache = EncoderCache(100)
    cache.put("a", "A", 40)
    cache.put("b", "B", 40)
    assert cache.get("a") == "A"  # b is now the oldest
    cache.put("c", "C", 40)
    assert "b" not in cache and "a" in cache and "c" in cache
    assert cache.num_tokens == 80
    cache.put("huge", "H", 101)  # larger than the whole cache: not kept
    assert "huge" not in cache
    assert (cache.num_hits, cache.num_misses) == (1, 0)
    assert cache.get("b") is None and cache.num_misses == 1


def test_engine_checks_image_spans():
    ids = [1, 2, IMAGE_PAD, IMAGE_PAD, 3]
    good = EngineRequest("r", ids, SamplingParams(), images=[_img(2, 2)])
    check_images(good, IMAGE_PAD)
    with pytest.raises(InvalidParameterError, match="does not take images") as e:
        check_images(good, None)
    assert e.value.param == "messages"
    for bad in ([_img(1, 2)], [_img(2, 3)], [_img(2, 1), _img(2, 1)], [_img(2, 0)]):
        with pytest.raises(InvalidParameterError) as e:
            check_images(EngineRequest("r", ids, SamplingParams(), images=bad), IMAGE_PAD)
        assert e.value.param == "images"


LIMITS = ImageLimits(max_image_bytes=50_000, max_image_pixels=100 * 100,
                     allowed_remote_hosts=("images.example.com",))


def test_load_image_decodes_data_urls():
    img = load_image(data_url(random_image(20, 10)), LIMITS, "p")
    assert img.size == (20, 10) and img.mode == "RGB"
    rgba = random_image(8, 8).convert("RGBA")
    assert load_image(data_url(rgba), LIMITS, "p").mode == "RGB"


@pytest.mark.parametrize("url,code", [
    ("http://images.example.com/a.png", "remote_image_refused"),  # https only
    ("https://other.example.com/a.png", "remote_image_refused"),
    ("ftp://images.example.com/a.png", "invalid_image"),
    ("file:///etc/passwd", "invalid_image"),
    ("data:image/png,notbase64", "invalid_image"),
    ("data:text/plain;base64,aGk=", "unsupported_image_type"),
    ("data:image/bmp;base64,Qk0=", "unsupported_image_type"),
    ("", "invalid_image"),
])
def test_load_image_refusals(url, code):
    with pytest.raises(ImageError) as e:
        load_image(url, LIMITS, "messages[0].content[2]")
    assert e.value.code == code
    assert e.value.param == "messages[0].content[2]"


def test_pixel_limit_is_checked_before_decoding(monkeypatch):
    from PIL import ImageFile

    url = data_url(random_image(200, 60))  # 12,000 pixels > 10,000
    called = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: called.append(1))
    with pytest.raises(ImageError, match="12000|200x60") as e:
        load_image(url, LIMITS, "p")
    assert e.value.code == "image_too_large" and not called


def test_pipeline_refuses_too_many_images_naming_the_first_extra_part():
    model = make_qwen2_vl()
    vision = ModelConfig.from_hf_config(model.config.to_dict()).vision.with_processor(
        PROCESSOR)
    pipe = ImagePipeline(vision, ImageLimits(max_images_per_request=1))
    url = data_url(random_image(56, 56))
    parts = [ImagePart("messages[0].content[0]", url), ImagePart("messages[1].content[3]", url)]
    with pytest.raises(InvalidParameterError) as e:
        asyncio.run(pipe.prepare([IMAGE_PAD, IMAGE_PAD], parts))
    assert e.value.param == "messages[1].content[3]" and e.value.code == "too_many_images"
    ids, images = asyncio.run(pipe.prepare([7, IMAGE_PAD, 8], parts[:1]))
    assert ids == [7] + [IMAGE_PAD] * 4 + [8] and images[0].offset == 1


def test_images_cross_the_codec():
    model = make_qwen2_vl()
    config = ModelConfig.from_hf_config(model.config.to_dict())
    pixels = base64.b64decode(base64.b64encode(bytes(range(256)) * 4))
    img = ImageInput("ab" * 16, 3, 4, pixels, [4, 64], [1, 4, 4])
    req = EngineRequest("r", [1, 2, 3] + [IMAGE_PAD] * 4, SamplingParams(max_tokens=2),
                        images=[img])
    back = codec.Decoder(codec.AddRequest).decode(codec.encode(codec.AddRequest(req)))
    assert back.request.images == [img]
    step = StepDescription(1, [ScheduledSequence(0, 0, 7, req.prompt_token_ids, 0, [1, 2], 0,
                                                 NewSequence(req.sampling_params, 7,
                                                             images=[img]))])
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(step), type=StepDescription)
    assert again.seqs[0].new.images == [img]
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=ModelConfig)
    assert decoded.vision == config.vision and decoded.architecture == "qwen2_vl"


def test_qwen2_vl_2b_config_as_transformers_4_wrote_it():
    """Everything top-level, a tied head declared there only, rope_scaling {"type": "mrope"},
    the vision config's older key names: the model built from it has Qwen2-VL-2B's
    2,208,985,600 parameters (its published count)."""
    import torch

    from servelm.models import get_model_class

    cfg = {"model_type": "qwen2_vl", "hidden_size": 1536, "intermediate_size": 8960,
           "num_attention_heads": 12, "num_hidden_layers": 28, "num_key_value_heads": 2,
           "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "tie_word_embeddings": True, "vocab_size": 151936, "image_token_id": 151655,
           "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16,
                             "in_chans": 3, "hidden_size": 1536, "spatial_patch_size": 14,
                             "spatial_merge_size": 2, "temporal_patch_size": 2},
           "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}
    config = ModelConfig.from_hf_config(cfg)
    assert (config.architecture, config.tie_word_embeddings, config.attention_bias) == \
        ("qwen2_vl", True, True)
    assert config.rope_scaling is None and config.vision.mrope_section == (16, 24, 24)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, None)
    assert sum(p.numel() for p in model.parameters()) == 2_208_985_600
    with pytest.raises(ValueError, match="model_type 'idefics3' is not supported"):
        ModelConfig.from_hf_config({**cfg, "model_type": "idefics3"})
