"""The lm-eval harness against a running server: `local-completions` on servelm's local task
(data/lm_eval/servelm_arith.yaml: 100 arithmetic questions, 3-shot, generate_until, exact
match), so no dataset comes from a hub.

generate_until needs neither a tokenizer on the client (`tokenizer_backend=None`, prompts go
as text) nor prompt logprobs (servelm's /v1/completions does not compute them: echo with
logprobs is refused), which loglikelihood tasks would.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import NamedTuple

from servelm.evals import DATA_DIR

TASK = "servelm_arith"
METRIC = "exact_match,first-number"


class LmEvalResult(NamedTuple):
    task: str
    score: float
    stderr: float | None
    num_samples: int
    lm_eval_version: str


def write_task_dir(directory: Path) -> Path:
    """The task YAML with its data paths made absolute (datasets resolves them from the
    working directory), in `directory`."""
    data = DATA_DIR / "lm_eval"
    text = (data / f"{TASK}.yaml").read_text().replace("DATA_DIR", str(data.resolve()))
    (directory / f"{TASK}.yaml").write_text(text)
    return directory


def run_lm_eval(base_url: str, model: str, limit: int | None = None,
                num_concurrent: int = 4) -> LmEvalResult:
    # Offline: the task's data are local files; nothing may reach for a hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory() as tmp:
        manager = TaskManager(include_path=str(write_task_dir(Path(tmp))))
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"base_url": f"{base_url}/v1/completions", "model": model,
                        "tokenizer_backend": None, "tokenized_requests": False,
                        "num_concurrent": num_concurrent, "max_retries": 1,
                        "timeout": 600},
            tasks=[TASK], task_manager=manager, limit=limit, log_samples=False,
            random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    res = out["results"][TASK]
    stderr = res.get(METRIC.replace(",", "_stderr,"))
    return LmEvalResult(TASK, float(res[METRIC]),
                        None if stderr in (None, "N/A") else float(stderr),
                        int(out["n-samples"][TASK]["effective"]), lm_eval.__version__)
