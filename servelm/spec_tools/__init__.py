"""`servelm spec`: the speculative-decoding tools (cli.py: `servelm spec train`).

Sits with the tools, above the assembly: a command here builds an engine and the LLM API
over it, which the spec package below (proposers, the EAGLE-3 trainer) never does.
Never: imported by production code.
"""
