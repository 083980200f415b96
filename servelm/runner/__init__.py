"""Runner: turns a tensor-free StepDescription into tensors, runs the model, samples."""
