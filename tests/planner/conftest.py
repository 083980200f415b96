import pytest

from servelm.planner.deployment import Deployment
from servelm.planner.hardware import get_accelerator
from servelm.planner.model_catalog import builtin_model


@pytest.fixture
def deploy():
    """Deployment factory: deploy("Llama-3.1-8B", "H100-SXM", tp=1, ...)."""
    def make(model: str = "Llama-3.1-8B", gpu: str = "H100-SXM", **kw) -> Deployment:
        return Deployment(builtin_model(model), get_accelerator(gpu), **kw)
    return make
