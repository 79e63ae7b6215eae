# dpgs developer entry points. Every target creates .venv when it is missing.
# torch is pinned first so that pip never resolves a different (CUDA) build here;
# set TORCH_SPEC to install another build (for example on a GPU machine).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dpgs-installed

.PHONY: install test test-slow demo lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check dpgs master workers tests benchmarks

clean:
	rm -rf demo_data runs mlflow.db mlruns .pytest_cache
