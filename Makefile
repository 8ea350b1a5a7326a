# pipeswap: `make demo` and `make test` set everything up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pipeswap-installed

.PHONY: setup demo test test-slow test-cuda lint bench clean

setup: $(STAMP)

# --system-site-packages lets a GPU machine keep its own torch build; torch is
# installed only when it is not importable already.
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv --system-site-packages $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test,hf]"
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/pipeswap demo

test: lint
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow

test-cuda: setup
	$(PY) -m pytest -q -m cuda

lint: setup
	$(PY) -m ruff check pipeswap tests benchmarks examples
	$(PY) -m ruff format --check pipeswap tests benchmarks examples
	$(PY) -m mypy pipeswap

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
