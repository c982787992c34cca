"""The vLLM plugin on an SM90 GPU with real vLLM, by job; run through bench/vllm_gpu.py (its docstring lists the parts).

common.py  model shape and the CPU dry run, the models, the in-process engine, the result header, child processes
checks.py  check, logprobs-mode, modes, mpstart: every returned value against the trainer op
speed.py   speed, speed-ab, speed-paired (speed-serve), score: decode tok/s plugin on and off, the trainer's scoring
probes.py  the host's counters, the garbage collector's clock, per-step timers, the split profile
cli.py     the command line and `all`

Each module imports only the standard library at import time (torch and vLLM inside the functions), so that the
command line parses before vLLM is configured and the CPU can import every module."""
