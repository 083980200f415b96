"""MTP on a tiny random DeepSeek-V3 whose checkpoint carries a multi-token-prediction module
(transformers' DeepseekV3Config with num_nextn_predict_layers = 1; the module's tensors in
the DeepSeek-V3 layout, model.layers.{L}.*, since transformers does not implement it): it
loads from a checkpoint folder, greedy output with --speculative-method mtp is plain
decoding's, its drafts are a hand-written forward of the documented formula, and targets
without MTP layers are refused by name."""

import random

import pytest
import torch
from safetensors.torch import save_file

from servelm.config import EngineArgs, ModelConfig, SpeculativeConfig
from servelm.protocol import InvalidParameterError, SamplingParams

from spec_outputs import assert_same_as, run_checked

MAX_TOKENS = 20
REF = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
K = 3


@pytest.fixture(scope="module")
def hf():
    from tiny_families import make_tiny_family_model

    model = make_tiny_family_model("deepseek_v3", num_nextn_predict_layers=1)
    with torch.no_grad():  # a final norm that is not the identity: the MTP reads its output
        model.model.norm.weight.copy_(1 + 0.3 * torch.randn(model.config.hidden_size))
    return model


def mtp_tensors(hf, seed: int = 1, has_head: bool = True) -> dict[str, torch.Tensor]:
    """The MTP module of the DeepSeek-V3 layout, random: enorm, hnorm, eh_proj [H, 2H],
    a MoE decoder layer under the target's own layer names, shared_head.norm/.head, and
    the copy of the embedding the published checkpoint carries."""
    g = torch.Generator().manual_seed(seed)
    n, h = hf.config.num_hidden_layers, hf.config.hidden_size
    p = f"model.layers.{n}."

    def rand(t):
        if t.dim() == 1:  # norms and the router's correction bias
            return 1 + 0.1 * torch.randn(t.shape, generator=g)
        return 0.08 * torch.randn(t.shape, generator=g)

    state = hf.state_dict()
    last = f"model.layers.{n - 1}."  # a MoE layer (first_k_dense_replace = 1)
    out = {p + k[len(last):]: rand(v) for k, v in state.items() if k.startswith(last)}
    out[p + "enorm.weight"] = rand(torch.empty(h))
    out[p + "hnorm.weight"] = rand(torch.empty(h))
    out[p + "eh_proj.weight"] = rand(torch.empty(h, 2 * h))
    out[p + "shared_head.norm.weight"] = rand(torch.empty(h))
    if has_head:
        out[p + "shared_head.head.weight"] = rand(state["lm_head.weight"])
    out[p + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    return {k: v.contiguous() for k, v in out.items()}


@pytest.fixture(scope="module")
def checkpoint(hf, tmp_path_factory):
    from tiny_models import save_tiny_checkpoint

    path = tmp_path_factory.mktemp("dsv3_mtp")
    save_tiny_checkpoint(hf, path)
    save_file(mtp_tensors(hf), str(path / "model-mtp.safetensors"))
    return path


def _engine(path, **kw):
    from servelm.engine_builder import build_engine

    return build_engine(EngineArgs(model=str(path), dtype="float32", num_blocks=256,
                                   block_size=4, **kw))


def _mtp_engine(path):
    return _engine(path, speculative_method="mtp", spec_adaptive=False,
                   num_speculative_tokens=K)


@pytest.fixture(scope="module")
def prompts(hf):
    rng = random.Random(0)
    return [[rng.randrange(3, hf.config.vocab_size) for _ in range(rng.randint(4, 16))]
            for _ in range(6)]


def _run(engine, prompts, params=GREEDY):
    return run_checked(engine, prompts, params)


def test_greedy_with_mtp_equals_plain_decoding(checkpoint, prompts):
    reference = [o.outputs[0] for o in _run(_engine(checkpoint), prompts, REF)]
    spec = _mtp_engine(checkpoint)
    outs = _run(spec, prompts + prompts[:2])  # the repeats hit the prefix cache
    assert_same_as(reference + reference[:2], outs)
    assert spec.stats.spec_num_proposed > 0
    # the target's verifications ran on the C++ decode stack (latent attention included)
    assert spec.runner.cpu_stack.verify_steps > 0


def test_mtp_module_is_kept_only_when_asked(checkpoint, hf, monkeypatch):
    from servelm.loader import hf_loader
    from servelm.spec.mtp import MTPProposer

    read, call = [], hf_loader._Reader.__call__
    monkeypatch.setattr(hf_loader._Reader, "__call__",
                        lambda self, f, name: read.append(name) or call(self, f, name))
    prefix = f"model.layers.{hf.config.num_hidden_layers}."  # the MTP module's tensors
    mtp_name = prefix + "eh_proj.weight"
    spec = _mtp_engine(checkpoint)
    assert mtp_name in read
    assert isinstance(spec.runner.proposer, MTPProposer)
    mtp = spec.runner.proposer.drafter.mtp
    want = mtp_tensors(hf)[mtp_name]
    assert torch.equal(mtp.eh_proj.weight, want)
    read.clear()
    plain = _engine(checkpoint)  # without mtp the module's tensors are not even read
    assert read and not [n for n in read if n.startswith(prefix)]
    assert plain.runner.proposer is None
    assert not any("eh_proj" in n for n, _ in plain.runner.model.named_parameters())


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_drafts(hf, tensors, ids, num_drafts):
    """The documented MTP chain, by hand: at position i, x = eh_proj([enorm(embed(t_{i+1}));
    hnorm(h_i)]) with h_i the target's final-normed hidden state, transformers' own
    DeepSeek-V3 decoder layer (the MTP module's tensors), then shared_head.norm and
    shared_head.head; each draft recomputes the whole chain from scratch (no cache)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    cfg, n = hf.config, hf.config.num_hidden_layers
    eps, p = cfg.rms_norm_eps, f"model.layers.{n}."
    t = {k[len(p):]: v for k, v in tensors.items()}
    cfg._attn_implementation = "eager"
    layer = DeepseekV3DecoderLayer(cfg, n - 1).eval()
    layer.load_state_dict({k: v for k, v in t.items() if k.split(".")[0] in
                           ("self_attn", "mlp", "input_layernorm",
                            "post_attention_layernorm")})
    embed = hf.model.embed_tokens.weight
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
        tokens = ids[1:] + [int(hf(torch.tensor([ids])).logits[0, -1].argmax())]
        drafts = []
        for _ in range(num_drafts):
            x = torch.cat((_rms(embed[torch.tensor(tokens)], t["enorm.weight"], eps),
                           _rms(hidden, t["hnorm.weight"], eps)), -1) @ t["eh_proj.weight"].T
            pos = torch.arange(len(tokens))[None]
            mask = torch.full((len(tokens), len(tokens)), float("-inf")).triu(1)[None, None]
            y = layer(x[None], attention_mask=mask, position_ids=pos,
                      position_embeddings=hf.model.rotary_emb(x[None], pos))
            y = y[0] if isinstance(y, tuple) else y
            out = _rms(y[0, -1], t["shared_head.norm.weight"], eps)
            drafts.append(int((t["shared_head.head.weight"] @ out).argmax()))
            hidden = torch.cat((hidden, out[None]))  # the chain: the module's own output
            tokens = tokens + [drafts[-1]]
    return drafts


def test_drafts_equal_a_hand_written_mtp_forward(checkpoint, hf, prompts):
    spec = _mtp_engine(checkpoint)
    proposer = spec.runner.proposer
    seen = []
    propose = proposer.propose

    def record(scheduled):
        out = propose(scheduled)
        seen.extend(p.token_ids for p in out.values())
        return out

    proposer.propose = record
    tensors = mtp_tensors(hf)
    for ids in prompts[:3]:
        seen.clear()
        _run(spec, [ids], SamplingParams(max_tokens=K + 2, temperature=0, ignore_eos=True))
        assert seen, "no proposal"
        assert seen[0] == _reference_drafts(hf, tensors, ids, K)


def test_drafter_catches_up_after_accepted_chains(checkpoint, hf, prompts):
    """The proposals are replaced by plain decoding's own next tokens (all accepted), so
    each step brings k + 1 new positions: the MTP module's drafts at every step must still
    be the hand-written chain's over the whole sequence so far, and the output plain."""
    from servelm.spec.proposer import Proposal

    spec, tensors = _mtp_engine(checkpoint), mtp_tensors(hf)
    proposer = spec.runner.proposer
    propose, seen, full = proposer.propose, [], []

    def oracle(scheduled):
        out = propose(scheduled)
        for s in scheduled:
            drafts = out[s.seq.seq_id].token_ids
            seen.append((list(s.seq.token_ids[:s.start]), drafts))
            out[s.seq.seq_id] = Proposal(full[s.start + 1:s.start + 1 + len(drafts)])
        return out

    proposer.propose = oracle
    for ids, ref in zip(prompts[:2], _run(_engine(checkpoint), prompts[:2], REF)):
        full[:] = ids + ref.outputs[0].token_ids
        seen.clear()
        assert_same_as([ref.outputs[0]], _run(spec, [ids]))
        assert len(seen) >= 3
        for before, drafts in seen:
            assert drafts == _reference_drafts(hf, tensors, before, len(drafts))
    assert spec.stats.spec_num_accepted > spec.stats.spec_num_proposed // 2


def test_the_models_head_when_the_checkpoint_has_none(hf, tmp_path):
    from tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint(hf, tmp_path)
    save_file(mtp_tensors(hf, has_head=False), str(tmp_path / "model-mtp.safetensors"))
    spec = _mtp_engine(tmp_path)
    assert spec.runner.proposer.drafter.mtp.shared_head_head is None
    out = _run(spec, [[5, 6, 7, 8]])[0].outputs[0].token_ids
    assert out == _run(_engine(tmp_path), [[5, 6, 7, 8]])[0].outputs[0].token_ids


def test_targets_without_mtp_layers_are_refused_by_name(hf, tmp_path):
    from tiny_models import make_tiny_hf_model, save_tiny_checkpoint

    llama = tmp_path / "llama"
    save_tiny_checkpoint(make_tiny_hf_model("llama"), llama)
    with pytest.raises(InvalidParameterError, match="mtp.*multi-token-prediction.*llama"):
        _engine(llama, speculative_method="mtp")
    # the config promises a module the checkpoint does not hold
    save_tiny_checkpoint(hf, tmp_path / "no_tensors")
    with pytest.raises(InvalidParameterError, match=r"no tensors .*model\.layers\.3"):
        _engine(tmp_path / "no_tensors", speculative_method="mtp")
    cfg = ModelConfig.from_hf_config({**hf.config.to_dict(), "num_nextn_predict_layers": 0})
    from servelm.spec.mtp import UnsupportedMTPError, check_mtp_target

    with pytest.raises(UnsupportedMTPError, match="deepseek_v3"):
        check_mtp_target(cfg)
    with pytest.raises(ValueError, match="'mtp'.*--speculative-model"):
        SpeculativeConfig(method="mtp", draft_model="x")


def test_the_flag_asks_for_mtp():
    import argparse

    from servelm.config import add_engine_cli_args, engine_args_from_cli

    parser = argparse.ArgumentParser()
    add_engine_cli_args(parser)
    ns = parser.parse_args(["--speculative-method", "mtp", "--num-speculative-tokens", "2"])
    ns.model = "tiny"
    spec = engine_args_from_cli(ns).speculative_config()
    assert (spec.method, spec.num_tokens, spec.draft_model) == ("mtp", 2, None)
