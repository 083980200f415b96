"""Sampling: a pure function from logits and per-row parameters to next tokens, and the
verification of speculative drafts against the target's distributions (verify.py), which the
runner calls: it is sampling, not proposing, so the runner never imports spec/."""

from servelm.sampling.sampler import (
                                      SamplerOutput,
                                      SamplingTensors,
                                      draw_tensors,
                                      sample,
                                      sampling_probs,
)

__all__ = ["SamplerOutput", "SamplingTensors", "draw_tensors", "sample", "sampling_probs"]
