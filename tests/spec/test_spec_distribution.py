"""Rejection sampling through the whole engine: with a draft model that disagrees with the
target, the distribution of the sampled tokens is still the target's.

The first output token is sampled by the prefill step; the second comes from a speculative
step (drafted by the target's first layer, verified by the full model). Its exact marginal
is sum_t1 p(t1 | prompt) p(t2 | prompt, t1), computed with transformers for every t1.
"""

import torch

from servelm.llm import LLM
from servelm.protocol import SamplingParams


def test_sampled_tokens_follow_the_target_distribution():
    from tiny_models import make_tiny_engine, make_tiny_hf_model

    # A small vocabulary and weights scaled so that a few dozen tokens carry the mass.
    hf = make_tiny_hf_model("llama", num_hidden_layers=2, vocab_size=48, seed=3)
    prompt = [5, 9, 2, 11]
    temperature = 1.0
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        vocab = p1.shape[0]
        both = torch.tensor([prompt + [t] for t in range(vocab)])
        p2_given = torch.softmax(hf(both).logits[:, -1] / temperature, -1)  # [V, V]
        p2 = p1 @ p2_given

    engine = make_tiny_engine(hf, speculative_method="draft", spec_draft_layers=1,
                              num_speculative_tokens=2, spec_adaptive=False,
                              enable_prefix_caching=False, max_num_seqs=256, num_blocks=1024)
    torch.manual_seed(0)
    n_req, per_req = 30, 100
    params = SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True,
                            n=per_req)
    outs = LLM(engine=engine).generate([prompt] * n_req, params, use_tqdm=False)
    second = torch.zeros(vocab)
    for o in outs:
        for c in o.outputs:
            second[c.token_ids[1]] += 1
    n = n_req * per_req
    st = engine.stats
    assert st.spec_num_proposed > 0 and 0 < st.spec_num_accepted < st.spec_num_proposed
    # Chi-square over tokens expected >= 5 times, the rest pooled.
    expected = p2 * n
    big = expected >= 5
    obs = torch.cat([second[big], second[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    exp_nz = exp > 0
    chi2 = float(((obs[exp_nz] - exp[exp_nz]) ** 2 / exp[exp_nz]).sum())
    df = int(exp_nz.sum()) - 1
    # 0.999 quantile of chi-square ~ df + 3.1 sqrt(2 df) + 8 for df in the tens.
    limit = df + 3.1 * (2 * df) ** 0.5 + 8
    assert chi2 < limit, f"chi2 {chi2:.1f} >= {limit:.1f} (df {df})"
