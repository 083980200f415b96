"""Sampling: a pure function from logits and per-row parameters to next tokens."""

from servelm.sampling.sampler import SamplerOutput, SamplingTensors, sample, sampling_probs

__all__ = ["SamplerOutput", "SamplingTensors", "sample", "sampling_probs"]
