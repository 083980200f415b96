"""Numerical parity with Hugging Face transformers on tiny random-weight checkpoints.

Prefill logits over the whole prompt, then 32 greedy decode steps whose tokens and top
logprobs must match transformers' step by step (float32 tolerance).
"""

import pytest
import torch

from tiny_models import prefill_logits
from servelm.llm import LLM
from servelm.protocol import SamplingParams

ARCHS = ["llama", "qwen2", "qwen3"]


def _prefill_logits(engine, prompt):
    return prefill_logits(engine, prompt)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(arch, tiny_hf, tiny_engine):
    hf = tiny_hf(arch)
    engine = tiny_engine(hf)
    prompt = torch.randint(0, hf.config.vocab_size, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(prompt[None]).logits[0]
    ours = _prefill_logits(engine, prompt.tolist())
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_32_decode_steps_match_transformers(arch, tiny_hf, tiny_engine):
    hf = tiny_hf(arch)
    llm = LLM(engine=tiny_engine(hf))
    prompt = [5, 17, 99, 3, 250, 11, 42]
    out = llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True,
                                              logprobs=5), use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        gen = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref_tokens = gen.sequences[0, len(prompt):].tolist()
    assert out.token_ids == ref_tokens
    for step, (lp, logits) in enumerate(zip(out.logprobs, gen.logits)):
        ref = torch.log_softmax(logits[0].float(), dim=-1)
        ref_top = ref.topk(5)
        assert [t for t, _ in lp.top] == ref_top.indices.tolist(), f"step {step}"
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), ref_top.values,
                                   atol=1e-4, rtol=1e-4)
        assert lp.token_id == ref_tokens[step]


def test_rope_scaling_llama3_matches_transformers(tiny_hf, tiny_engine):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf = tiny_hf("llama", rope_scaling=scaling, rope_theta=500000.0)
    engine = tiny_engine(hf)
    prompt = list(range(3, 300, 2))  # long enough to reach the scaled wavelengths
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(_prefill_logits(engine, prompt), ref, atol=1e-4, rtol=1e-4)


def test_tied_embeddings_match_transformers(tiny_hf, tiny_engine):
    hf = tiny_hf("llama", tie_word_embeddings=True)
    engine = tiny_engine(hf)
    prompt = [1, 2, 3, 4, 5, 6]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(_prefill_logits(engine, prompt), ref, atol=1e-4, rtol=1e-4)
