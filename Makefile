# The two commands of the README. Both build .venv from requirements.txt first (once; again when it changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements-installed

.PHONY: demo test test-fast

# The pins (torch's wheels, matplotlib) need Python 3.11 or newer: an older one stops here with one line, not a pip error.
PYTHON_IS_NEW_ENOUGH = $(shell $(PYTHON) -c 'import sys; print(sys.version_info >= (3, 11))' 2>/dev/null)

$(STAMP): requirements.txt
	$(if $(filter True,$(PYTHON_IS_NEW_ENOUGH)),,$(error $(PYTHON) is not Python 3.11 or newer, which requirements.txt needs: \
	  run make with PYTHON=python3.11 (or newer)))
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

demo: $(STAMP)  ## run every step briefly on whatever this machine has
	$(PY) tools/demo.py

test: $(STAMP)  ## the whole test suite
	$(PY) -m pytest

test-fast: $(STAMP)  ## the tests that start no processes (docs, diffs, bad input, verdicts, reports): while editing
	$(PY) -m pytest -m "not slow" tests

.PHONY: two-hosts mini-slurm

two-hosts: $(STAMP)  ## multinode.py on two network namespaces with their own IPs (root); prints every command
	$(PY) tools/two_hosts.py

mini-slurm: $(STAMP)  ## slurm/multinode.sbatch on a real two-node Slurm on this machine (root, slurm-wlm, munge)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) tools/minislurm.py 4 2

# Step 5 (fsdp.py): the figures its README section quotes. Files they write go to runs/ (ignored by git).
.PHONY: fsdp-memory dataparallel-vs-ddp

# Each strategy gets a folder of its own (snapshot/ and model_full.pt), removed first: with a shared one the second run would find the first
# one's finished snapshot and measure nothing.
fsdp-memory: $(STAMP)  ## per-rank memory of the wide workload: FSDP, then DDP (2 processes)
	rm -rf runs/fsdp-memory
	for strategy in fsdp ddp; do mkdir -p runs/fsdp-memory/$$strategy && \
		$(PY) -m torch.distributed.run --standalone --nproc_per_node=2 fsdp.py 2 2 --workload wide --verbose \
		--strategy $$strategy --snapshot_path runs/fsdp-memory/$$strategy/snapshot || exit 1; done

dataparallel-vs-ddp: $(STAMP)  ## nn.DataParallel against DDP (on a CPU: one process against several)
	$(PY) benchmarks/dataparallel_vs_ddp.py

.PHONY: notebooks lab
LAB_STAMP := $(VENV)/.requirements-lab-installed

$(LAB_STAMP): requirements-lab.txt $(STAMP)
	$(PY) -m pip install --quiet -r requirements-lab.txt
	touch $@

lab: $(LAB_STAMP)  ## open the walkthrough notebooks in JupyterLab (installs it into .venv the first time)
	$(VENV)/bin/jupyter lab notebooks/

notebooks: $(STAMP)  ## re-run the walkthrough notebooks and store their outputs (commit them afterwards)
	$(PY) notebooks/execute.py

.PHONY: bench
bench: $(STAMP)  ## the scaling and overhead benchmarks (a minute or two each; see README "Measure it")
	$(PY) benchmarks/scaling.py
	$(PY) benchmarks/overhead.py

# On a machine with CUDA GPUs: the GPU tests, every GPU command the pages show and the GPU figures, in under eight
# minutes, into one report (docs/reference.md, "The GPU proof"). It installs nothing: a GPU machine lent for a few minutes
# has its own torch and may reach no package registry. .venv's Python where there is one, else $(PYTHON); OUT: the folder.
.PHONY: gpu-proof
GPU_PROOF_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))

gpu-proof:  ## on a GPU machine: the GPU tests, every GPU command shown, step 6's and 11's figures (under 8 minutes)
	$(GPU_PROOF_PY) benchmarks/gpu_proof.py $(if $(OUT),--out $(OUT))
