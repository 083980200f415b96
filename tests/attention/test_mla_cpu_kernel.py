"""The C++ MLA decode kernel (servelm/cpu_kernels/mla_attention.cpp): it computes what the
torch path (gather + SDPA over [latent | rope key] entries) computes, for head counts across
its 16-head work items, contexts across its 16-position tiles, entry and latent widths with a
partial chunk of 16, and float32/bfloat16 caches; and a tiny DeepSeek-V3 served through it
matches transformers."""

import pytest
import torch
import torch.nn.functional as F

from servelm import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.ops_for_mode("attention", "auto") is None,
                                reason="servelm's C++ CPU kernels did not build here")


def _reference(q, cache, tables, lens, bs, scale, latent):
    outs = []
    for b in range(q.shape[0]):
        pos = torch.arange(int(lens[b]))
        slots = tables[b, pos // bs] * bs + pos % bs
        keys = cache[slots].float()  # [C, E]
        out = F.scaled_dot_product_attention(q[b].float()[None], keys[None, None],
                                             keys[None, None, :, :latent], scale=scale)
        outs.append(out[0, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,entry,latent", [(4, 48, 32), (20, 96, 64), (16, 576, 512),
                                                (4, 40, 32), (3, 44, 24), (2, 12, 8)])
def test_kernel_matches_the_torch_path(dtype, heads, entry, latent):
    g = torch.Generator().manual_seed(heads)
    bs, num_blocks = 4, 80
    cache = torch.randn(num_blocks * bs, entry, generator=g).to(dtype)
    lens = torch.tensor([1, 15, 16, 17, 50], dtype=torch.long)
    tables = torch.randperm(num_blocks, generator=g)[:5 * 13].view(5, 13).long()
    q = torch.randn(5, heads, entry, generator=g).to(dtype)
    scale = entry ** -0.5
    got = cpu_kernels.load().paged_decode_mla(q, cache, tables, lens, bs, scale, latent)
    ref = _reference(q, cache, tables, lens, bs, scale, latent)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


def test_bad_inputs_are_refused():
    ops = cpu_kernels.load()
    cache = torch.zeros(16, 48)
    q = torch.zeros(1, 4, 48)
    tables = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match="latent_dim"):
        ops.paged_decode_mla(q, cache, tables, torch.tensor([3]), 4, 1.0, 56)
    with pytest.raises(RuntimeError, match="seq_lens"):
        ops.paged_decode_mla(q, cache, tables, torch.tensor([17]), 4, 1.0, 32)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.paged_decode_mla(q, cache, tables + 9, torch.tensor([3]), 4, 1.0, 32)


def test_tiny_deepseek_v3_through_the_kernel_matches_transformers():
    from tiny_families import make_tiny_family_model
    from tiny_models import make_tiny_engine
    from servelm.llm import LLM
    from servelm.protocol import SamplingParams

    # the entry 32 + 8 = 40: two chunks of 16 and a partial one
    hf = make_tiny_family_model("deepseek_v3")
    # the backend's own decodes (the C++ decode stack's: tests/models/test_family_parity.py)
    engine = make_tiny_engine(hf, cpu_kernels="decode=torch")
    backend = engine.runner.backend
    assert backend.mla_decode_kernel is not None
    prompt = [5, 17, 99, 3, 250, 11, 42]
    out = LLM(engine=engine).generate(prompt, SamplingParams(
        max_tokens=24, temperature=0, ignore_eos=True, logprobs=1), use_tqdm=False)[0].outputs[0]
    assert backend.mla_kernel_calls > 0
    with torch.no_grad():
        gen = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 7, dtype=torch.long),
                          max_new_tokens=24, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    assert out.token_ids == gen.sequences[0, 7:].tolist()
    ref_lp = [torch.log_softmax(l[0].float(), -1)[t].item()
              for l, t in zip(gen.logits, out.token_ids)]
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in out.logprobs]),
                               torch.tensor(ref_lp), atol=1e-4, rtol=1e-4)
