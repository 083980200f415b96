import pytest


@pytest.fixture(scope="session")
def default_model_path():
    """The default registry model (SmolLM2-135M-Instruct Q4_1 GGUF), pulled into the cache once.

    A failed pull is an error, not a skip: tests that need the real model must not pass silently.
    """
    from servelm.loader.model_cache import DEFAULT_MODEL, pull

    return pull(DEFAULT_MODEL)


@pytest.fixture(autouse=True)
def _restore_cpu_kernel_choice():
    """An engine build sets the process's CPU kernel choice (servelm/cpu_kernels): put the
    one the test started with back, so no test inherits another's."""
    from servelm import cpu_kernels

    saved = cpu_kernels.current_choice()
    yield
    cpu_kernels._choice = saved


@pytest.fixture
def cpu_kernel_mode(monkeypatch):
    """set_mode(part, mode): the process's CPU kernel choice for a part, for layers built or
    run outside an engine (an engine takes EngineArgs(cpu_kernels=...) instead)."""
    from servelm import cpu_kernels

    def set_mode(part: str, mode: str) -> None:
        monkeypatch.setattr(cpu_kernels, "_choice",
                            cpu_kernels.current_choice().replace(**{part: mode}))

    return set_mode


from tiny_models import make_tiny_engine, make_tiny_hf_model  # noqa: E402


@pytest.fixture
def tiny_hf():
    return make_tiny_hf_model


@pytest.fixture
def tiny_engine():
    return make_tiny_engine
