#!/bin/bash
# One call on the H200 for the forward kernel (docs/design/sm90-kernel.md): build the extension (FUSED_LOGP_PTXAS=1: with
# the ptxas resource report of every kernel), a smoke run of every launch configuration, GPU tests (TESTS: "make" =
# `make test-gpu`, "none", or pytest arguments; TESTS_K: their -k expression), the forward benchmark at the issue's sizes with cuBLAS, Liger and CCE
# in the same run (their wheels in build/wheels, `make peer-wheels`; BENCH=0 skips it), and compute-sanitizer
# memcheck + racecheck on the smoke run (SANITIZE=0 skips them).
# Logs and JSON under $OUT (at most 8 files come back from a call); a short summary last.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
TAG=${TAG:-h200}
DATE=${DATE:-$(date +%F)}
SUFFIX=${SUFFIX:-}
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=$PWD/build/torch_ext      # kept on a warm machine: a second call rebuilds changed units only
PY=python3
LOG="$OUT/run-$TAG-$DATE$SUFFIX.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$LOG" 2>&1

echo "## build" >> "$LOG"
if [ "${FUSED_LOGP_PTXAS:-0}" = 1 ]; then
  # the same flags (-Xptxas=-v) for every later step: other flags would make torch rebuild the extension
  export FUSED_LOGP_PTXAS_V=1
  { time FUSED_LOGP_BUILD_VERBOSE=1 timeout 300 $PY -P -c \
      "from fused_logp.kernel.sm90 import SM90Backend; print(SM90Backend().available())"; } \
    > "$OUT/ptxas-$TAG-$DATE$SUFFIX.txt" 2>&1
  echo "build rc=$?" >> "$OUT/ptxas-$TAG-$DATE$SUFFIX.txt"
  grep -E "Compiling entry|registers|spill|stack|C75|error|real|build rc|True|False" \
    "$OUT/ptxas-$TAG-$DATE$SUFFIX.txt" | grep -v "^ptxas info    : Function properties" | tail -60 >> "$LOG"
else
  { time timeout 300 $PY -P -c "from fused_logp.kernel.sm90 import SM90Backend; print(SM90Backend().available())"; } \
    >> "$LOG" 2>&1
  echo "build rc=$?" >> "$LOG"
fi

echo "## smoke" >> "$LOG"
timeout 60 $PY -P bench/benchmark_linear_logp.py --smoke >> "$LOG" 2>&1
smoke=$?
echo "smoke rc=$smoke" >> "$LOG"

peer_site=build/peer-site
rm -rf $peer_site
if ls build/wheels/liger_kernel-*.whl build/wheels/cut_cross_entropy-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target $peer_site \
    build/wheels/liger_kernel-*.whl build/wheels/cut_cross_entropy-*.whl >> "$LOG" 2>&1
fi
BLOG="$OUT/bench-$TAG-$DATE$SUFFIX.txt"
if [ $smoke -eq 0 ] && [ "${BENCH:-1}" = 1 ]; then
  PYTHONPATH=$PYTHONPATH:$PWD/$peer_site timeout ${BENCH_TIMEOUT:-180} $PY -P bench/benchmark_linear_logp.py \
    --n ${BENCH_N:-1,256,2048,8192,16384} --vocab 151936 --rep ${REP:-200} --tag "$TAG" --out "$OUT" \
    --sweep ${SWEEP:-cta-128x256,cta-128x256-fast-x3+mainloop,cta-128x256+mainloop} > "$BLOG" 2>&1
  echo "bench rc=$?" >> "$BLOG"
  [ -f "$OUT/bench-$TAG-$DATE.json" ] && [ -n "$SUFFIX" ] && mv "$OUT/bench-$TAG-$DATE.json" "$OUT/bench-$TAG-$DATE$SUFFIX.json"
fi

TESTS=${TESTS:-make}
TLOG="$OUT/tests-gpu-$TAG-$DATE$SUFFIX.txt"
if [ "$TESTS" = make ]; then
  timeout ${TEST_TIMEOUT:-300} make test-gpu PYTHON=$PY > "$TLOG" 2>&1
  echo "make test-gpu rc=$?" >> "$TLOG"
elif [ "$TESTS" != none ]; then
  timeout ${TEST_TIMEOUT:-300} $PY -P -m pytest -q -ra -p no:cacheprovider -m gpu --durations=8 $TESTS \
    ${TESTS_K:+-k "$TESTS_K"} > "$TLOG" 2>&1
  echo "pytest rc=$?" >> "$TLOG"
fi

if [ $smoke -eq 0 ] && [ "${SANITIZE:-1}" = 1 ]; then
  for tool in memcheck racecheck; do
    timeout ${SAN_TIMEOUT:-90} compute-sanitizer --tool $tool $PY -P bench/benchmark_linear_logp.py --smoke \
      ${SAN_LAUNCHES:+--smoke-launches $SAN_LAUNCHES} \
      > "$OUT/sanitizer-$tool-$TAG-$DATE$SUFFIX.txt" 2>&1
    echo "$tool rc=$?" >> "$OUT/sanitizer-$tool-$TAG-$DATE$SUFFIX.txt"
  done
fi

echo "== summary"
grep -E "registers|spill|C75|build rc|True|False|smoke|real" "$LOG" | tail -40
grep -E "^ +151936|V=151936|rc=" "$BLOG" 2>/dev/null | tail -24
tail -4 "$TLOG" 2>/dev/null
for tool in memcheck racecheck; do tail -2 "$OUT/sanitizer-$tool-$TAG-$DATE$SUFFIX.txt" 2>/dev/null; done
