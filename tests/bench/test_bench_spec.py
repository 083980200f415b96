"""`servelm bench spec`: method parsing, one measured run on a tiny engine, table and plot."""

import pytest

from servelm.bench.spec import _check_same_tokens, parse_method, plot, run_one, summary


def test_parse_method():
    assert parse_method("off") == {}
    assert parse_method("ngram") == {"speculative_method": "ngram"}
    assert parse_method("layers:8") == {"speculative_method": "draft", "spec_draft_layers": 8}
    assert parse_method("quant:gguf")["spec_draft_quantization"] == "gguf"
    assert parse_method("model:/x")["spec_draft_model"] == "/x"
    assert parse_method("eagle3:/h") == {"speculative_method": "eagle3",
                                         "spec_draft_model": "/h"}
    assert parse_method("eagle3-tree:/h")["spec_tree"] == "dynamic"
    assert parse_method("eagle3-static:/h")["spec_tree"] == "static"
    for bad in ("layers:x", "quant:", "ngram:3", "medusa", "eagle3", "eagle3-tree:"):
        with pytest.raises(ValueError, match="--methods"):
            parse_method(bad)


def test_run_one_reports_speculation(tmp_path):
    from servelm.llm import LLM
    from tiny_models import make_tiny_engine, make_tiny_hf_model

    hf = make_tiny_hf_model("llama", num_hidden_layers=2)
    runs = []
    for method, kw in (("off", {}), ("layers:1", {"speculative_method": "draft",
                                                   "spec_draft_layers": 1})):
        llm = LLM(engine=make_tiny_engine(hf, **kw))
        row = run_one(llm, [[5, 6, 7, 5, 6, 7], [9, 8, 7]], 12)
        row.update(method=method, mode="fixed" if kw else "-", task="copy", batch=2)
        runs.append(row)
    off, spec = runs
    assert off["num_output_tokens"] == spec["num_output_tokens"] == 24
    assert off["spec_proposed"] == 0 and spec["spec_proposed"] > 0
    assert spec["mean_accepted_length"] >= 1.0 and "controller" in spec
    _check_same_tokens(runs)
    assert spec["same_tokens_as_off"] is True
    result = {"model": "tiny", "num_speculative_tokens": 4, "output_len": 12,
              "machine": {"cpu": "test"}, "runs": runs}
    assert "layers:1" in summary(result)
    png = plot(result, tmp_path / "spec.png")
    assert png is not None and png.stat().st_size > 0
