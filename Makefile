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

.PHONY: notebooks
notebooks: $(STAMP)  ## re-run the walkthrough notebooks and store their outputs (commit them afterwards)
	$(PY) notebooks/execute.py
