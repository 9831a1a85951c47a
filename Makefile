# Every target works on a fresh clone: `make install` builds .venv from the lock (requirements.txt:
# the versions the tests ran with; pyproject.toml's ranges when the index lacks one of them) and
# installs the project into it (editable), so `manage.py` and `launch_node.py` are on .venv/bin
# and work from any directory.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test test-sglang demo local local-stop bench bench-compare bench-10m chaos readme-story clean

install: $(STAMP)

$(STAMP): requirements.txt requirements-specforge.txt requirements-lowest.txt pyproject.toml
	@echo "== make install: a virtual environment in $(VENV) (about 1.5 minutes the first time)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@echo "== the $$(grep -c '==' requirements.txt) packages of the lock, requirements.txt"
	$(PY) -m pip install --progress-bar on -r requirements.txt \
	  || { echo "== the index lacks a locked version: installing pyproject.toml's ranges instead"; \
	       $(PY) -m pip install --progress-bar on -e '.[dev]'; }
	@echo "== SpecForge, without its own pins (requirements-specforge.txt says why)"
	$(PY) -m pip install --quiet --no-deps -r requirements-specforge.txt
	@echo "== the lowest transformers declared, beside it (requirements-lowest.txt says why)"
	rm -rf $(VENV)/lowest-transformers
	$(PY) -m pip install --quiet --no-deps --target $(VENV)/lowest-transformers -r requirements-lowest.txt
	@echo "== the project itself, editable"
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)
	@echo "== .venv is ready: source .venv/bin/activate puts manage.py and launch_node.py on the PATH"

# The whole suite, a test file per pytest-xdist worker (--dist loadfile: a file's deployments are
# not started twice). Its processes mostly wait on one another, so more workers than cores pays:
# the README gives its measured time on 2 cores.
TEST_WORKERS ?= 4
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# The same checks as tests/test_sglang_parity.py, against the real SGLang 0.5.23 on CPU with a tiny
# model (docs/REAL_SGLANG.md). The first run installs SGLang into .sglang-venv (about 2.6 GB).
test-sglang: install
	bash tools/sglang_cpu/install.sh
	DFLASH_SGLANG_VENV=$(CURDIR)/.sglang-venv $(PY) -m pytest -q tests/sglang_real

demo: install
	$(PY) -m dflash_dev.demo

# A deployment of one's own that stays up (dflash_dev/standalone.py): a Redis of its own with
# persistence on a free port, GPUS simulated GPUs with their workers, beat and Flower; it prints
# the export line a shell needs and the next commands. `make local-stop` stops it all; data, logs
# and batches stay in LOCAL_DIR.
LOCAL_DIR ?= output/local
GPUS ?= 2
local: install
	$(PY) -m dflash_dev.standalone start --dir $(LOCAL_DIR) --gpus $(GPUS)

local-stop:
	$(PY) -m dflash_dev.standalone stop --dir $(LOCAL_DIR)

# The performance benchmark (about twenty minutes on 2 cores): prints the table and writes
# benchmarks/RESULTS.md, and the README's Performance section after a full run.
bench: install
	$(PY) -m benchmarks

# A change against the code before it (REV), on this machine: CASES' makespan / ideal, RUNS runs a
# side taking turns (benchmarks/compare.py; about a minute a run for cases 7 and 13).
REV ?= HEAD~1
CASES ?= 7,13
RUNS ?= 3
bench-compare: install
	$(PY) -m benchmarks.compare --rev $(REV) --cases $(CASES) --runs $(RUNS)

# Case 9 alone: ten million prompts enqueued and resumed with their bodies on storage (about ten
# minutes, and two more the first time, to generate its 11 GB dataset into $$DFLASH_BENCH_CACHE,
# /tmp by default). Writes its own section of benchmarks/RESULTS.md and of the README.
bench-10m: install
	$(PY) -m benchmarks --cases 9

# The long model-based chaos run (tests/chaos.py; make test runs two short sequences): random
# operator actions and faults on a real deployment, the invariants checked after every step; it
# writes test-artifacts/chaos-report.md and .json. A failure prints the command that replays it.
# CONCURRENT=1: bursts of operator commands at once, late duplicate deliveries, and every
# process's race windows widened (tests/chaos.py, CONCURRENT_FAILPOINTS).
#   make chaos SEED=300 STEPS=40 MINUTES=30 [SKIP=redis_restart,...] [KEEP_GOING=1] [CONCURRENT=1]
SEED ?= 1
STEPS ?= 40
MINUTES ?= 0
SKIP ?=
KEEP_GOING ?=
CONCURRENT ?=
chaos: install
	$(PY) tools/chaos.py --seed $(SEED) --steps $(STEPS) --minutes $(MINUTES) $(if $(SKIP),--skip $(SKIP)) $(if $(KEEP_GOING),--keep-going) $(if $(CONCURRENT),--concurrent)

# Runs the README's "Raising max tokens mid-run" commands on a deployment of this machine (its own
# Redis, two simulated servers) and writes what they print into README.md (about a minute).
readme-story: install
	$(PY) tools/readme_story.py

clean:
	rm -rf $(VENV) output test-artifacts
