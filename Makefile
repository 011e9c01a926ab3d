# The two commands of the README. Both build .venv from requirements.txt first (once; again when it changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements-installed

.PHONY: demo test

$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

demo: $(STAMP)  ## run every step briefly on whatever this machine has
	$(PY) tools/demo.py

test: $(STAMP)  ## the whole test suite
	$(PY) -m pytest

.PHONY: bench
bench: $(STAMP)  ## the scaling and overhead benchmarks (a minute or two each; see README "Measure it")
	$(PY) benchmarks/scaling.py
	$(PY) benchmarks/overhead.py
