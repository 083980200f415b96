"""`servelm quantize`: the quantization tools (cli.py: the command; quantize.py: writing a
pre-quantized checkpoint).

Sits with the tools, above the models and the loader: writing a checkpoint builds the model
with its weights staged and reads the source checkpoint, which the quant package below (the
methods and the quantized layers the models are built from) never does.
Never: imported by production code (the engine loads what it writes through
servelm/loader/quantized_checkpoint.py).
"""
