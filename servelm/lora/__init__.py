"""LoRA adapters on one base model: many fine-tunes served in one batch.

    adapter.py    read and check a PEFT adapter directory against the base model (torch-free)
    slots.py      LoraSlots: the engine's registry, slot assignment, pins and LRU (torch-free)
    segmented.py  the per-step row groups and the segmented low-rank products (torch)
    manager.py    LoraManager: the runner's host copies, slot buffers and LoRA forward (torch)

This package's __init__ imports nothing, so the engine can import slots.py without torch.
See docs/lora.md.
"""
