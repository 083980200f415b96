"""LLaVA (CLIP ViT, second-to-last layer without the class token, MLP projector, Llama
decoder) through servelm's runner against transformers on a tiny random-weight checkpoint:
the processor's pixels, the image tokens' embeddings, prefill logits with two images, and
16 greedy steps alone and with chunks cutting the images."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiny_models import prefill_logits
from tiny_vlm import (IMAGE_PAD, LLAVA_PROCESSOR, llava_hf_processor, make_llava,
                      random_image)

from servelm.config import EngineArgs, ModelConfig
from servelm.protocol import EngineRequest, SamplingParams
from servelm.vision.processors import image_processor
from servelm.vision.prompt import expand_image_tokens

IMAGES = [random_image(50, 36, seed=1), random_image(30, 70, seed=2)]
TEXT = [5, 6, IMAGE_PAD, 8, 9, IMAGE_PAD, 11]


@pytest.fixture(scope="module")
def hf():
    return make_llava(seed=0)


@pytest.fixture(scope="module")
def config(hf):
    cfg = ModelConfig.from_hf_config(hf.config.to_dict())
    return cfg.replace(vision=cfg.vision.with_processor(LLAVA_PROCESSOR))


def _engine(hf, config, **kw):
    from servelm.engine_builder import assemble_engine

    engine = assemble_engine(EngineArgs(model="tiny-llava", num_blocks=128, block_size=4, **kw),
                             config, hf.state_dict().items(), None, "tiny-llava")
    engine.image_token_id = IMAGE_PAD
    return engine


@pytest.fixture(scope="module")
def engine(hf, config):
    return _engine(hf, config)


@pytest.fixture(scope="module")
def prompt(config):
    processed = [image_processor(config.vision)(im) for im in IMAGES]
    return expand_image_tokens(TEXT, IMAGE_PAD, processed, ["a", "b"])


def _hf_inputs(ids):
    return dict(input_ids=torch.tensor([ids]),
                pixel_values=llava_hf_processor()(images=IMAGES, return_tensors="pt")[
                    "pixel_values"])


def test_config_and_pixels(config):
    assert config.architecture == "llava" and config.vision.image_token_id == IMAGE_PAD
    ours, theirs = image_processor(config.vision), llava_hf_processor()
    for im in IMAGES:
        p = ours(im)
        assert p.num_tokens == 16
        np.testing.assert_allclose(p.pixels, theirs(images=[im], return_tensors="np")[
            "pixel_values"][0], atol=2e-6, rtol=0)


def test_image_embeddings_match(hf, engine, prompt):
    ours = engine.runner.model.encode_images(prompt[1])
    with torch.no_grad():
        theirs = hf.model.get_image_features(_hf_inputs(prompt[0])["pixel_values"],
                                             vision_feature_layer=-2,
                                             vision_feature_select_strategy="default")
    theirs = getattr(theirs, "pooler_output", theirs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b.reshape(a.shape), atol=2e-5, rtol=1e-4)


def test_prefill_logits_match(hf, engine, prompt):
    ids, images = prompt
    engine.runner.vision.register(-1, images, len(ids))
    try:
        ours = prefill_logits(engine, ids)
    finally:
        engine.runner.vision.forget(-1)
    with torch.no_grad():
        theirs = hf(**_hf_inputs(ids)).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


def _generate(engine, ids, images):
    engine.add_request(EngineRequest("g", ids, SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True), images=images))
    out = []
    while engine.has_unfinished:
        out += [t for d in engine.step() for t in d.token_ids]
    return out


def test_16_greedy_steps_match(hf, config, engine, prompt):
    ids, images = prompt
    with torch.no_grad():
        theirs = hf.generate(**_hf_inputs(ids), max_new_tokens=16, do_sample=False)
    theirs = theirs[0, len(ids):].tolist()
    assert _generate(engine, ids, images) == theirs
    chunked = _engine(hf, config, max_num_batched_tokens=7, max_num_encoder_tokens=16)
    assert _generate(chunked, ids, images) == theirs
