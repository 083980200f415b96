"""Images in prompts: vision-language checkpoints and what they need around the decoder.

Owns: the VisionConfig of a checkpoint (config.py), decoding and limiting images from chat
content parts (image_io.py), each family's image preprocessing (processors.py), placing
image tokens in a prompt (prompt.py), the engine-side encoder budget per step (budget.py),
the runner's encoder cache keyed by image content hash (encoder_cache.py) and the runner
hook that encodes images and hands their embeddings and positions to the model (runner.py).
Never: scheduling decisions beyond the encoder budget; model code (servelm/models/ has the
encoders, next to the decoders they feed).

torch-free: config.py, budget.py, prompt.py. numpy and Pillow: image_io.py, processors.py
(the front end). torch: runner.py, encoder_cache.py (the engine core).
"""
