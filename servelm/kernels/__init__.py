"""Triton kernels for the GPU fast path, each with a torch reference next to it.

Owns: the kernels behind the `triton` attention backend (K/V store, paged prefill/extend
attention, split-K decode attention) and their `*_ref` torch twins, which define what each
kernel must compute and are what the parity tests compare against.
Never: imported unless a Triton backend is chosen (importing a kernel module imports triton;
the torch-only formats the kernels share with the layers above, fp8_format.py and
int4_layout.py, are the exception);
knows nothing of ForwardBatch, models or the scheduler: kernels take plain tensors.

Every kernel also runs on the CPU under `TRITON_INTERPRET=1` (set before triton is imported),
which is how tests/kernels checks parity on machines without a GPU.
"""
