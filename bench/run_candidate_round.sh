#!/usr/bin/env bash
# On the SM90 machine, one call for every candidate configuration (kernel/sm90.py CANDIDATE_LAUNCHES and
# DZ_CANDIDATE_LAUNCHES) at once, the most informative steps first so that a call cut at its time limit still
# returns them: the extension build; the candidates' byte tests as a hang guard (GUARD_TESTS, a pytest -k expression
# over test_sm90.py and test_backward_gpu.py; 170 s); the forward A/B at T = 1 (bench/ab_launches.py, AB_N rows,
# AB_LAUNCHES, 7 interleaved rounds; ab-t1.json); the backward with the dz configurations in interleaved rounds
# (DZ_N rows, DZ_AB, none: skipped; backward-dz.json); then, where STEPS names them, the DRAM traffic of NCU_LAUNCHES
# at NCU_N rows under Nsight Compute, with the statistics and their mainloop alone (ncu; ncu.txt), `make test-gpu` (tests) and the
# sanitizers (sanitizers). Logs under $OUT, a line per step with its exit status and the time.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/tests FUSED_LOGP_CANDIDATE_LAUNCHES=1
step() { echo "== $1 rc=$2 $(date +%T)"; }
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
timeout ${BUILD_TIMEOUT:-330} python3 -P -c "from fused_logp.kernel.sm90 import SM90Backend; print(SM90Backend().available())" \
  > "$OUT/build.log" 2>&1; rc=$?; step build $rc; tail -2 "$OUT/build.log"; [ $rc = 0 ] || exit $rc
timeout 170 python3 -P -m pytest -v -x -p no:cacheprovider tests/sm90/test_sm90.py tests/backward/test_backward_gpu.py \
  -k "${GUARD_TESTS:-launch_names or register_store or swapped_operands or pingpong_dz or dz_kernel}" > "$OUT/guard.txt" 2>&1
rc=$?; step guard $rc; grep -E "FAILED|passed|failed|Timeout" "$OUT/guard.txt" | tail -6; [ $rc = 0 ] || exit $rc
timeout ${AB_TIMEOUT:-200} python3 -P bench/ab_launches.py --n "${AB_N:-2048,4096,8192,16384}" \
  --launches "${AB_LAUNCHES:-gemm,cta-128x256,pingpong-128x192,pingpong-128x192+mainloop,pingpong-128x192-mc2,pingpong-128x192-mc2+mainloop}" \
  --out "$OUT" --tag t1 > "$OUT/ab-t1.log" 2>&1; step ab-t1 $?
python3 - "$OUT/ab-t1.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except OSError:
    sys.exit(0)
for n, v in d["n"].items():
    g = v.get("gemm", {}).get("median_ms")
    print(n, {k: (round(x["median_ms"], 3), round(x["median_ms"] / g, 3) if g else None) for k, x in v.items()})
PY
if [ "${DZ_AB-}" != none ]; then
  timeout ${DZ_TIMEOUT:-200} python3 -P bench/benchmark_linear_logp_backward.py --n ${DZ_N:-8192} \
    --dz-launches "${DZ_AB:-cta-128x256,pingpong-128x192,pingpong-128x192-dyn}" --out "$OUT/backward-dz.json" \
    > "$OUT/backward-dz.txt" 2>&1
  step dz-ab $?; tail -6 "$OUT/backward-dz.txt"
fi
case " ${STEPS-} " in *" ncu "*)
  for L in $(echo "${NCU_LAUNCHES:-pingpong-128x192,pingpong-128x192-mc2,cta-128x256}" | tr , ' '); do
    for M in "" --mainloop-only; do
      echo "== $L N=${NCU_N:-8192} $M"
      timeout 60 ncu --metrics gpu__time_duration.sum,dram__bytes_write.sum,dram__bytes_read.sum,lts__t_sectors_op_write.sum \
        --kernel-name regex:"pingpong_kernel|fused_cta_kernel" --launch-count 1 \
        python3 -P bench/profile_forward.py --n "${NCU_N:-8192}" --launch "$L" --seconds 0.2 $M 2>&1 | grep -E "dram__|lts__|gpu__time"
    done
  done > "$OUT/ncu.txt" 2>&1; step ncu $?; cat "$OUT/ncu.txt";;
esac
case " ${STEPS-} " in *" tests "*)
  make --no-print-directory test-gpu > "$OUT/tests-gpu.txt" 2>&1; step test-gpu $?; tail -2 "$OUT/tests-gpu.txt";;
esac
case " ${STEPS-} " in *" sanitizers "*)
  make --no-print-directory gpu-sanitizers OUT="$OUT" > "$OUT/sanitizers.log" 2>&1; step sanitizers $?
  grep "rc=" "$OUT/sanitizers.log" | tail -12;;
esac
