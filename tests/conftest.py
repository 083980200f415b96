import pytest


@pytest.fixture(scope="session")
def default_model_path():
    """The default registry model (SmolLM2-135M-Instruct Q4_1 GGUF), pulled into the cache once.

    A failed pull is an error, not a skip: tests that need the real model must not pass silently.
    """
    from servelm.loader.model_cache import pull

    return pull("smollm2-135m-instruct")


from tiny_models import make_tiny_engine, make_tiny_hf_model  # noqa: E402


@pytest.fixture
def tiny_hf():
    return make_tiny_hf_model


@pytest.fixture
def tiny_engine():
    return make_tiny_engine
