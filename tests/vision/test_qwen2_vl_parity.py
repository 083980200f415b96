"""Qwen2-VL through servelm's runner against transformers on a tiny random-weight checkpoint:
the image processor's pixels, the image tokens' embeddings, prefill logits over a prompt
with two images (M-RoPE positions), and 16 greedy steps, alone, chunked and batched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiny_models import prefill_logits
from tiny_vlm import IMAGE_PAD, hf_processor, make_qwen2_vl, random_image

from servelm.config import EngineArgs, ModelConfig
from servelm.protocol import EngineRequest, SamplingParams
from servelm.vision.processors import image_processor
from servelm.vision.prompt import expand_image_tokens, mrope_positions
from tiny_vlm import PROCESSOR

IMAGES = [random_image(90, 60, seed=1), random_image(40, 130, seed=2)]
TEXT = [5, 6, 7, IMAGE_PAD, 8, 9, 10, IMAGE_PAD, 11, 12]


@pytest.fixture(scope="module")
def hf():
    return make_qwen2_vl(seed=0)


@pytest.fixture(scope="module")
def config(hf):
    cfg = ModelConfig.from_hf_config(hf.config.to_dict())
    return cfg.replace(vision=cfg.vision.with_processor(PROCESSOR))


def _engine(hf, config, **kw):
    from servelm.engine_builder import assemble_engine

    kw.setdefault("num_blocks", 128)
    kw.setdefault("block_size", 4)
    engine = assemble_engine(EngineArgs(model="tiny-vl", **kw), config,
                             hf.state_dict().items(), None, "tiny-vl")
    engine.image_token_id = config.vision.image_token_id
    return engine


@pytest.fixture(scope="module")
def engine(hf, config):
    return _engine(hf, config)


@pytest.fixture(scope="module")
def prompt(config):
    processed = [image_processor(config.vision)(im) for im in IMAGES]
    return expand_image_tokens(TEXT, IMAGE_PAD, processed, ["a", "b"])


def _hf_inputs(ids):
    out = hf_processor()(images=IMAGES, return_tensors="pt")
    inp = torch.tensor([ids])
    return dict(input_ids=inp, pixel_values=out["pixel_values"],
                image_grid_thw=out["image_grid_thw"],
                mm_token_type_ids=(inp == IMAGE_PAD).int())


def test_config_reads_the_vision_family(config):
    assert config.architecture == "qwen2_vl"
    assert config.vision.image_token_id == IMAGE_PAD
    assert config.vision.mrope_section == (2, 3, 3)
    assert config.attention_bias  # Qwen2's q/k/v biases


def test_pixels_match_the_hf_processor(config):
    ours = image_processor(config.vision)
    theirs = hf_processor()
    for im in [*IMAGES, random_image(400, 300, seed=3)]:  # the last one is scaled down
        p = ours(im)
        h = theirs(images=[im], return_tensors="np")
        assert p.grid_thw == h["image_grid_thw"][0].tolist()
        assert p.num_tokens == np.prod(p.grid_thw) // 4
        np.testing.assert_allclose(p.pixels, h["pixel_values"], atol=2e-6, rtol=0)


def test_mrope_positions_match_hf(hf, prompt):
    ids, images = prompt
    rows, delta = mrope_positions(len(ids), images, merge=2)
    kw = _hf_inputs(ids)
    pos, deltas = hf.model.get_rope_index(kw["input_ids"], kw["mm_token_type_ids"],
                                          kw["image_grid_thw"])
    assert rows == pos[:, 0].tolist()
    assert delta == int(deltas[0, 0])


def test_image_embeddings_match(hf, engine, prompt):
    _, images = prompt
    ours = engine.runner.model.encode_images(images)
    kw = _hf_inputs(prompt[0])
    with torch.no_grad():
        theirs = hf.model.get_image_features(kw["pixel_values"],
                                             kw["image_grid_thw"]).pooler_output
    assert [t.shape[0] for t in ours] == [img.num_tokens for img in images]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_prefill_logits_match(hf, engine, prompt):
    ids, images = prompt
    vision = engine.runner.vision
    vision.register(-1, images, len(ids))  # score_item's sequence id
    try:
        ours = prefill_logits(engine, ids)
    finally:
        vision.forget(-1)
    with torch.no_grad():
        theirs = hf(**_hf_inputs(ids)).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


def _generate(engine, requests):
    for r in requests:
        engine.add_request(r)
    out = {r.request_id: [] for r in requests}
    while engine.has_unfinished:
        for d in engine.step():
            out[d.request_id] += d.token_ids
    return out


def _greedy(rid, ids, images, n=16):
    return EngineRequest(rid, ids, SamplingParams(max_tokens=n, temperature=0.0,
                                                  ignore_eos=True), images=images)


@pytest.fixture(scope="module")
def hf_tokens(hf, prompt):
    ids = prompt[0]
    with torch.no_grad():
        out = hf.generate(**_hf_inputs(ids), max_new_tokens=16, do_sample=False)
    return out[0, len(ids):].tolist()


def test_16_greedy_steps_match(engine, prompt, hf_tokens):
    ids, images = prompt
    assert _generate(engine, [_greedy("a", ids, images)])["a"] == hf_tokens
    stats = engine.stats  # both images went in: encoded now or by an earlier test
    assert stats.num_images_encoded + stats.num_encoder_cache_hits >= 2


def test_greedy_chunked_through_images_and_batched_with_text(hf, config, prompt, hf_tokens):
    """Chunks of 5 tokens cut both images; a text-only request shares the steps; the
    encoder budget (one image per step) delays the second image by a step."""
    ids, images = prompt
    engine = _engine(hf, config, max_num_batched_tokens=5, max_num_encoder_tokens=1)
    text_alone = _generate(_engine(hf, config), [_greedy("t", [3, 4, 5, 6], [])])["t"]
    out = _generate(engine, [_greedy("a", ids, images), _greedy("t", [3, 4, 5, 6], [])])
    assert out["a"] == hf_tokens
    assert out["t"] == text_alone


def test_same_image_again_hits_the_encoder_cache(engine, prompt, hf_tokens):
    ids, images = prompt
    before_hits = engine.runner.vision.cache.num_hits
    before_encoded = engine.stats.num_images_encoded
    # no prefix cache hit on the image positions: another text before them
    ids2 = [13] + ids
    images2 = [type(img)(img.hash, img.offset + 1, img.num_tokens, img.pixels, img.shape,
                         img.grid_thw) for img in images]
    _generate(engine, [_greedy("again", ids2, images2, n=2)])
    assert engine.runner.vision.cache.num_hits - before_hits == 2
    assert engine.stats.num_images_encoded == before_encoded
    assert engine.stats.num_encoder_cache_hits >= 2


def test_prefix_cache_keys_image_positions_by_hash(hf, config, prompt):
    """Same text, another picture: the prefix cache must not hand over the first image's KV
    (every placeholder token is the same id)."""
    ids, images = prompt
    other = image_processor(config.vision)(random_image(90, 60, seed=9))
    ids_b, images_b = expand_image_tokens(TEXT, IMAGE_PAD, [other, image_processor(
        config.vision)(IMAGES[1])], ["a", "b"])
    assert ids_b == ids  # equal token ids, different pictures
    engine = _engine(hf, config)
    first = _generate(engine, [_greedy("a", ids, images, n=4)])["a"]
    fresh = _generate(_engine(hf, config), [_greedy("b", ids_b, images_b, n=4)])["b"]
    second = _generate(engine, [_greedy("b", ids_b, images_b, n=4)])["b"]
    assert second == fresh != first
    hits = engine.block_manager.prefix_cache.stats.num_hit_tokens
    again = _generate(engine, [_greedy("a2", ids, images, n=4)])["a2"]  # same image: a hit
    assert again == first
    assert engine.block_manager.prefix_cache.stats.num_hit_tokens - hits >= 12


def test_greedy_through_preemption(hf, config, prompt, hf_tokens):
    """Two image requests in a pool too small for both: one is preempted and recomputed from
    its prompt (its images looked up again), and both keep their tokens."""
    ids, images = prompt
    shifted = [type(img)(img.hash, img.offset + 1, img.num_tokens, img.pixels, img.shape,
                         img.grid_thw) for img in images]
    alone = _generate(_engine(hf, config), [_greedy("b", [13] + ids, shifted)])["b"]
    engine = _engine(hf, config, num_blocks=14)
    out = _generate(engine, [_greedy("a", ids, images), _greedy("b", [13] + ids, shifted)])
    assert engine.scheduler.num_preemptions > 0
    assert out["a"] == hf_tokens and out["b"] == alone


def test_greedy_with_ngram_speculation(hf, config, prompt, hf_tokens):
    """Drafts are verified at M-RoPE positions past the prompt (p + delta): same tokens."""
    ids, images = prompt
    engine = _engine(hf, config, speculative_method="ngram", num_speculative_tokens=3,
                     spec_ngram_min=1, spec_adaptive=False)
    assert _generate(engine, [_greedy("a", ids, images)])["a"] == hf_tokens
    assert engine.stats.spec_num_proposed > 0


@pytest.mark.parametrize("kw,match", [
    ({"deterministic": True}, "deterministic"), ({"enable_lora": True}, "LoRA"),
    ({"speculative_method": "draft", "spec_draft_layers": 1}, "spec_draft_layers")])
def test_unsupported_engine_options_are_refused_by_name(hf, config, kw, match):
    with pytest.raises(ValueError, match=match):
        _engine(hf, config, **kw)
