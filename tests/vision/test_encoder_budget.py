"""The encoder budget in the real engine: a burst of image requests next to a decoding text
stream. With the budget, each step starts at most the images that fit and the text stream
gets a token every step; without it, one step encodes the whole burst."""

from __future__ import annotations

import pytest

from tiny_vlm import IMAGE_PAD, PROCESSOR, make_qwen2_vl, random_image

from servelm.config import EngineArgs, ModelConfig
from servelm.protocol import EngineRequest, SamplingParams
from servelm.vision.processors import image_processor
from servelm.vision.prompt import expand_image_tokens


@pytest.fixture(scope="module")
def setup():
    hf = make_qwen2_vl(seed=0)
    cfg = ModelConfig.from_hf_config(hf.config.to_dict())
    cfg = cfg.replace(vision=cfg.vision.with_processor(PROCESSOR))
    proc = image_processor(cfg.vision)
    # distinct pictures (no encoder-cache hits), 6 tokens each
    bursts = [expand_image_tokens([4, IMAGE_PAD, 5], IMAGE_PAD,
                                  [proc(random_image(90, 60, seed=20 + i))], ["p"])
              for i in range(4)]
    return hf, cfg, bursts


def _run(setup, budget: int):
    from servelm.engine_builder import assemble_engine

    hf, cfg, bursts = setup
    engine = assemble_engine(EngineArgs(model="t", num_blocks=128, block_size=4,
                                        max_num_encoder_tokens=budget), cfg,
                             hf.state_dict().items(), None, "t")
    engine.image_token_id = IMAGE_PAD
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest("text", [7, 8, 9], params))
    engine.step()  # the text stream is decoding when the burst comes
    for i, (ids, images) in enumerate(bursts):
        engine.add_request(EngineRequest(f"img{i}", ids, params, images=images))
    per_step, text_tokens = [], []
    while engine.has_unfinished:
        before = engine.stats.num_images_encoded
        deltas = engine.step()
        per_step.append(engine.stats.num_images_encoded - before)
        text_tokens.append(sum(len(d.token_ids) for d in deltas if d.request_id == "text"))
    return per_step, text_tokens


def test_budget_spreads_a_burst_over_steps(setup):
    per_step, text_tokens = _run(setup, budget=6)  # one 6-token image per step
    assert max(per_step) == 1 and sum(per_step) == 4
    assert per_step[:4] == [1, 1, 1, 1]
    assert all(n == 1 for n in text_tokens[:4])  # decoding went on meanwhile


def test_without_budget_one_step_encodes_the_burst(setup):
    per_step, _ = _run(setup, budget=0)
    assert per_step[0] == 4
