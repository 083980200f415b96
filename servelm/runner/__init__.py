"""Runner: turns a tensor-free ScheduledBatch into tensors, runs the model, samples."""
