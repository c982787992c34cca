"""What the host does while the speed parts run: time in Python's garbage collector (_GcClock), the machine's steal
time, per-thread CPU ticks, involuntary switches and a fixed pure-Python workload's time (_HostCounters, _proc_stat,
_proc_ticks), per-step host time and device span of wrapped vLLM functions (_StepTimers), and the split profile of a
decode step (_split_profile: cProfile, torch.profiler, synchronising calls; FUSED_LOGP_VLLM_BENCH_PROFILE=1)."""
from __future__ import annotations

import os
import time

from .common import DEV, _decode_batch, _sync, _timed_generate


class _GcClock:
    """Time in Python's garbage collector (seconds and collections, by generation) while installed."""

    def __init__(self):
        self.seconds = {0: 0.0, 1: 0.0, 2: 0.0}
        self.count = {0: 0, 1: 0, 2: 0}
        self._start: list = []

    def _on_gc(self, phase, info):
        if phase == "start":
            self._start.append(time.perf_counter())
        elif self._start:
            self.seconds[info["generation"]] += time.perf_counter() - self._start.pop()
            self.count[info["generation"]] += 1

    def reset(self):
        for k in self.seconds:
            self.seconds[k], self.count[k] = 0.0, 0

    def total(self) -> float:
        return sum(self.seconds.values())

    def __enter__(self):
        import gc
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc):
        import gc
        gc.callbacks.remove(self._on_gc)


def _proc_stat(path: str):
    """-> (name, the fields after it) of a /proc/.../stat file: fields[11] + fields[12] are the user and system
    ticks, fields[36] the CPU it last ran on."""
    st = open(path).read()
    return st[st.index("(") + 1: st.rindex(")")], st[st.rindex(")") + 2:].split()


class _HostCounters:
    """What the host did during the timed runs (start() ... stop() around each; Linux /proc, zeros elsewhere): the
    machine's steal time (ticks of 1/100 s summed over vCPUs: time the hypervisor gave a vCPU to someone else) and
    busy time, this process's CPU ticks per thread (the main thread, and the busiest others by name), and its
    threads' involuntary context switches (preempted while runnable). A spinning thread, a busy neighbour or a slow
    vCPU shows here."""

    def __init__(self):
        import collections
        self.main = str(os.getpid())
        self.sums = collections.Counter()
        self.others = collections.Counter()
        self._t0 = None
        self.probe_ms = []          # the fixed pure-Python workload's time before and after each timed run
        self.cpus = collections.Counter()      # the vCPU the main thread last ran on, at each start and stop

    @staticmethod
    def py_probe() -> float:
        """Milliseconds of one fixed pure-Python workload (dict and list work of the kind vLLM's scheduler does,
        ~5 ms): the speed of this process's main thread on this host at that moment, independent of vLLM."""
        t = time.perf_counter()
        d = {}
        for i in range(40000):
            d[i & 1023] = d.get(i & 1023, 0) + i
        sorted(list(d.values()) * 20)
        return 1e3 * (time.perf_counter() - t)

    def _cpu(self):
        try:
            self.cpus[int(_proc_stat(f"/proc/self/task/{self.main}/stat")[1][36])] += 1
        except (OSError, ValueError, IndexError):
            pass

    @staticmethod
    def _read():
        out = {"steal": 0, "busy": 0, "threads": {}, "nonvol": 0}
        try:
            v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
            out["busy"] = v[0] + v[1] + v[2] + v[5] + v[6]
            out["steal"] = v[7] if len(v) > 7 else 0
            for tid in os.listdir("/proc/self/task"):
                try:
                    name, fields = _proc_stat(f"/proc/self/task/{tid}/stat")
                    status = open(f"/proc/self/task/{tid}/status").read()
                except OSError:
                    continue
                out["threads"][tid] = (name, int(fields[11]) + int(fields[12]))
                for line in status.splitlines():
                    if line.startswith("nonvoluntary_ctxt_switches"):
                        out["nonvol"] += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            pass
        return out

    def start(self):
        self.probe_ms.append(self.py_probe())
        self._cpu()
        self._t0 = self._read()

    def stop(self):
        t1, t0 = self._read(), self._t0
        self.probe_ms.append(self.py_probe())
        self._cpu()
        self.sums["steal_ticks"] += t1["steal"] - t0["steal"]
        self.sums["machine_busy_ticks"] += t1["busy"] - t0["busy"]
        self.sums["nonvoluntary_switches"] += t1["nonvol"] - t0["nonvol"]
        for k, (name, ticks) in t1["threads"].items():
            d = ticks - t0["threads"].get(k, ("", 0))[1]
            if k == self.main:
                self.sums["main_thread_ticks"] += d
            elif d > 0:
                self.others[f"{name}:{k}"] += d
        self.sums["threads"] = len(t1["threads"])

    def report(self) -> dict:
        return dict(self.sums, other_threads_ticks=sum(self.others.values()),
                    busiest_other_threads=dict(self.others.most_common(5)),
                    py_probe_ms=[round(x, 3) for x in self.probe_ms],
                    main_thread_cpus={str(c): n for c, n in sorted(self.cpus.items())})


def _proc_ticks(pid: int):
    """CPU ticks (1/100 s, user + system, all threads) of process `pid` so far; None where /proc cannot tell."""
    try:
        f = _proc_stat(f"/proc/{pid}/stat")[1]
        return int(f[11]) + int(f[12])
    except (OSError, ValueError, IndexError):
        return None


class _StepTimers:
    """Per-call host time (perf_counter around the call: includes any host synchronisation inside) and device span
    (CUDA events before and after, on the current stream; no synchronisation) of a few vLLM methods, by class-level
    wrapping. Only while `on`."""

    def __init__(self):
        import collections
        self.on = False
        self.host = collections.defaultdict(float)
        self.calls = collections.Counter()
        self.events = collections.defaultdict(list)
        self._undo = []

    def wrap(self, cls, name, key, restore: bool = True, device: bool = True):
        """Time cls.name (a class or a module attribute) under `key`; unwrap() puts it back unless restore=False.
        device=False: host time only (no CUDA events: for small host-side functions)."""
        import functools

        import torch
        orig = cls.__dict__.get(name, getattr(cls, name))
        timers = self
        device = device and DEV == "cuda"              # the dry run on the CPU times the host only

        @functools.wraps(orig)
        def timed(*args, **kwargs):
            if not timers.on:
                return orig(*args, **kwargs)
            if device:
                s = torch.cuda.Event(enable_timing=True)
                s.record()
            t = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                timers.host[key] += time.perf_counter() - t
                timers.calls[key] += 1
                if device:
                    e = torch.cuda.Event(enable_timing=True)
                    e.record()
                    timers.events[key].append((s, e))
        setattr(cls, name, timed)
        if restore:
            self._undo.append((cls, name, orig))

    def unwrap(self):
        """Put every wrapped method back."""
        for cls, name, orig in self._undo:
            setattr(cls, name, orig)
        self._undo.clear()

    def reset(self):
        self.host.clear()
        self.calls.clear()
        self.events.clear()

    def report(self, steps: int) -> dict:
        _sync()
        out = {}
        for k in self.calls:
            dev = sum(s.elapsed_time(e) for s, e in self.events[k])
            out[k] = {"calls": self.calls[k], "host_ms_per_step": round(1e3 * self.host[k] / steps, 4)}
            if self.events[k]:
                out[k]["device_span_ms_per_step"] = round(dev / steps, 4)
        return out


def _split_profile(llm, g, plugin: bool, out_tokens: int = 64) -> dict:
    """Where a decode step's time goes, plugin on or off (in-process engine: the worker runs in this process).
    Per batch size 1, 64, 256: step wall time; host ms and device span per step of the lm_head
    (LogitsProcessor.forward), the sampler (MRV2 Sampler.__call__), the runner's execute_model / sample_tokens;
    cProfile top functions; torch.profiler kernel totals and host-synchronising calls per step; and, with torch's
    sync debug mode, every synchronising torch call with the stack frames that made it."""
    import cProfile
    import pstats
    import warnings
    from collections import Counter

    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    timers = _StepTimers()
    timers.wrap(LogitsProcessor, "forward", "lm_head")
    timers.wrap(Sampler, "__call__", "sampler")
    timers.wrap(GPUModelRunner, "execute_model", "execute_model")
    timers.wrap(GPUModelRunner, "sample_tokens", "sample_tokens")
    res = {}
    for bs in (1, 64, 256):
        prompts, params = _decode_batch(g, bs, out_tokens)
        llm.generate(prompts, params, use_tqdm=False)
        r = {}
        _, wall = _timed_generate(llm, prompts, params, timers)
        steps = timers.calls["sample_tokens"] or out_tokens
        r["steps"] = steps
        r["step_wall_ms"] = round(1e3 * wall / steps, 4)
        r["timers"] = timers.report(steps)
        # time in Python's garbage collector per step, by generation
        with _GcClock() as clock:
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            r["gc_check_step_wall_ms"] = round(1e3 * (time.perf_counter() - t) / steps, 4)
        r["gc_ms_per_step"] = {k: round(1e3 * v / steps, 4) for k, v in clock.seconds.items()}
        r["gc_collections"] = dict(clock.count)
        # cProfile of one generate (the engine core's loop and the worker run in this thread)
        pr = cProfile.Profile()
        pr.enable()
        llm.generate(prompts, params, use_tqdm=False)
        pr.disable()
        st = pstats.Stats(pr)
        rows = []
        for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items():
            rows.append((f"{fn.split('site-packages/')[-1].split('/src/')[-1]}:{line}({name})", nc, tt, ct))
        r["cprofile_top_tottime_ms_per_step"] = {k: [n, round(1e3 * tt / steps, 4)] for k, n, tt, ct in
                                                 sorted(rows, key=lambda x: -x[2])[:30]}
        r["cprofile_top_cumtime_ms_per_step"] = {k: [n, round(1e3 * ct / steps, 4)] for k, n, tt, ct in
                                                 sorted(rows, key=lambda x: -x[3])[:45]}
        r["cprofile_fused_logp_cum_ms_per_step"] = {k: [n, round(1e3 * ct / steps, 4)] for k, n, tt, ct in
                                                    sorted(rows, key=lambda x: -x[3])
                                                    if "fused_logp" in k}
        r["cprofile_fused_logp_cum_ms_per_step"] = dict(list(r["cprofile_fused_logp_cum_ms_per_step"].items())[:40])
        # torch.profiler: device kernel totals and synchronising runtime calls per step
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
        ev = prof.key_averages()
        kern = sorted((e for e in ev if getattr(e, "device_time_total", 0) > 0 and e.device_type.name == "CUDA"),
                      key=lambda e: -e.device_time_total)
        r["kernels_top_us_per_step"] = {e.key[:90]: [e.count, round(e.device_time_total / steps, 2)]
                                        for e in kern[:20]}
        r["device_kernel_ms_per_step"] = round(sum(e.device_time_total for e in kern) / steps / 1e3, 4)
        r["runtime_sync_calls_per_step"] = {e.key: round(e.count / steps, 2) for e in ev if any(
            x in e.key for x in ("Synchronize", "cudaMemcpy", "aten::item", "_local_scalar_dense", "EventQuery"))}
        # torch's sync debug mode names every synchronising torch call; keep the frames that made it
        seen: Counter = Counter()
        orig_show = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            import traceback
            frames = [f for f in traceback.extract_stack()[:-1] if "/vllm/" in f.filename or "fused_logp" in f.filename]
            key = " <- ".join(f"{f.filename.split('site-packages/')[-1].split('/src/')[-1]}:{f.lineno}"
                              for f in frames[::-1][:4])
            seen[f"{str(message)[:60]} @ {key}"] += 1
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                llm.generate(prompts, params, use_tqdm=False)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = orig_show
        r["synchronising_torch_calls_per_step"] = {k: round(v / steps, 2) for k, v in seen.most_common(25)}
        res[str(bs)] = r
    timers.unwrap()
    return res
