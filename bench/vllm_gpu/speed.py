"""The benchmarks: decode tok/s of one engine kind (speed, run_speed), the plugin on and off alternating inside one
engine (speed-ab, run_speed_ab), plain vLLM and the plugin in two engines taking turns (speed-paired,
run_speed_paired, with its engines' processes serve_speed / speed-serve), the trainer-side scoring time (score,
run_score), and the pooling of the speed parts' runs over rounds (_pool_speed, _pool_kinds)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .common import DRY, ENTRY, HIDDEN, VOCAB, _decode_batch, _engine, _timed_generate
from .probes import _GcClock, _HostCounters, _proc_ticks, _split_profile, _StepTimers


# Engine kinds of the speed part. off: plain vLLM, plugin not loaded. on: the plugin enabled (strict, no capture).
# registered: register() called (LogitsProcessor replaced, admission, RPCs, metric) but not enabled in the
# engine's configuration. bypass: enabled, with the plugin's head handing every call to vLLM's own (as speed-ab's
# "off" runs, for the whole engine): the sampler wrappers installed, no op call.
SPEED_KINDS = ("off", "on", "registered", "bypass")


def _switchable_head() -> list:
    """Route the plugin's lm_head through a switch: while flag[0] is True, every call hands over to vLLM's own head
    (`_vllm_logits`: vLLM's bf16 GEMM, logits without the plugin's mark). -> the flag (a one-element list)."""
    from fused_logp.vllm_plugin.head import FusedLogpLogitsProcessor

    flag = [False]
    orig = FusedLogpLogitsProcessor._get_logits

    def _get_logits(self, hidden_states, lm_head, embedding_bias=None, skip_gather=False, **kwargs):
        if flag[0]:
            return self._vllm_logits(hidden_states, lm_head, embedding_bias, skip_gather, kwargs)
        return orig(self, hidden_states, lm_head, embedding_bias, skip_gather, **kwargs)

    FusedLogpLogitsProcessor._get_logits = _get_logits
    return flag


def _speed_part(kind: str, r: int) -> str:
    """The result key (and file stem) of round r's speed part of an engine kind."""
    return f"speed-{kind}" + (f"-r{r}" if r else "")


def _speed_engine(model_dir, kind: str, share: float = 0.5):
    """The engine of a speed part's kind (SPEED_KINDS), as run_speed and speed-paired build it. -> (engine, its
    _StepTimers with vLLM's own Sampler.__call__ wrapped, start seconds)."""
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    if kind not in SPEED_KINDS:
        raise ValueError(f"speed: kind must be one of {SPEED_KINDS}; got {kind!r}")
    plugin = kind in ("on", "bypass")
    # vLLM's own Sampler.__call__, timed inside the plugin's wrapper (wrapped before the engine installs the plugin;
    # the part's process ends with it, so it is never put back): sampler - sampler_inner is the wrapper's own time
    timers = _StepTimers()
    timers.wrap(Sampler, "__call__", "sampler_inner", restore=False)
    if kind == "registered":
        from fused_logp.vllm_plugin import register
        register()
    if kind == "bypass":
        _switchable_head()[0] = True
    t0 = time.time()
    llm = _engine(model_dir, plugin=plugin, capture=False, eager=False, max_num_seqs=256, share=share)
    return llm, timers, round(time.time() - t0, 1)


def run_speed(model_dir, kind: str = "on", out_tokens: int = 64) -> dict:
    import gc

    import torch

    from vllm.v1.worker.gpu.sample.sampler import Sampler

    plugin = kind in ("on", "bypass")
    llm, timers, start_s = _speed_engine(model_dir, kind)
    res = {"plugin": kind == "on", "kind": kind, "start_s": start_s, "out_tokens": out_tokens, "batches": {}}
    if plugin:
        res["status"] = llm.collective_rpc("fused_logp_status")[0]["heads"][0]["provenance"]
    g = torch.Generator().manual_seed(3)
    if plugin:
        # vLLM's start-up warm-up and dummy sampler runs must leave no non-contract notes in a strict engine
        res["non_contract_after_start"] = llm.collective_rpc("fused_logp_status")[0]["heads"][0]["non_contract"]
    for bs in (1, 64, 256):
        prompts, params = _decode_batch(g, bs, out_tokens)
        llm.generate(prompts, params, use_tqdm=False)                   # warm-up
        times, pauses = [], []
        host = _HostCounters()
        with _GcClock() as clock:          # time in Python's garbage collector during each timed run
            for _ in range(9):
                outs = None
                gc.collect()        # every timed run starts from a collected heap (a full collection costs ~0.1 s)
                clock.reset()
                host.start()
                outs, wall = _timed_generate(llm, prompts, params)
                host.stop()
                times.append(wall)
                pauses.append(clock.total())
                assert sum(len(o.outputs[0].token_ids) for o in outs) == bs * out_tokens
        med = statistics.median(times)
        net = statistics.median(t - p for t, p in zip(times, pauses))
        res["batches"][str(bs)] = {"tok_s": round(bs * out_tokens / med, 1), "times_s": [round(x, 4) for x in times],
                                   "gc_pause_s": [round(x, 4) for x in pauses],
                                   "tok_s_without_gc_pauses": round(bs * out_tokens / net, 1),
                                   "host": dict(host.report(), wall_ticks=round(100 * sum(times)))}
    # host time and device span per decode step of the lm_head, the sampler and its parts (one more generate per
    # batch size): sampler (with the plugin's wrapper), sampler_inner (vLLM's own), sample (vLLM's Sampler.sample),
    # topk_scores (vLLM's compute_topk_scores), token_logprobs (the logprob kernel it calls: the plugin's contract
    # columns when on), torch.topk (inside compute_topk_scores)
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.v1.worker.gpu.sample import logprob as logprob_mod
    from vllm.v1.worker.gpu.sample import sampler as sampler_mod
    timers.wrap(LogitsProcessor, "forward", "lm_head")
    timers.wrap(Sampler, "__call__", "sampler")
    timers.wrap(Sampler, "sample", "sample")
    timers.wrap(sampler_mod, "compute_topk_scores", "topk_scores")
    timers.wrap(logprob_mod, "compute_token_logprobs", "token_logprobs")
    timers.wrap(torch, "topk", "torch.topk")
    # host only: vLLM's logprobs probe, the runner's wait for the step's output copy (async scheduling), and the
    # functions the plugin's wrapper calls outside vLLM's sampler
    from vllm.v1.worker.gpu.async_utils import AsyncOutput
    for probe in ("returns_logprobs", "get_logprobs_dims"):          # vLLM 0.26 / 0.32
        if hasattr(Sampler, probe):
            timers.wrap(Sampler, probe, probe, device=False)
    timers.wrap(AsyncOutput, "get_output", "async_get_output", device=False)
    if plugin:
        from fused_logp.vllm_plugin import mrv2_sampler
        for fn in ("mark_of", "host_temperature", "all_unit_temperature", "program_groups", "kept_rows", "rescore"):
            timers.wrap(mrv2_sampler, fn, "wrapper." + fn, device=False)
    res["step_split"] = {}
    for bs in (1, 64, 256):
        prompts, params = _decode_batch(g, bs, out_tokens)
        _, wall = _timed_generate(llm, prompts, params, timers)
        steps = timers.calls["sampler"] or out_tokens
        res["step_split"][str(bs)] = {"steps": steps, "step_wall_ms": round(1e3 * wall / steps, 4),
                                      **timers.report(steps)}
    timers.unwrap()
    if plugin:          # how many rescored rows were read from the head call's statistics (T = 1 batches)
        head = llm.collective_rpc("fused_logp_status")[0]["heads"][0]
        res["rows"] = {k: head.get(k) for k in ("rows_rescored", "rows_head_stats", "op_calls")}
    if os.environ.get("FUSED_LOGP_VLLM_BENCH_PROFILE"):
        res["profile"] = _split_profile(llm, g, plugin, out_tokens)
    return res


def _step_hooks() -> list:
    """(owner, attribute) of vLLM's per-step functions that the plugin wraps (those present in this vLLM)."""
    out = []
    try:
        from vllm.v1.worker.gpu.sample import logprob, prompt_logprob
        from vllm.v1.worker.gpu.sample.sampler import Sampler
    except ImportError:
        return out
    out += [(Sampler, "__call__"), (logprob, "compute_token_logprobs")]
    if hasattr(prompt_logprob, "PromptLogprobsWorker"):
        out += [(prompt_logprob.PromptLogprobsWorker, "compute_prompt_logprobs"),
                (prompt_logprob, "compute_topk_scores")]
    return [(o, n) for o, n in out if _attr(o, n) is not None]


def _attr(owner, name):
    return owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)


def run_speed_ab(model_dir, out_tokens: int = 64, pairs: int = 9) -> dict:
    """Plugin on and off in one engine, alternating: the engine serves with the plugin (strict, no capture), and for
    the "off" runs a bench-side switch makes the plugin's lm_head hand over to vLLM's own (`_vllm_logits`: vLLM's
    bf16 GEMM, logits without the plugin's mark) and puts vLLM's own per-step functions back where the plugin
    wrapped them (MRV2 Sampler.__call__, compute_token_logprobs, the prompt-logprobs worker's step and
    compute_topk_scores; `_step_hooks`), so an "off" step runs vLLM's code and one extra Python call in the head.
    What stays the plugin's in both modes is per request, not per step: the admission check and the sampler's and
    prompt-logprobs worker's add_request, which record each request's flags. Per batch size, `pairs` pairs of timed
    generates in alternating order (off-on, on-off, ...), each after gc.collect(): a drift of the machine's speed
    falls on both. The head's op_calls before and after each mode show that the switch works (off: no op call)."""
    import gc

    import torch

    bypass = _switchable_head()
    hooks = _step_hooks()
    vllm_own = {k: _attr(*k) for k in hooks}
    t0 = time.time()
    llm = _engine(model_dir, plugin=True, capture=False, eager=DRY, max_num_seqs=256, share=0.5)
    res = {"what": "plugin on and off in one engine, alternating (run_speed_ab)", "start_s": round(time.time() - t0, 1),
           "out_tokens": out_tokens, "pairs": pairs, "batches": {}}
    plugin_own = {k: _attr(*k) for k in hooks}
    res["step_hooks_switched"] = [f"{getattr(o, '__name__', o)}.{n}" for (o, n) in hooks
                                  if plugin_own[(o, n)] is not vllm_own[(o, n)]]

    def set_mode(mode):
        bypass[0] = mode == "off"
        for (o, n), fn in (vllm_own if mode == "off" else plugin_own).items():
            setattr(o, n, fn)

    def op_calls():
        return llm.collective_rpc("fused_logp_status")[0]["heads"][0]["op_calls"]

    g = torch.Generator().manual_seed(5)
    for bs in (1, 64, 256):
        prompts, params = _decode_batch(g, bs, out_tokens)
        calls = {"off": 0, "on": 0}
        for mode in ("off", "on"):                                          # warm-up, both modes
            set_mode(mode)
            llm.generate(prompts, params, use_tqdm=False)
        times, pauses = {"off": [], "on": []}, {"off": [], "on": []}
        host = _HostCounters()
        with _GcClock() as clock:
            for i in range(pairs):
                for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
                    set_mode(mode)
                    before = op_calls()
                    outs = None
                    gc.collect()
                    clock.reset()
                    host.probe_ms.append(host.py_probe())
                    outs, wall = _timed_generate(llm, prompts, params)
                    times[mode].append(wall)
                    pauses[mode].append(clock.total())
                    calls[mode] += op_calls() - before
                    assert sum(len(o.outputs[0].token_ids) for o in outs) == bs * out_tokens
        set_mode("on")
        res["batches"][str(bs)] = {
            **_on_off(times, pauses, bs * out_tokens),
            "times_s": {m: [round(x, 4) for x in times[m]] for m in times},
            "gc_pause_s": {m: [round(x, 4) for x in pauses[m]] for m in pauses},
            "py_probe_ms": _median_or_none(host.probe_ms), "op_calls": calls}
    res["non_contract"] = llm.collective_rpc("fused_logp_status")[0]["heads"][0]["non_contract"]
    return res


def _die_with_parent(parent: int):
    """End this process when the process that started it ends (Linux: PR_SET_PDEATHSIG = SIGKILL), and now if it
    has already gone."""
    import signal
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))       # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if parent and os.getppid() != parent:
        os._exit(3)


def _plugin_head_status(llm):
    """The plugin's first head status over its RPC, or None where the plugin is not loaded in this process."""
    if "fused_logp.vllm_plugin" not in sys.modules:
        return None
    try:
        return llm.collective_rpc("fused_logp_status")[0]["heads"][0]
    except Exception:  # noqa: BLE001  (registered, not enabled: no head)
        return None


def serve_speed(model_dir, kind: str, cpus, out_tokens: int = 64, share: float = 0.3):
    """One engine of speed-paired (a child of run_speed_paired): pinned to `cpus` before anything else starts a
    thread, builds the engine of `kind` as run_speed does (GPU memory share `share`, so that two fit on one GPU),
    warms each batch size up with run_speed's prompts and params (_decode_batch, the same seed in both engines),
    then answers one JSON line per command line on stdin, on what was its stdout (vLLM's own output goes to stderr):
      {"cmd": "run", "bs": n}: gc.collect(), then one timed generate -> wall time, gc pause, py_probe before/after
      {"cmd": "status"}: the plugin head's op_calls and non_contract (0 / None without the plugin)
      {"cmd": "host"}: the host's counters over this engine's timed runs, per batch size
      {"cmd": "quit"} or end of stdin: exit. The process also ends when its parent does (_die_with_parent)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    _die_with_parent(int(os.environ.get("FUSED_LOGP_VLLM_BENCH_PAIRED_PARENT", "0")))
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)

    def send(msg):
        proto.write(json.dumps(msg, default=str) + "\n")
        proto.flush()

    try:
        import gc

        import torch

        started_at = time.time()
        llm, _, start_s = _speed_engine(model_dir, kind, share=share)
        head = _plugin_head_status(llm)
        send({"built": True, "kind": kind, "pid": os.getpid(), "started_at": round(started_at, 3),
              "start_s": start_s, "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
              # loaded: the plugin's module imported in this process (on the CPU dry run, its installed entry point
              # registers it in plain engines too); active: an engine head served by the plugin (its status RPC)
              "plugin_loaded": "fused_logp.vllm_plugin" in sys.modules, "plugin_head_active": head is not None,
              "status": head["provenance"] if head else None,
              "non_contract_after_start": head["non_contract"] if head else None})
        t = time.time()
        g = torch.Generator().manual_seed(3)                         # run_speed's prompts and params
        work = {}
        for bs in (1, 64, 256):
            work[bs] = _decode_batch(g, bs, out_tokens)
            llm.generate(*work[bs], use_tqdm=False)                  # warm-up
        hosts = {bs: _HostCounters() for bs in work}
        send({"ready": True, "warm_s": round(time.time() - t, 1)})
        with _GcClock() as clock:
            while True:
                line = sys.stdin.readline()
                if not line:
                    break
                cmd = json.loads(line)
                if cmd["cmd"] == "quit":
                    break
                if cmd["cmd"] == "status":
                    head = _plugin_head_status(llm)
                    send({"op_calls": head["op_calls"] if head else 0,
                          "non_contract": head["non_contract"] if head else None})
                elif cmd["cmd"] == "host":
                    send({str(bs): h.report() for bs, h in hosts.items()})
                elif cmd["cmd"] == "run":
                    bs = int(cmd["bs"])
                    host = hosts[bs]
                    outs = None
                    gc.collect()
                    clock.reset()
                    host.start()
                    outs, wall = _timed_generate(llm, *work[bs])
                    host.stop()
                    n = sum(len(o.outputs[0].token_ids) for o in outs)
                    if n != bs * out_tokens:
                        raise RuntimeError(f"{n} tokens generated, not {bs * out_tokens}")
                    send({"wall_s": wall, "gc_pause_s": clock.total(), "py_probe_ms": host.probe_ms[-2],
                          "py_probe_after_ms": host.probe_ms[-1], "at": round(time.time(), 3)})
                else:
                    raise ValueError(f"unknown command {cmd!r}")
    except BaseException as e:
        send({"error": f"{type(e).__name__}: {e}"})
        raise
    return {}


class _Peer:
    """The coordinator's end of one serve_speed child: JSON lines to its stdin, JSON lines from its stdout (read
    with a time limit), its stderr (vLLM's log) to `log_path`."""

    def __init__(self, kind: str, model_dir, cpus, log_path: Path, share: float):
        cmd = [sys.executable, "-P", str(ENTRY), "speed-serve", "--plugin", kind,
               "--model-dir", str(model_dir), "--share", str(share)]
        if cpus:
            cmd += ["--cpus", ",".join(map(str, cpus))]
        self.kind, self.buf = kind, b""
        self.log = open(log_path, "w")
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                  env=dict(os.environ, FUSED_LOGP_VLLM_BENCH_PAIRED_PARENT=str(os.getpid())))

    def send(self, msg: dict):
        try:
            self.p.stdin.write((json.dumps(msg) + "\n").encode())
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass                                    # recv reports the child's end

    def recv(self, until: float) -> dict:
        import select
        fd = self.p.stdout.fileno()
        while b"\n" not in self.buf:
            left = until - time.time()
            if left <= 0:
                raise TimeoutError(f"speed-paired {self.kind}: no answer in time")
            if not select.select([fd], [], [], min(left, 5.0))[0]:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                try:
                    self.p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
                raise RuntimeError(f"speed-paired {self.kind}: the engine's process ended (rc {self.p.returncode})")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"speed-paired {self.kind}: {msg['error']}")
        return msg

    def close(self):
        if self.p.poll() is None:
            self.send({"cmd": "quit"})
            try:
                self.p.stdin.close()
            except OSError:
                pass
            try:
                self.p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()


def run_speed_paired(model_dir, out: Path, pairs: int, until: float, out_tokens: int = 64) -> dict:
    """Plain vLLM ("off") and the plugin ("on", strict, no capture) in two engines, each in its own process, as
    run_speed builds them (GPU memory share 0.3 each: both on one GPU), pinned to the same vCPUs (the coordinator's,
    or FUSED_LOGP_VLLM_BENCH_SPEED_PAIRED_CPUS="0,1,..."), both started and warmed up before any timed run. Per batch
    size, `pairs` pairs of timed generates, one engine at a time, the order alternating per pair (off-on, on-off,
    ...): the two engines run in the same minutes, so a drift of the host's speed falls on both. Each run is one
    serve_speed "run" (gc.collect(), run_speed's prompts and params) reporting its wall time, gc pause and the
    pure-Python probe (_HostCounters.py_probe) before it. The "on" engine starts once the "off" engine is built
    (FUSED_LOGP_VLLM_BENCH_SPEED_PAIRED_STAGGER=0: both at once)."""
    t0 = time.time()
    env_cpus = os.environ.get("FUSED_LOGP_VLLM_BENCH_SPEED_PAIRED_CPUS", "")
    if env_cpus:
        cpus = sorted(int(c) for c in env_cpus.split(",") if c)
    else:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    share = 0.3
    res = {"what": "plain vLLM and the plugin in two engines (two processes) taking turns (run_speed_paired)",
           "pairs": pairs, "out_tokens": out_tokens, "cpus": cpus, "gpu_memory_share": share, "engines": {},
           "batches": {}}
    per_run = 900 if DRY else 120                   # one timed generate (the CPU's engines are slower)
    peers = {}
    try:
        # vLLM measures the GPU's free memory while an engine starts: by default the plugin's engine starts once
        # plain vLLM's is built, so that neither start-up sees the other's allocations move (0: both at once)
        stagger = os.environ.get("FUSED_LOGP_VLLM_BENCH_SPEED_PAIRED_STAGGER", "1") != "0"
        for kind in ("off", "on"):
            peers[kind] = _Peer(kind, model_dir, cpus, out / f"speed-paired-{kind}.log", share)
            print(f"speed-paired: started the {kind} engine's process {peers[kind].p.pid}", flush=True)
            if stagger:
                res["engines"][kind] = peers[kind].recv(until)
        for kind in peers:
            if kind not in res["engines"]:
                res["engines"][kind] = peers[kind].recv(until)
        for kind in peers:
            res["engines"][kind].update(peers[kind].recv(until))
            res["engines"][kind]["ready_after_s"] = round(time.time() - t0, 1)
        print(f"speed-paired: both engines ready after {round(time.time() - t0, 1)} s", flush=True)

        def status():
            out_ = {}
            for k, peer in peers.items():
                peer.send({"cmd": "status"})
                out_[k] = peer.recv(min(until, time.time() + per_run))
            return out_

        before = status()
        res["op_calls_after_warm_up"] = {k: before[k]["op_calls"] for k in before}
        for bs in (1, 64, 256):
            runs, order = {"off": [], "on": []}, []
            for i in range(pairs):
                seq = ("off", "on") if i % 2 == 0 else ("on", "off")
                order.append("-".join(seq))
                for k in seq:
                    other = peers["on" if k == "off" else "off"].p.pid
                    idle0 = _proc_ticks(other)
                    peers[k].send({"cmd": "run", "bs": bs})
                    runs[k].append(peers[k].recv(min(until, time.time() + per_run)))
                    idle1 = _proc_ticks(other)
                    runs[k][-1]["other_engine_ticks"] = None if idle0 is None or idle1 is None else idle1 - idle0
            after = status()
            toks = bs * out_tokens
            times = {k: [r["wall_s"] for r in runs[k]] for k in runs}
            pauses = {k: [r["gc_pause_s"] for r in runs[k]] for k in runs}
            probes = {k: [r["py_probe_ms"] for r in runs[k]] for k in runs}
            per_pair = [off / on for off, on in zip(times["off"], times["on"])]
            normalised = [(off / po) / (on / pn) for off, on, po, pn in
                          zip(times["off"], times["on"], probes["off"], probes["on"]) if po > 0 and pn > 0]
            res["batches"][str(bs)] = {
                **_on_off(times, pauses, toks),
                "ratio_per_pair": [round(x, 4) for x in per_pair],
                "ratio_per_pair_median": round(statistics.median(per_pair), 4),
                # each run's time divided by its engine's probe just before it, then the pair's ratio (median)
                "ratio_per_pair_probe_normalised_median": round(statistics.median(normalised), 4) if normalised
                else None,
                "py_probe_ms_off": _median_or_none(probes["off"]), "py_probe_ms_on": _median_or_none(probes["on"]),
                "order": order,
                "times_s": {k: [round(x, 4) for x in times[k]] for k in times},
                "gc_pause_s": {k: [round(x, 4) for x in pauses[k]] for k in pauses},
                "py_probe_ms": {k: [round(x, 3) for x in probes[k]] for k in probes},
                # CPU ticks (1/100 s) the other, waiting engine's process used during each of this side's runs
                "other_engine_ticks": {k: [r["other_engine_ticks"] for r in runs[k]] for k in runs},
                "op_calls": {k: after[k]["op_calls"] - before[k]["op_calls"] for k in after}}
            before = after
            head = {k: v for k, v in res["batches"][str(bs)].items() if k.startswith(("tok_s", "ratio"))}
            print(f"speed-paired: batch {bs}: {json.dumps(head)}", flush=True)
        res["non_contract"] = {k: before[k]["non_contract"] for k in before}
        for k, peer in peers.items():
            peer.send({"cmd": "host"})
            res["engines"][k]["host"] = peer.recv(min(until, time.time() + per_run))
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        for peer in peers.values():
            peer.close()
        res["rc"] = {k: peer.p.returncode for k, peer in peers.items()}
    res["total_s"] = round(time.time() - t0, 1)
    (out / "speed-paired.json").write_text(json.dumps(res, indent=1, default=str))
    return res


def run_score() -> dict:
    import torch

    from fused_logp import linear_logp

    g = torch.Generator(device="cuda").manual_seed(5)
    res = {}
    w = (torch.randn(VOCAB, HIDDEN, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
    for n in (1, 64, 256, 2048):
        h = torch.randn(n, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
        tg = torch.randint(0, VOCAB, (n,), generator=g, device="cuda")

        def contract():
            return linear_logp(h, w, tg, backend="sm90").logp

        def plain():
            z = torch.nn.functional.linear(h, w).float()
            return z.log_softmax(-1).gather(1, tg[:, None])[:, 0]

        def head_plugin():            # what the plugin's head runs per decode step (FP32 logits out)
            return linear_logp(h, w, tg, backend="sm90", return_logits=True, vocab_size=VOCAB).logits

        def head_vllm():              # what vLLM's head runs per decode step (bf16 GEMM)
            return torch.nn.functional.linear(h, w)

        out = {}
        for name, fn in (("contract_sm90", contract), ("torch_linear_log_softmax", plain),
                         ("head_plugin_return_logits", head_plugin), ("head_vllm_bf16_gemm", head_vllm)):
            for _ in range(3):
                fn()
            ts = []
            for _ in range(10):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                torch.cuda.synchronize()
                ts.append(s.elapsed_time(e))
            out[name + "_ms"] = round(statistics.median(ts), 4)
        out["ratio"] = round(out["contract_sm90_ms"] / out["torch_linear_log_softmax_ms"], 3)
        out["head_ratio"] = round(out["head_plugin_return_logits_ms"] / out["head_vllm_bf16_gemm_ms"], 3)
        res[str(n)] = out
    return res


def _pool_speed(result, rounds: int) -> dict:
    """Per batch size: tok/s of each engine kind from the median of all its timed runs over the rounds, the ratio
    on / off, the same without the garbage collector's pauses, and the per-round ratios."""
    pooled = {}
    names = {k: [_speed_part(k, r) for r in range(rounds)] for k in ("off", "on")}
    runs = {k: [result.get(n, {}).get("batches") for n in names[k]] for k in names}
    if not all(runs["off"]) or not all(runs["on"]):
        return {"error": "a speed part has no batches: see its log"}
    out_tokens = result[names["on"][0]].get("out_tokens", 64)
    for b in runs["on"][0]:
        toks = int(b) * out_tokens                                                          # tokens per run
        pooled[b] = {**_on_off({k: [t for x in runs[k] for t in x[b]["times_s"]] for k in runs},
                               {k: [g for x in runs[k] for g in x[b]["gc_pause_s"]] for k in runs}, toks),
                     "ratio_per_round": [round(on[b]["tok_s"] / off[b]["tok_s"], 4)
                                         for off, on in zip(runs["off"], runs["on"])],
                     "runs_per_engine_kind": sum(len(x[b]["times_s"]) for x in runs["on"])}
    return pooled


def _pool_kinds(result, rounds: int, kinds) -> dict:
    """Per engine kind and batch size: tok/s from the median of all its timed runs over the rounds, the ratio to
    plain vLLM ("off") where it ran, and the host's counters summed over its engines (main-thread CPU ticks per
    wall tick of the timed runs, steal ticks, involuntary switches, the other threads' ticks)."""
    out = {}
    for k in kinds:
        runs = [result.get(_speed_part(k, r), {}).get("batches") for r in range(rounds)]
        if not all(runs):
            out[k] = {"error": "a part of this kind has no batches: see its log"}
            continue
        out[k] = {}
        for b in runs[0]:
            med = statistics.median(t for x in runs for t in x[b]["times_s"])
            hosts = [x[b].get("host", {}) for x in runs]
            wall = sum(h.get("wall_ticks", 0) for h in hosts)
            out[k][b] = {"tok_s": round(int(b) * result.get(_speed_part(k, 0), {}).get("out_tokens", 64) / med, 1),
                         "median_s": round(med, 4),
                         "main_thread_busy": round(sum(h.get("main_thread_ticks", 0) for h in hosts) / wall, 3)
                         if wall else None,
                         "steal_ticks": sum(h.get("steal_ticks", 0) for h in hosts),
                         "nonvoluntary_switches": sum(h.get("nonvoluntary_switches", 0) for h in hosts),
                         "other_threads_ticks": sum(h.get("other_threads_ticks", 0) for h in hosts),
                         "py_probe_ms": _median_or_none([x for h in hosts for x in h.get("py_probe_ms", [])])}
    if "off" in out and "error" not in out["off"]:
        for k in out:
            if "error" in out[k]:
                continue
            for b in out[k]:
                x, off = out[k][b], out["off"][b]
                x["ratio_to_off"] = round(off["median_s"] / x["median_s"], 4)
                # the same ratio with each kind's run time divided by its host's pure-Python probe time: what is
                # left of the gap once the main thread's speed on the host at that moment is taken out
                if x["py_probe_ms"] and off["py_probe_ms"]:
                    x["ratio_to_off_probe_normalised"] = round(
                        (off["median_s"] / off["py_probe_ms"]) / (x["median_s"] / x["py_probe_ms"]), 4)
    return out


def _on_off(times: dict, pauses: dict, toks: int) -> dict:
    """tok/s of the median run off and on, the ratio plugin / plain (median times off / on), and the same without
    the garbage collector's pauses. times, pauses: {"off": [...], "on": [...]} seconds per run, in pairs."""
    med = {m: statistics.median(times[m]) for m in ("off", "on")}
    net = {m: statistics.median(t - p for t, p in zip(times[m], pauses[m])) for m in ("off", "on")}
    return {"tok_s_off": round(toks / med["off"], 1), "tok_s_on": round(toks / med["on"], 1),
            "ratio": round(med["off"] / med["on"], 4), "ratio_without_gc_pauses": round(net["off"] / net["on"], 4)}


def _median_or_none(xs):
    return round(statistics.median(xs), 3) if xs else None
