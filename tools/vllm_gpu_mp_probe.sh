#!/usr/bin/env bash
# vLLM's default multiprocess engine (VLLM_ENABLE_V1_MULTIPROCESSING unset) on the GPU machine, side by side: plugin
# off and on (the plugin loaded through its entry point) with vLLM's default start method (fork) and with
# VLLM_WORKER_MULTIPROC_METHOD=spawn, and plugin off with fork and no stack-dump site at all ("off-fork-bare"). Each
# start gets LIMIT seconds; then every process of it dumps its Python stacks (SIGUSR1 to the process group;
# faulthandler armed in every process by tools/vllm_fh_site/sitecustomize.py) and is killed. vLLM logs at DEBUG.
# Usage: tools/vllm_gpu_mp_probe.sh OUTDIR [LIMIT_S [LIBRARY_SRC]] (needs /tmp/vsite; LIBRARY_SRC defaults to this
# checkout's src/)
set -u
out=${1:?usage: OUTDIR [LIMIT_S [LIBRARY_SRC]]}; limit=${2:-120}
root=$(cd "$(dirname "$0")/.." && pwd); lib=${3:-$root/src}
model=/tmp/fused_logp_qwen3_small
mkdir -p "$out"
PYTHONPATH=/tmp/vsite:$lib python3 -P "$root/bench/vllm_gpu.py" small-model --model-dir $model
{ set -x; hostname; getent hosts "$(hostname)"; getent hosts localhost; cat /etc/hosts; df -h /dev/shm /tmp
  ulimit -a; cat /proc/net/dev; python3 -c 'import socket; print(socket.gethostbyname(socket.gethostname()))'
  nproc; nvidia-smi -L; nvidia-smi --query-gpu=compute_mode --format=csv; } > "$out/env.txt" 2>&1
pids=""
probes="off-fork on-fork off-spawn on-spawn off-fork-bare"
for probe in $probes; do
  p=${probe%%-*}; method=${probe#*-}; method=${method%-bare}; site="$root/tools/vllm_fh_site:"
  case $probe in *-bare) site="";; esac
  d=$out/$probe; mkdir -p "$d/tb"
  env -u VLLM_ENABLE_V1_MULTIPROCESSING PYTHONPATH="$site/tmp/vsite:$lib" \
    VLLM_WORKER_MULTIPROC_METHOD=$method FUSED_LOGP_FH_DIR="$d/tb" \
    VLLM_LOGGING_LEVEL=DEBUG VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 \
    timeout -s USR1 -k 10 "$limit" python3 -P "$root/bench/vllm_gpu.py" mpstart --plugin $p --model-dir $model \
    --json "$d/result.json" > "$d/log" 2>&1 &
  pids="$pids $!"
done
( sleep $((limit - 3)); ps -eo pid,ppid,pgid,stat,etimes,pcpu,rss,wchan:32,cmd --forest | grep -v '\[' > "$out/ps.txt" 2>&1 ) &
for pid in $pids; do
  wait "$pid"; rc=$?
  echo "probe pid $pid rc $rc" | tee -a "$out/rc.txt"
  kill -KILL -- "-$pid" 2>/dev/null
done
for probe in $probes; do
  echo "== $probe: $(grep -c . "$out/$probe/log") log lines; $(ls "$out/$probe/tb" | wc -l) stack files; result: $(head -c 300 "$out/$probe/result.json" 2>/dev/null)"
done | tee "$out/summary.txt"
