"""EAGLE-3 on a tiny random target: the target's aux hidden states, both published checkpoint
layouts (others refused by name), greedy output with eagle3 equal to plain decoding, a head
trained for a few steps accepting more than a random one on its training text, and the
trainer resuming where it stopped."""

import json
import random

import pytest
import torch

from servelm.llm import LLM
from servelm.protocol import SamplingParams
from servelm.spec.eagle import (UnsupportedDrafterError, load_drafter, read_config,
                                save_drafter)
from servelm.spec.train_eagle import (TrainOptions, fit, new_drafter, sample_features,
                                      target_features, train)

from spec_outputs import assert_same_as, run_checked

MAX_TOKENS = 24
REF = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf():
    from tiny_models import make_tiny_hf_model

    return make_tiny_hf_model("llama", num_hidden_layers=6)


@pytest.fixture(scope="module")
def engine(hf):
    from tiny_models import make_tiny_engine

    return make_tiny_engine(hf)


@pytest.fixture(scope="module")
def prompts(hf):
    rng = random.Random(0)
    return [[rng.randrange(hf.config.vocab_size) for _ in range(rng.randint(4, 20))]
            for _ in range(8)]


def _drafter(engine, draft_vocab=150, seed=0):
    vocab = torch.arange(0, 2 * draft_vocab, 2)  # every other id: d2t is not the identity
    return new_drafter(engine.model_config, engine.runner.model.embed_tokens.weight.data,
                       vocab, seed)


def test_aux_hidden_states_are_the_targets_after_each_layer(hf, engine, prompts):
    ids = prompts[0]
    aux, logits = target_features(engine, ids, (0, 2, 4))
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    want = torch.cat([out.hidden_states[i + 1][0] for i in (0, 2, 4)], dim=-1)
    torch.testing.assert_close(aux, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, out.logits[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
def test_loads_both_layouts(engine, tmp_path, layout):
    drafter = _drafter(engine)
    save_drafter(drafter, str(tmp_path), layout)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert ("speculators_config" in raw) == (layout == "speculators")
    loaded = load_drafter(str(tmp_path), engine.model_config,
                          engine.runner.model.embed_tokens.weight.data)
    assert loaded.cfg.layout == layout and loaded.cfg.aux_layers == drafter.cfg.aux_layers
    for name, t in drafter.state_dict().items():
        assert torch.equal(t, loaded.state_dict()[name]), name
    assert not torch.equal(drafter.d2t, torch.zeros_like(drafter.d2t))


def test_other_layouts_refused_by_name(engine, tmp_path):
    cfg = engine.model_config
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["EagleLlamaForCausalLM"], "hidden_size": 64}))
    with pytest.raises(UnsupportedDrafterError, match="EagleLlamaForCausalLM.*EAGLE-1/2"):
        read_config(str(tmp_path), cfg.num_layers, cfg.vocab_size, cfg.hidden_size)
    (tmp_path / "config.json").write_text(json.dumps(
        {"speculators_config": {"algorithm": "eagle"}}))
    with pytest.raises(UnsupportedDrafterError, match="algorithm 'eagle'"):
        read_config(str(tmp_path), cfg.num_layers, cfg.vocab_size, cfg.hidden_size)
    drafter = _drafter(engine)
    save_drafter(drafter, str(tmp_path))
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "model.safetensors"))
    state["medusa_head.0.weight"] = torch.zeros(2, 2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedDrafterError, match="medusa_head.0.weight"):
        load_drafter(str(tmp_path), cfg, engine.runner.model.embed_tokens.weight.data)


def _eagle_engine(hf, path):
    from tiny_models import make_tiny_engine

    return make_tiny_engine(hf, speculative_method="eagle3", spec_draft_model=str(path),
                            spec_adaptive=False, num_speculative_tokens=3)


def _run(engine, prompts, params=GREEDY):
    return run_checked(engine, prompts, params)


def test_greedy_with_eagle3_equals_plain_decoding(hf, engine, prompts, tmp_path):
    reference = [o.outputs[0] for o in _run(engine, prompts, REF)]
    save_drafter(_drafter(engine), str(tmp_path))
    spec = _eagle_engine(hf, tmp_path)
    outs = _run(spec, prompts + prompts[:2])  # the repeats hit the prefix cache
    assert_same_as(reference + reference[:2], outs)
    assert spec.stats.spec_num_proposed > 0
    # the target's plain decode steps on the C++ stack, which hands the drafter its features
    assert spec.runner.cpu_stack is not None and spec.runner.cpu_stack.steps > 0


def _acceptance(hf, path, prompts, reference) -> float:
    """Acceptance over greedy runs of `prompts`, whose tokens must be the reference's."""
    spec = _eagle_engine(hf, path)
    assert_same_as(reference, _run(spec, prompts))
    st = spec.stats
    return st.spec_num_accepted / st.spec_num_proposed


def test_trained_head_accepts_more_than_a_random_one(hf, engine, prompts, tmp_path):
    opts = TrainOptions(out=str(tmp_path / "trained"), max_new_tokens=MAX_TOKENS, steps=150,
                        ttt_steps=2, draft_vocab_size=hf.config.vocab_size, lr=3e-3,
                        save_every=150)
    train(LLM(engine=engine), opts, prompts=prompts, log=lambda msg: None)
    save_drafter(_drafter(engine, hf.config.vocab_size // 2), str(tmp_path / "random"))
    reference = [o.outputs[0] for o in _run(engine, prompts, REF)]
    trained = _acceptance(hf, tmp_path / "trained", prompts, reference)  # chains accepted
    untrained = _acceptance(hf, tmp_path / "random", prompts, reference)
    assert trained > max(untrained, 0.05), (trained, untrained)


def test_trainer_resumes_where_it_stopped(engine, prompts, tmp_path):
    vocab = torch.arange(engine.model_config.vocab_size)
    feats = [sample_features(engine, p + p, (2, 3, 3), vocab) for p in prompts[:3]]
    messages = []

    def run(out, steps):
        opts = TrainOptions(out=str(out), steps=steps, ttt_steps=2, lr=1e-3, save_every=5)
        drafter = new_drafter(engine.model_config,
                              engine.runner.model.embed_tokens.weight.data, vocab, 0)
        return fit(drafter, feats, opts, messages.append)

    run(tmp_path / "a", 10)  # stops at 10 ...
    resumed = run(tmp_path / "a", 20)  # ... and goes on to 20
    assert messages == ["resuming at step 10 of 20"]
    straight = run(tmp_path / "b", 20)
    for name, t in straight.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], t, atol=0, rtol=0)
    loaded = load_drafter(str(tmp_path / "a"), engine.model_config,
                          engine.runner.model.embed_tokens.weight.data)
    torch.testing.assert_close(loaded.fc.weight, straight.fc.weight, atol=0, rtol=0)


def test_eagle3_needs_its_head_named():
    from servelm.config import SpeculativeConfig

    with pytest.raises(ValueError, match="--speculative-model"):
        SpeculativeConfig("eagle3")
    with pytest.raises(ValueError, match="--spec-draft-layers"):
        SpeculativeConfig("eagle3", draft_model="x", draft_layers=2)


def test_speculative_model_flag_names_the_head():
    import argparse

    from servelm.config import add_engine_cli_args, engine_args_from_cli

    parser = argparse.ArgumentParser()
    add_engine_cli_args(parser)
    ns = parser.parse_args(["--speculative-method", "eagle3", "--speculative-model", "/h/x"])
    ns.model = "tiny"
    spec = engine_args_from_cli(ns).speculative_config()
    assert (spec.method, spec.draft_model) == ("eagle3", "/h/x")
