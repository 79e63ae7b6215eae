# dpgs developer entry points. Every target creates .venv when it is missing.
# torch is pinned first so that pip never resolves a different (CUDA) build here;
# set TORCH_SPEC to install another build (for example on a GPU machine).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dpgs-installed

.PHONY: install test test-slow cluster-test image-test demo demo-tiles lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

# The demo: 1000 digits bags, then the same ABMIL trained two ways and compared side by side:
# `classic` (one bag per step, what CLAM-style repos do) and DPGS on Ray (2 virtual nodes,
# B=16 bags per step, compression chosen from the measured link: the built-in defaults). Results go to MLflow (./mlflow.db).
demo: $(STAMP)
	$(VENV)/bin/dpgs demo-data demo_data --bags 1000 --seed 0
	$(VENV)/bin/dpgs train --config configs/demo.yaml train.mode=classic tracking.run_name=classic \
		train.output_dir=runs/demo-classic
	$(VENV)/bin/dpgs train --config configs/demo-dpgs.yaml tracking.run_name=dpgs-P2-B16-auto
	$(VENV)/bin/dpgs compare --experiment dpgs-demo --metric val_auc --latest --out runs/demo-compare
	@echo
	@echo "MLflow results: sqlite:///mlflow.db (experiment dpgs-demo)"
	@echo "open them with: $(VENV)/bin/mlflow ui --backend-store-uri sqlite:///mlflow.db  (then http://127.0.0.1:5000)"

# Tile bags end to end: 100 synthetic slides (60 train / 20 val / 20 test), tissue tiles, ResNet-18 (big
# layers) + ABMIL trained by DPGS (2 workers, B=16, compression chosen from the measured link), then the
# frozen-encoder baseline, compared.
demo-tiles: $(STAMP)
	$(VENV)/bin/dpgs demo-data demo_slides --kind slides --bags 100 --seed 0
	$(VENV)/bin/dpgs tile demo_slides/slides demo_slides/tiles --tile-size 32 --level 1
	$(VENV)/bin/dpgs train --config configs/tiles-demo.yaml tracking.run_name=end-to-end
	$(VENV)/bin/dpgs train --config configs/tiles-demo.yaml model.freeze_encoder=true \
		tracking.run_name=frozen-encoder train.output_dir=runs/tiles-demo-frozen
	$(VENV)/bin/dpgs compare --experiment dpgs-tiles-demo --metric val_auc --latest --out runs/tiles-demo-compare

# The cluster image (docker/Dockerfile) built here and used, as root: Debian's docker.io with a private
# dockerd, a debootstrap Debian root as BASE_IMAGE, torch from a local wheel folder, then dpgs --version,
# the imports and one epoch of the demo configs in a container, then `ray up` with the docker section on
# three lab hosts (tests/image/). Wheels cached in .image-cache/ (git-ignored), the daemon's data and the
# saved image in /var/tmp/dpgs-image-test: a second run rebuilds only what changed.
image-test: $(STAMP)
	$(PY) -m tests.image --torch-spec "$(TORCH_SPEC)"

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

# The multi-host lab (as root): a head and two worker hosts in Linux namespaces on this machine, `ray up`
# with configs/cluster.yaml, DPGS training on it, network faults, `ray down` (tests/lab/, docs/cluster.md).
cluster-test: $(STAMP)
	$(PY) -m tests.lab.cluster_test

lint: $(STAMP)
	$(VENV)/bin/ruff check dpgs master workers tests benchmarks

clean:
	rm -rf demo_data demo_slides runs mlflow.db mlruns mlartifacts .pytest_cache
