"""Building blocks shared by model families: norms, rotary embeddings, activations."""
