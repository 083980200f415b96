"""Sampling: a pure function from logits and per-row parameters to next tokens."""

from servelm.sampling.sampler import (
                                      SamplerOutput,
                                      SamplingTensors,
                                      draw_tensors,
                                      sample,
                                      sampling_probs,
)

__all__ = ["SamplerOutput", "SamplingTensors", "draw_tensors", "sample", "sampling_probs"]
