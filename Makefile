# servelm: the two commands a new user needs.
#   make serve   venv + install + pull the default model + start the OpenAI server on 127.0.0.1:8000
#   make chat    the same, but an interactive chat in the terminal
#   make test    venv + test extras + the whole suite
#   make wheel   a wheel carrying prebuilt kernels for each instruction-set level (setup.py)
# Each builds servelm's C++ CPU kernels for this CPU first (once a machine, about a minute), so
# that no first request pays for it.
# TORCH_SPEC pins the CPU build that lies on this machine's disk; on a GPU machine override it,
# e.g. `make serve TORCH_SPEC=torch==2.13.0 PIP_TORCH_ARGS="--index-url <cuda index>"`.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PIP_TORCH_ARGS ?=
# servelm.loader.model_cache.DEFAULT_MODEL (make runs before the venv that could import it)
MODEL ?= smollm2-135m-instruct
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

BIN := $(VENV)/bin

.PHONY: serve chat test install clean browser kernels wheel

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q "$(TORCH_SPEC)" $(PIP_TORCH_ARGS)
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

kernels: $(VENV)/.installed
	$(BIN)/servelm kernels build

# The prebuilt libraries are compiled against the venv's (pinned) torch: --no-isolation (setup.py).
wheel: $(VENV)/.installed
	$(BIN)/pip install -q build
	SERVELM_KERNEL_LEVELS=all $(BIN)/python -m build --wheel --no-isolation

# The dashboard's browser test drives Debian's headless chromium (Playwright's own download
# cannot work offline): installed with apt-get when missing and this is root; otherwise the
# test says why it skips.
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	else echo "no chromium and not root: the dashboard browser test will skip"; fi

serve: kernels
	$(BIN)/servelm models pull $(MODEL)
	$(BIN)/servelm serve $(MODEL) --host $(HOST) --port $(PORT)

chat: kernels
	$(BIN)/servelm models pull $(MODEL)
	$(BIN)/servelm chat $(MODEL)

test: $(VENV)/.installed-test browser kernels
	$(BIN)/servelm models pull $(MODEL)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
