"""Every model in the planner's catalog builds (on the meta device: shapes, no memory) with
exactly the total and active parameter counts the planner computes for it."""

import pytest
import torch

from servelm.cost import count_params
from servelm.models import get_model_class
from servelm.planner.model_catalog import builtin_model, catalog_names


@pytest.mark.parametrize("name", catalog_names())
def test_planner_counts_equal_the_built_model(name):
    config = builtin_model(name)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, None)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(m.w13.numel() + m.w2.numel() for m in model.modules() if hasattr(m, "w13"))
    unchosen = routed - routed * config.num_experts_per_tok // max(config.num_experts, 1)
    counts = count_params(config)
    assert counts.total == total
    assert counts.active == total - unchosen
