# Every target sets itself up: the virtual environment is created and filled on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PIP_FLAGS ?= -q

.PHONY: tour test grade check docs docs-build bench gpu lint clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) -c constraints.txt -e '.[test,docs,lab]'
	@touch $(STAMP)

## make tour: every lesson's algorithm on a local world, verified against dist.all_reduce
tour: $(STAMP)
	$(PY) -m collectives tour $(TOUR_ARGS)

## make test [JOBS=2]: the whole suite (unit, grader, notebooks, site), on JOBS pytest workers
## (the notebooks and the site share one worker, in order, and so do the simulated clusters)
JOBS ?= 2
test: $(STAMP)
	$(PY) -m pytest $(if $(filter-out 0 1,$(JOBS)),-n $(JOBS) --dist loadgroup) $(PYTEST_ARGS)

## make grade [LESSON=04] [TASK=3] [TIMEOUT=30]: score the exercises in lessons/*/exercise.py
grade: $(STAMP)
	$(PY) -m collectives grade $(if $(LESSON),--lesson $(LESSON)) $(if $(TASK),--task $(TASK)) $(if $(TIMEOUT),--timeout $(TIMEOUT))

## make check LESSON=04 [TASK=3] [WORLD=4] [TIMEOUT=30] [VERBOSE=1]: run one exercise's checks, one line per task
check: $(STAMP)
	@test -n "$(LESSON)" || { echo "usage: make check LESSON=04 [TASK=3] [WORLD=4] [TIMEOUT=30] [VERBOSE=1]"; exit 2; }
	$(PY) $(firstword $(wildcard lessons/$(LESSON)_*/exercise.py) lessons/$(LESSON)_missing/exercise.py) \
		$(if $(TASK),--task $(TASK)) $(if $(WORLD),--world $(WORLD)) $(if $(TIMEOUT),--timeout $(TIMEOUT)) $(if $(VERBOSE),--verbose)

## make docs: build and serve the site on http://127.0.0.1:8000
docs: $(STAMP)
	$(PY) -m mkdocs serve

docs-build: $(STAMP)
	$(PY) -m mkdocs build --strict

## make bench: nccl-tests-style benchmarks against dist.all_reduce (and torch DDP)
##   make bench BENCH_ARGS="--sizes 64M --algo ring" FUSED_ARGS="--iters 40" DDP_ARGS="--model mlp"
bench: $(STAMP)
	$(PY) -m collectives bench $(BENCH_ARGS)
	$(PY) -m collectives bench-fused $(FUSED_ARGS)
	$(PY) -m collectives bench-ddp $(DDP_ARGS)

## make gpu [GPU_OUT=build/gpu] [GPU_PARTS="tests tour ..."] [GPU_COUNTS="4"]: the GPU lane on a machine with 2+
## GPUs, with its own CUDA torch (python3, or PYTHON=...): gpu tests, the tour at every GPU count, every
## benchmark and runner on NCCL, gathered into GPU_OUT/lane.json (tools/gpu_suite.sh)
GPU_OUT ?= build/gpu
gpu:
	PYTHON=$(PYTHON) tools/gpu_suite.sh $(GPU_OUT) $(GPU_PARTS)

clean:
	rm -rf $(VENV) site bench-results

## make lint: ruff over the code (also part of make test: tests/test_lint.py)
lint: $(STAMP)
	$(PY) -m ruff check collectives lessons tests tools
