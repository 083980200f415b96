"""Deterministic mode on the GPU path (attention backend 'triton'): fixed-tile Triton linears,
per-row RMSNorm and one decode-kernel row per query token. Without a GPU the kernels run
under the Triton interpreter, so this checks the path's construction (every row computed by
the same kernels on the same data, whatever the batch), not a GPU's bits; on a GPU the same
tests run on it."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from determinism_harness import Case, diverged, run  # noqa: E402
from servelm.protocol import SamplingParams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
def _factory(hf, **fixed):
    from tiny_models import make_tiny_engine

    def make(**kw):
        return make_tiny_engine(hf, attention_backend="triton", device=DEVICE,
                                **{**fixed, **kw})

    return make


# Interpreted Triton costs ~0.3 s a step on a tiny model, so the cases and the other
# requests are few and short; the CPU path's conformance suite (test_conformance_tiny.py)
# runs the full set of perturbations.
PATTERN = [17, 203, 5, 88]


def _cases(vocab):
    return [
        Case("greedy", tuple((3 * i + 1) % vocab for i in range(19)),
             SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)),
        Case("sampled", tuple((5 * i + 2) % vocab for i in range(13)),
             SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=7,
                            ignore_eos=True, logprobs=2)),
        Case("greedy-nolp", tuple((PATTERN * 6)[:22]),
             SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)),
    ]


def _others(vocab, n):
    return [([(7 * i + j) % vocab for j in range(3 + 4 * i)],
             SamplingParams(max_tokens=2 + i % 5, temperature=0 if i % 2 else 1.0,
                            ignore_eos=True)) for i in range(n)]


@pytest.fixture(scope="module")
def family():
    from tiny_models import make_tiny_hf_model

    hf = make_tiny_hf_model("llama")
    cases = _cases(hf.config.vocab_size)
    make = _factory(hf, deterministic=True)
    ref = {}
    for c in cases:  # each alone, unchunked, no prefix cache
        ref.update(run(make(), [c])[0])
    return hf, cases, ref


def _linear_calls(engine) -> int:
    from servelm.layers.det_linear import TritonDetLinear

    return sum(m.calls for m in engine.runner.model.modules() if isinstance(m, TritonDetLinear))


PERTURBATIONS = {
    "batch": ({}, 6, 4),  # engine kwargs, other requests, arrival spread in steps
    "chunk-5": ({"max_num_batched_tokens": 5}, 3, 2),
    "spec-ngram": ({"speculative_method": "ngram", "num_speculative_tokens": 3,
                    "spec_adaptive": False}, 3, 2),
}


@pytest.mark.parametrize("name", list(PERTURBATIONS))
def test_triton_path_is_bitwise_under_perturbation(family, name):
    hf, cases, ref = family
    kwargs, num_others, spread = PERTURBATIONS[name]
    engine = _factory(hf, deterministic=True)(**kwargs)
    got, perturbed = run(engine, cases, _others(hf.config.vocab_size, num_others),
                         spread=spread)
    assert _linear_calls(engine) > 0  # the Triton linears ran
    assert engine.runner.backend.deterministic_steps > 0  # and the per-row attention
    assert perturbed.max_batch > 1
    if "max_num_batched_tokens" in kwargs:
        assert perturbed.chunked > 0
    if "speculative_method" in kwargs:
        assert perturbed.spec_accepted > 0
    assert diverged(ref, {c.name: got[c.name] for c in cases}) == {"tokens": [],
                                                                    "logprobs": []}


def test_triton_linear_row_is_the_same_at_any_place_in_the_batch():
    """A row's output is the same bits alone and at every place of a batch. Interpreted,
    tl.dot is a BLAS GEMM of the tile, and OpenBLAS's AVX2 sgemm sums rows 6-11 of a tile in
    another order than row 0; the linear gives each row a tile of its own there."""
    from servelm.kernels.batch_invariant import bi_matmul_ref
    from servelm.layers.det_linear import TritonDetLinear

    torch.manual_seed(0)
    lin = TritonDetLinear(torch.randn(128, 64, device=DEVICE) * 0.08,
                          torch.randn(128, device=DEVICE))
    x = torch.randn(13, 64, device=DEVICE)
    alone = torch.cat([lin(x[r:r + 1]) for r in range(len(x))])
    for m in (2, 7, 13):
        batch = lin(x[:m])
        torch.testing.assert_close(batch, bi_matmul_ref(x[:m], lin.weight, lin.bias))
        assert [r for r in range(m) if not torch.equal(batch[r], alone[r])] == []


def test_triton_path_computes_the_model(family):
    """The batch-invariant path is the same model: its greedy tokens for a prompt match the
    default Triton path's, and its prefill logits agree within float32 tolerance."""
    from tiny_models import greedy, prefill_logits

    hf = family[0]
    prompt = [(11 * i + 5) % hf.config.vocab_size for i in range(23)]
    det = _factory(hf, deterministic=True)()
    plain = _factory(hf)()
    torch.testing.assert_close(prefill_logits(det, prompt), prefill_logits(plain, prompt),
                               atol=1e-4, rtol=1e-4)
    assert greedy(det, prompt, 10) == greedy(plain, prompt, 10)


def test_triton_path_refusals(family):
    from tiny_families import make_tiny_family_model

    hf = family[0]
    with pytest.raises(ValueError, match="CUDA graphs|cuda_graphs|graphs"):
        _factory(hf, deterministic=True)(cuda_graphs=True)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        _factory(make_tiny_family_model("mixtral"), deterministic=True)()
