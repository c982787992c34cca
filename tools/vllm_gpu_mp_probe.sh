#!/usr/bin/env bash
# vLLM's default multiprocess engine (VLLM_ENABLE_V1_MULTIPROCESSING unset) on the GPU machine, plugin off and on
# (the plugin loaded through its entry point), side by side: each start gets LIMIT seconds, then every process of it
# dumps its Python stacks (SIGUSR1 to the process group; faulthandler armed by tools/vllm_fh_site/sitecustomize.py)
# and is killed. vLLM logs at DEBUG. Usage: tools/vllm_gpu_mp_probe.sh OUTDIR [LIMIT_S]   (needs /tmp/vsite)
set -u
out=${1:?usage: OUTDIR [LIMIT_S]}; limit=${2:-120}
root=$(cd "$(dirname "$0")/.." && pwd)
model=/tmp/fused_logp_qwen3_small
mkdir -p "$out"
PYTHONPATH=/tmp/vsite:$root/src python3 -P "$root/bench/vllm_gpu.py" small-model --model-dir $model
{ set -x; hostname; hostname -f; getent hosts "$(hostname)"; getent hosts localhost; cat /etc/hosts
  df -h /dev/shm /tmp; ulimit -a; cat /proc/net/dev; ls -ld /tmp; python3 -c 'import socket; print(socket.gethostbyname(socket.gethostname()))'
  nproc; nvidia-smi -L; } > "$out/mp-env.txt" 2>&1
pids=""
for p in off on; do
  d=$out/mp-$p; mkdir -p "$d/tb"
  env -u VLLM_ENABLE_V1_MULTIPROCESSING PYTHONPATH="$root/tools/vllm_fh_site:/tmp/vsite:$root/src" \
    FUSED_LOGP_FH_DIR="$d/tb" FUSED_LOGP_FH_AFTER=$((limit - 10)) VLLM_LOGGING_LEVEL=DEBUG \
    VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 \
    timeout -s USR1 -k 10 "$limit" python3 -P "$root/bench/vllm_gpu.py" mpstart --plugin $p --model-dir $model \
    --json "$d/result.json" > "$d/log" 2>&1 &
  pids="$pids $!"
done
( sleep $((limit - 3)); ps -eo pid,ppid,pgid,stat,etimes,pcpu,rss,cmd --forest > "$out/mp-ps.txt" 2>&1 ) &
for pid in $pids; do
  wait "$pid"; rc=$?
  echo "probe pid $pid rc $rc" | tee -a "$out/mp-rc.txt"
  kill -KILL -- "-$pid" 2>/dev/null
done
for p in off on; do echo "== mp-$p: $(grep -c . "$out/mp-$p/log") log lines; result: $(cat "$out/mp-$p/result.json" 2>/dev/null | head -c 300)"; done
