#!/usr/bin/env bash
# On the SM90 machine, after the extension is built: the forward benchmark with every installed peer at T = 1 and
# T = 0.7 (energy per call beside the time, ENERGY seconds a window, default 1; FWD_ARGS, default `--sweep
# auto+mainloop`: the mainloop alone of the configuration `auto` runs at each N), then, unless BWD= (empty), the
# backward benchmark, and unless SAN= (empty), compute-sanitizer's three tools on the smoke shape. Logs and JSON under
# $OUT. Liger and CCE from build/wheels (make peer-wheels) when carried; QuACK from /tmp/qsite/site-packages when its
# parts were sent first (make peer-parts; docs/gpu-machine.md, "Peers").
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SITE=/tmp/peer-site
if ls build/wheels/liger_kernel-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target $SITE build/wheels/liger_kernel-*.whl build/wheels/cut_cross_entropy-*.whl
fi
export PYTHONPATH=$PWD/src:$PWD/tests:$SITE
export FUSED_LOGP_CANDIDATE_LAUNCHES=1   # a candidate configuration (kernel/sm90.py) may be named in SWEEP
QSITE=/tmp/qsite/site-packages
if [ -f $QSITE/.quack_gpu_ready ]; then
  export PYTHONPATH=$PYTHONPATH:$QSITE:$QSITE/nvidia_cutlass_dsl/dsl_packages; echo "forward round: QuACK from $QSITE"
else
  echo "forward round: QuACK not installed ($QSITE/.quack_gpu_ready absent)"
fi
timeout ${FWD_TIMEOUT:-400} python3 -P bench/benchmark_linear_logp.py --vocab 151936 --temperature 1,0.7 --tag h200-v2 \
  --energy ${ENERGY:-1} --out "$OUT" ${FWD_ARGS---sweep auto+mainloop} > "$OUT/bench.log" 2>&1; echo "forward rc=$?"; grep -A8 "^NVIDIA\|interleaved rounds" "$OUT/bench.log"
if [ -n "${BWD-1}" ]; then
  timeout 150 python3 -P bench/benchmark_linear_logp_backward.py --n 8192 --out "$OUT/backward.json" > "$OUT/bench-bwd.log" 2>&1; echo "backward rc=$?"; tail -8 "$OUT/bench-bwd.log"
fi
for tool in ${SAN-memcheck racecheck synccheck}; do
  timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 python3 -P bench/benchmark_linear_logp.py --smoke \
    > "$OUT/sanitizer-$tool.log" 2>&1; echo "$tool rc=$?"; tail -2 "$OUT/sanitizer-$tool.log"
done
