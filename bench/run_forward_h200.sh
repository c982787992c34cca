#!/bin/bash
# One call on the H200 for the forward kernel (bench/NOTES-sm90.md): build the extension, a smoke run of every launch
# configuration, the forward benchmark at the sizes with cuBLAS, Liger and CCE in the same run (their wheels
# in build/wheels, `make peer-wheels`), `make test-gpu`, and compute-sanitizer memcheck + racecheck on the smoke run.
# Logs and JSON under $OUT (at most 8 files come back from a call); a short summary last.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
TAG=${TAG:-h200}
DATE=${DATE:-$(date +%F)}
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=$PWD/build/torch_ext      # kept on a warm machine: a second call rebuilds changed units only
PY=python3
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1

{ time timeout 240 $PY -P -c "from fused_logp.kernel.sm90 import SM90Backend; print(SM90Backend().available())"; } \
  > "$OUT/build.txt" 2>&1
echo "build rc=$?" >> "$OUT/build.txt"

timeout 60 $PY -P bench/benchmark_linear_logp.py --smoke > "$OUT/smoke.txt" 2>&1
smoke=$?
echo "smoke rc=$smoke" >> "$OUT/smoke.txt"

peer_site=build/peer-site
rm -rf $peer_site
if ls build/wheels/liger_kernel-*.whl build/wheels/cut_cross_entropy-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target $peer_site \
    build/wheels/liger_kernel-*.whl build/wheels/cut_cross_entropy-*.whl > "$OUT/peers-install.txt" 2>&1
fi
if [ $smoke -eq 0 ]; then
  PYTHONPATH=$PYTHONPATH:$PWD/$peer_site timeout ${BENCH_TIMEOUT:-180} $PY -P bench/benchmark_linear_logp.py \
    --n ${BENCH_N:-1,256,2048,8192,16384} --vocab 151936 --rep ${REP:-200} --tag "$TAG" --out "$OUT" \
    --sweep ${SWEEP:-cta-128x256,cta-64x256,pingpong-64x256+mainloop,cta-128x256+mainloop} \
    > "$OUT/bench-$TAG-$DATE.txt" 2>&1
  echo "bench rc=$?" >> "$OUT/bench-$TAG-$DATE.txt"
fi

timeout ${TEST_TIMEOUT:-220} make test-gpu PYTHON=$PY > "$OUT/tests-gpu-$TAG-$DATE.txt" 2>&1
echo "make test-gpu rc=$?" >> "$OUT/tests-gpu-$TAG-$DATE.txt"

if [ $smoke -eq 0 ] && [ "${SANITIZE:-1}" = 1 ]; then
  for tool in memcheck racecheck; do
    timeout ${SAN_TIMEOUT:-90} compute-sanitizer --tool $tool $PY -P bench/benchmark_linear_logp.py --smoke \
      > "$OUT/sanitizer-$tool-$TAG-$DATE.txt" 2>&1
    echo "$tool rc=$?" >> "$OUT/sanitizer-$tool-$TAG-$DATE.txt"
  done
fi

echo "== summary"
tail -2 "$OUT/build.txt"; tail -2 "$OUT/smoke.txt"
grep -E "^ +151936|x GEMM|rc=" "$OUT/bench-$TAG-$DATE.txt" 2>/dev/null | tail -16
tail -4 "$OUT/tests-gpu-$TAG-$DATE.txt"
for tool in memcheck racecheck; do tail -2 "$OUT/sanitizer-$tool-$TAG-$DATE.txt" 2>/dev/null; done
