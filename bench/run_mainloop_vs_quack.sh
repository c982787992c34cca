#!/usr/bin/env bash
# On the SM90 machine, with QuACK's parts sent first (docs/gpu-machine.md, "Peers"): where the forward's mainloop
# stands against QuACK's whole loss-only call, at each of MVQ_N rows (default 2048 and 8192). Two views of the same
# workloads (MVQ_WORKLOADS, default: cuBLAS's bf16 GEMM, `auto` and its mainloop alone, QuACK):
#  - under the power cap: nvidia-smi every 50 ms while each workload repeats for MVQ_SECONDS (default 4): power, SM
#    clock and ms a call, hence joules a call (power.txt, bench/power_summary.py);
#  - per kernel: Nsight Compute's SpeedOfLight and memory sections of three calls' kernels (ncu-*.txt: elapsed cycles,
#    duration, SM frequency, compute, L2 and DRAM throughput; the SM clock is not held fixed under the cap, so the
#    cycles are the figure to compare). MVQ_SECTIONS adds sections (e.g. "WarpStateStats SchedulerStats
#    InstructionStats": where the warps stall and how often a scheduler issues).
# A workload is name:flags of bench/profile_forward.py, the flags joined by commas (e.g.
# mc2m:--launch=pingpong-128x192-mc2,--mainloop-only).
# Fewer cycles for QuACK: its kernel issues better; the same cycles at a higher clock under the cap: it spends less
# energy a FLOP (operand traffic). Logs under $OUT, a line per step with its exit status.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT/power"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/tests FUSED_LOGP_CANDIDATE_LAUNCHES=1
QSITE=/tmp/qsite/site-packages
if [ -f $QSITE/.quack_gpu_ready ]; then
  export PYTHONPATH=$PYTHONPATH:$QSITE:$QSITE/nvidia_cutlass_dsl/dsl_packages
else
  echo "mainloop-vs-quack: QuACK not installed ($QSITE/.quack_gpu_ready absent): its workloads fail"
fi
step() { echo "== $1 rc=$2 $(date +%T)"; }
timeout ${BUILD_TIMEOUT:-330} python3 -P -c "from fused_logp.kernel.sm90 import SM90Backend; print(SM90Backend().available())" \
  > "$OUT/build.log" 2>&1; rc=$?; step build $rc; tail -1 "$OUT/build.log"; [ $rc = 0 ] || exit $rc
SECTIONS=$(for x in SpeedOfLight MemoryWorkloadAnalysis ${MVQ_SECTIONS-}; do printf -- "--section %s " $x; done)
WORKLOADS=${MVQ_WORKLOADS:-"gemm:--gemm auto: mainloop:--mainloop-only quack:--peer=quack"}
for n in $(echo "${MVQ_N:-2048,8192}" | tr , ' '); do
  for run in $WORKLOADS; do
    name=$n-${run%%:*}; flags=${run#*:}; flags=${flags//,/ }
    nvidia-smi --query-gpu=power.draw,power.limit,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader,nounits \
      -lms 50 > "$OUT/power/$name.csv" 2>&1 & smi=$!
    timeout 120 python3 -P bench/profile_forward.py --n $n --warm 3 --seconds ${MVQ_SECONDS:-4} $flags \
      > "$OUT/power/$name.log" 2>&1; rc=$?
    kill $smi; wait $smi 2>/dev/null; sleep 2
    step "power $name" $rc; tail -1 "$OUT/power/$name.log"
  done
done
python3 bench/power_summary.py "$OUT/power" "$OUT"/power/*.csv | tee "$OUT/power.txt"
for n in $(echo "${MVQ_N:-2048,8192}" | tr , ' '); do
  for run in $WORKLOADS; do
    name=$n-${run%%:*}; flags=${run#*:}; flags=${flags//,/ }
    # the kernels of the calls after the warm ones (a QuACK call is its GEMM and a few small kernels): the first 6
    timeout 200 ncu $SECTIONS --nvtx --nvtx-include profiled/ \
      --launch-count 6 python3 -P bench/profile_forward.py --n $n --warm 3 --calls 3 $flags \
      > "$OUT/ncu-$name.txt" 2>&1
    step "ncu $name" $?
    grep -E "^  [A-Za-z_].*\(|Duration|Elapsed Cycles|SM Frequency|Compute \(SM\) Throughput|L2 Cache Throughput|DRAM Throughput|Memory Throughput|Issued Warp Per Scheduler|No Eligible|Warp Cycles Per Issued" \
      "$OUT/ncu-$name.txt" | head -40
  done
done
cd "$OUT" && tar -czf mainloop-vs-quack.tgz power ncu-*.txt && rm -rf power ncu-*.txt
