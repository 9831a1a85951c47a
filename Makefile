# Every target works on a fresh clone: `make install` builds .venv from the pinned requirements.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test demo bench clean

install: $(STAMP)

$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $(STAMP)

test: install
	$(PY) -m pytest -q tests

demo: install
	$(PY) -m dflash_tasks.demo

# The performance benchmark (about ten minutes): prints the table and writes benchmarks/RESULTS.md.
bench: install
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) output test-artifacts
