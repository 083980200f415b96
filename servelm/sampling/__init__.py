"""Sampling: a pure function from logits and per-row parameters to next tokens."""

from servelm.sampling.sampler import SamplerOutput, SamplingTensors, sample

__all__ = ["SamplerOutput", "SamplingTensors", "sample"]
