#!/usr/bin/env bash
# On the SM90 machine, after the extension is built: the forward benchmark with every installed peer at T = 1 and
# T = 0.7 (energy per call beside the time), the backward benchmark, and compute-sanitizer's three tools on the
# smoke shape. Logs and JSON under $OUT. Peers from build/wheels (make peer-wheels) when carried.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SITE=/tmp/peer-site
if ls build/wheels/liger_kernel-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target $SITE build/wheels/liger_kernel-*.whl build/wheels/cut_cross_entropy-*.whl
fi
export PYTHONPATH=$PWD/src:$PWD/tests:$SITE
timeout ${FWD_TIMEOUT:-400} python3 -P bench/benchmark_linear_logp.py --vocab 151936 --temperature 1,0.7 --tag h200-v2 \
  --out "$OUT" ${FWD_ARGS:-} > "$OUT/bench.log" 2>&1; echo "forward rc=$?"; grep -A8 "^NVIDIA\|interleaved rounds" "$OUT/bench.log"
if [ -n "${BWD:-1}" ]; then
  timeout 150 python3 -P bench/benchmark_linear_logp_backward.py --n 8192 --out "$OUT/backward.json" > "$OUT/bench-bwd.log" 2>&1; echo "backward rc=$?"; tail -8 "$OUT/bench-bwd.log"
fi
for tool in memcheck racecheck synccheck; do
  timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 python3 -P bench/benchmark_linear_logp.py --smoke \
    > "$OUT/sanitizer-$tool.log" 2>&1; echo "$tool rc=$?"; tail -2 "$OUT/sanitizer-$tool.log"
done
