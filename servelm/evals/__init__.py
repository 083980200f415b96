"""Quality evals: what quantization (or any engine change) costs in model behaviour.

    perplexity.py      perplexity of an engine on a fixed held-out text (data/heldout_en.txt)
    behaviour.py       against a running `servelm serve`: greedy agreement with a reference
                       server, exact match on factual/arithmetic questions (data/*.json)
    lm_eval_task.py    the lm-eval harness (`local-completions`) on a local task (data/lm_eval)
    serve_process.py   `servelm serve` as a child process on a free port
    quality.py         all of the above per quantization method -> one JSON record

Never: downloads anything (datasets are the files in data/), or imports torch, httpx or
lm-eval at import time (`servelm eval --help` stays fast).
"""

from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
HELDOUT_TEXT = DATA_DIR / "heldout_en.txt"
