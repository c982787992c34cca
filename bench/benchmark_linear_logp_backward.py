"""Forward + backward of linear_logp (grads for hidden and weight) at D=4096, V=151936 against cuBLAS +
log_softmax, Liger-Kernel's fused linear cross-entropy and Apple's Cut Cross-Entropy (both reduction="sum"), measured
in the same run. A peer that is not installed (`make peer-wheels`, then `make bench-gpu`) or that fails is recorded
in the JSON as a string, not measured. --dz-launches: the backward's dz configurations (kernel/sm90.py DZ_LAUNCHES)
against each other in interleaved rounds, forward + backward and the dz pass, beside the GEMM. Prints one table and
writes JSON (GPU, date, versions) to --out."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

from fused_logp import linear_logp
from fused_logp.kernel import autograd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/peers.py (scripts run with -P)
import peers as peer_lib  # noqa: E402
from interleave import events_ms, interleaved_rounds  # noqa: E402

D, V = 4096, 151936


def _bench(fn, reps=10, warm=3, calls=1):
    """Median over `reps` samples of (time of `calls` calls) / calls. calls=1: one synchronised call per sample,
    which counts the host work before its first kernel. calls > 1 (_bench_pipelined): the host enqueues the next
    call while the GPU runs the previous one, as in a training loop, so launch and Python overhead is hidden where
    the GPU is the bottleneck."""
    _spin()
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = sorted(events_ms(fn, calls) for _ in range(reps))
    return times[len(times) // 2]


def _bench_pipelined(fn):
    return _bench(fn, reps=7, warm=2, calls=4)


def _spin(seconds=0.5):
    """Keep the GPU busy for a moment first, so that every measurement starts at the same clocks."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def _peak(fn, base):
    """Peak bytes above `base` during fn, in MiB (fn starts by dropping the previous gradients)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def _rel_l2(a, b, rows=8192):
    """||a - b|| / ||b|| in FP64 sums over row blocks (no full-size FP32 copies of the weight gradient)."""
    num = den = 0.0
    for i in range(0, a.shape[0], rows):
        x, y = a[i:i + rows].float(), b[i:i + rows].float()
        num += float((x - y).double().pow(2).sum())
        den += float(y.double().pow(2).sum())
    return (num / den) ** 0.5 if den else float("nan")


def _same_bytes(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _peer_checks(loss_fn, h, w, t, ref):
    """Once: loss and gradients against ours (the gradient of -sum(logp)), and whether a second forward+backward
    gives the same bytes."""
    out = {}
    runs = []
    for _ in range(2):
        h.grad = w.grad = None
        loss = loss_fn(h, w, t)
        loss.backward()
        torch.cuda.synchronize()
        runs.append((loss.detach().clone(), h.grad, w.grad))
    h.grad = w.grad = None
    (l1, gh1, gw1), (l2, gh2, gw2) = runs
    out["loss"] = float(l1)
    out["loss_rel_diff"] = abs(float(l1.double()) - ref["loss"]) / abs(ref["loss"])
    out["hgrad_rel_l2"] = _rel_l2(gh1, ref["h_grad"])
    out["wgrad_rel_l2"] = _rel_l2(gw1, ref["w_grad"]) if gw1 is not None else "no weight gradient"
    out["loss_repeat_identical"] = _same_bytes(l1, l2)
    out["hgrad_repeat_identical"] = _same_bytes(gh1, gh2)
    out["wgrad_repeat_identical"] = _same_bytes(gw1, gw2) if gw1 is not None and gw2 is not None else None
    out["grad_dtypes"] = [str(gh1.dtype), str(gw1.dtype) if gw1 is not None else None]
    return out


def _measure_peer(name, loss_fn, h, w, t, grads, ref):
    """<name>_ms and <name>_extra_MiB as for ours (same _bench and _peak, same floor; the base is taken here, after a
    first call and with the gradients dropped, as main takes ours, so that the reference gradients held in `ref` are
    not counted), then the checks; any failure is recorded as a string and the row goes on."""
    r = {f"{name}_ms": None, f"{name}_extra_MiB": None, f"{name}_error": None}

    def peer():
        h.grad = w.grad = None
        loss_fn(h, w, t).backward()

    try:
        peer()  # first call: compiles the Triton kernels (and CCE's torch.compile) outside the timing
        h.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        r[f"{name}_ms"] = _bench(peer)
        r[f"{name}_pipelined_ms"] = _bench_pipelined(peer)
        r[f"{name}_extra_MiB"] = _peak(peer, base) - grads
    except Exception as e:  # noqa: BLE001
        r[f"{name}_error"] = peer_lib.err(e)
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if r[f"{name}_error"] is None:
        try:
            for k, v in _peer_checks(loss_fn, h, w, t, ref).items():
                r[f"{name}_{k}"] = v
        except Exception as e:  # noqa: BLE001
            r[f"{name}_check_error"] = peer_lib.err(e)
        h.grad = w.grad = None
        torch.cuda.empty_cache()
    return r


def _ms(x, width):
    return f"{x:{width}.2f}" if isinstance(x, (int, float)) else f"{'-':>{width}}"


def _dz_pass(be, h, w, t, lse, dz):
    """The recompute GEMM with the dz epilogue over the whole vocabulary, chunk by chunk (backward_dz with the
    backend's dz_launch; T = 1, coef = g_logp = 1) into dz [N, >= CUDA_CHUNK]: the callable."""
    one = torch.ones(h.shape[0], device=h.device)
    c = autograd.CUDA_CHUNK

    def dz_pass():
        for c0 in range(0, V, c):
            cc = min(c, V - c0)
            be.backward_dz(h, w[c0:c0 + cc], None, one, lse, one, one, t, c0, cc, dz[:, :cc])
    return dz_pass


def _parts(h, w, t):
    """The backward's passes over the whole vocabulary, each timed alone: the recompute GEMM with the dz
    epilogue (all chunks), the dh GEMMs (all chunks and slices) and the dW GEMMs, next to one cuBLAS GEMM with
    FP32 output (the recompute's former first step)."""
    from fused_logp.kernel.backends import device_backend
    ext = device_backend(h.device)
    if ext is None:
        return {"parts": "sm90 backend unavailable"}
    n = h.shape[0]
    c, sl = autograd.CUDA_CHUNK, autograd._CUDA_SLICE
    n_pad = -(-n // sl) * sl
    lse = linear_logp(h, w, t).lse
    dz = torch.zeros(n_pad, c, dtype=torch.bfloat16, device="cuda")
    dh = torch.zeros(n_pad, D, device="cuda")
    dw = torch.empty_like(w)
    z = torch.empty(n, c, device="cuda")

    dz_pass = _dz_pass(ext, h, w, t, lse, dz[:n])

    def dh_pass():
        for c0 in range(0, V, c):
            cc = min(c, V - c0)
            for s0 in range(0, n_pad, sl):
                torch.addmm(dh[s0:s0 + sl], dz[s0:s0 + sl, :cc], w[c0:c0 + cc], out_dtype=torch.float32,
                            out=dh[s0:s0 + sl])

    def dw_pass():
        for c0 in range(0, V, c):
            cc = min(c, V - c0)
            torch.mm(dz[:n, :cc].T, h, out=dw[c0:c0 + cc])

    def z_fp32_pass():
        for c0 in range(0, V, c):
            cc = min(c, V - c0)
            torch.mm(h, w[c0:c0 + cc].T, out_dtype=torch.float32, out=z[:, :cc])

    return {"dz_pass_ms": _bench(dz_pass), "dh_pass_ms": _bench(dh_pass), "dw_pass_ms": _bench(dw_pass),
            "cublas_z_fp32_pass_ms": _bench(z_fp32_pass)}


def _dz_ab(h, w, t, names, rounds=7):
    """Interleaved rounds (bench/interleave.py) of the dz configurations `names` (SM90Backend.dz_launch): forward +
    backward and the dz pass over the whole vocabulary (as in _parts) with each, next to cuBLAS's bf16 GEMM of the
    forward's shape in the same rounds. -> medians in ms and their ratios to the GEMM."""
    from fused_logp.kernel.backends import device_backend
    be = device_backend(h.device)
    if be is None:
        return {"dz_ab": "sm90 backend unavailable"}
    c = autograd.CUDA_CHUNK
    lse = linear_logp(h.detach(), w.detach(), t).lse
    dz = torch.zeros(h.shape[0], -(-c // 8) * 8, dtype=torch.bfloat16, device="cuda")

    def fb():
        h.grad = w.grad = None
        linear_logp(h, w, t).logp.sum().backward()

    dz_pass = _dz_pass(be, h.detach(), w.detach(), t, lse, dz)

    fns = {"gemm": lambda: torch.mm(h.detach(), w.detach().T)}
    for name in names:
        fns[f"fb:{name}"] = fb
        fns[f"dz:{name}"] = dz_pass

    def before(key):
        be.dz_launch = key.split(":", 1)[1] if ":" in key else "auto"

    try:
        times = interleaved_rounds(fns, rounds, iters=3, before=before)
    finally:
        be.dz_launch = "auto"
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return {"dz_ab": {"rounds": rounds, "median_ms": med, "over_gemm": {k: med[k] / med["gemm"] for k in med},
                      "all_ms": times}}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "backward.json"))
    p.add_argument("--n", type=int, nargs="*", default=[2048, 8192])
    p.add_argument("--chunk-bytes", type=int, default=None,
                   help="override the CUDA backward's chunk-buffer budget (bytes) to compare chunk sizes")
    p.add_argument("--chunk", type=int, default=None, help="override the CUDA backward's chunk width (columns)")
    p.add_argument("--slice", type=int, default=None, help="override the CUDA backward's dh slice height (rows)")
    p.add_argument("--dz-launches", default=None,
                   help="comma-separated dz configurations (kernel/sm90.py DZ_LAUNCHES) to time against each other in "
                        "interleaved rounds: forward + backward and the dz pass, with the GEMM in the same rounds")
    p.add_argument("--smoke", action="store_true",
                   help="one small backward (bias, temperature, odd vocabulary, a padded slice) with each of "
                        "--dz-launches (default: auto) and exit, for compute-sanitizer")
    args = p.parse_args()
    if args.smoke:
        g = torch.Generator(device="cuda").manual_seed(0)
        n, v, real, d = 300, 5120, 5001, 512
        h = torch.randn(n, d, device="cuda", generator=g).bfloat16()
        w = (torch.randn(v, d, device="cuda", generator=g) * d ** -0.5).bfloat16()
        b = torch.randn(v, device="cuda", generator=g)
        t = torch.randint(0, real, (n,), device="cuda", generator=g)
        temp = 0.5 + torch.rand(n, device="cuda", generator=g)
        lse = linear_logp(h, w[:real], t, bias=b[:real], temperature=temp).lse
        gl = torch.randn(n, device="cuda", generator=g)
        from fused_logp.kernel.backends import device_backend
        be = device_backend(h.device)
        for name in (args.dz_launches or "auto").split(","):
            if be is not None:
                be.dz_launch = name
            dh, dw, db = autograd.logp_grads(h, w, b, t, temp, lse, gl, gl, vocab_start=0, n_real=real, chunk=1000)
            torch.cuda.synchronize()
            print(f"smoke ({name}):", float(dh.float().norm()), float(dw.float().norm()), float(db.norm()))
        return
    if args.chunk_bytes:
        autograd._CUDA_CHUNK_BYTES = args.chunk_bytes
    if args.chunk:
        autograd.CUDA_CHUNK = args.chunk
    if args.slice:
        autograd._CUDA_SLICE = args.slice
    peers = peer_lib.load("sum")
    rows = []
    for n in args.n:
        h = torch.randn(n, D, device="cuda").bfloat16().requires_grad_()
        w = (torch.randn(V, D, device="cuda") * D ** -0.5).bfloat16().requires_grad_()
        t = torch.randint(0, V, (n,), device="cuda")

        def ours():
            h.grad = w.grad = None
            linear_logp(h, w, t).logp.sum().backward()

        def cublas_ls():
            h.grad = w.grad = None
            z = torch.mm(h, w.T).float()
            torch.log_softmax(z, -1).gather(1, t[:, None]).sum().backward()

        def gemm():
            torch.mm(h.detach(), w.detach().T)

        def ours_fwd():
            linear_logp(h.detach(), w.detach(), t)

        ours()
        cublas_ls()
        h.grad = w.grad = None
        base = torch.cuda.memory_allocated()
        # inputs plus the gradients of hidden and weight (allocated during the call) are the floor
        grads = (h.numel() + w.numel()) * 2 / 2 ** 20
        r = {"N": n, "gemm_fwd_ms": _bench(gemm), "ours_ms": _bench(ours), "cublas_log_softmax_ms": _bench(cublas_ls),
             "ours_extra_MiB": _peak(ours, base) - grads, "cublas_log_softmax_extra_MiB": _peak(cublas_ls, base) - grads,
             "ours_backend": linear_logp(h.detach(), w.detach(), t).provenance.backend}
        r["ours_over_gemm"] = r["ours_ms"] / r["gemm_fwd_ms"]
        r["gemm_fwd_pipelined_ms"] = _bench_pipelined(gemm)
        r["ours_pipelined_ms"] = _bench_pipelined(ours)
        r["cublas_log_softmax_pipelined_ms"] = _bench_pipelined(cublas_ls)
        r["ours_pipelined_over_gemm"] = r["ours_pipelined_ms"] / r["gemm_fwd_pipelined_ms"]
        r["ours_fwd_only_ms"] = _bench(ours_fwd)
        r["four_gemm_floor_ms"] = 4 * r["gemm_fwd_ms"]
        r["target_ms"] = 4.4 * r["gemm_fwd_ms"]
        r["chunk"] = autograd.CUDA_CHUNK
        r.update(_parts(h.detach(), w.detach(), t))
        if args.dz_launches:
            r.update(_dz_ab(h, w, t, args.dz_launches.split(",")))
        ref = None
        if any(fn is not None for fn, _ in peers.values()):
            # ours as the reference for the peers' checks: loss = -sum(logp), so its gradients are the ones a
            # cross-entropy with reduction="sum" should give
            h.grad = w.grad = None
            ref_loss = -linear_logp(h, w, t).logp.double().sum()
            ref_loss.backward()
            ref = {"loss": float(ref_loss.detach()), "h_grad": h.grad, "w_grad": w.grad}
            h.grad = w.grad = None
        for name, (fn, info) in peers.items():
            if fn is None:
                r.update({f"{name}_ms": None, f"{name}_extra_MiB": None, f"{name}_error": info["status"]})
            else:
                r.update(_measure_peer(name, fn, h, w, t, grads, ref))
        ref = None
        rows.append(r)
        del h, w, t
        torch.cuda.empty_cache()
    print(f"{'N':>6} {'chunk':>6} {'ours fwd':>9} {'GEMM fwd':>9} {'ours f+b':>9} {'x GEMM':>7} {'cuBLAS+LS f+b':>14} {'ours/cuBLAS+LS':>15} {'ours extra MiB':>15} {'cuBLAS+LS extra MiB':>20} {'Liger f+b':>10} {'CCE f+b':>9}")
    for r in rows:
        print(f"{r['N']:6d} {r['chunk']:6d} {r['ours_fwd_only_ms']:9.2f} {r['gemm_fwd_ms']:9.2f} {r['ours_ms']:9.2f} {r['ours_over_gemm']:7.2f} {r['cublas_log_softmax_ms']:14.2f} "
              f"{r['ours_ms'] / r['cublas_log_softmax_ms']:15.2f} {r['ours_extra_MiB']:15.0f} {r['cublas_log_softmax_extra_MiB']:20.0f} "
              f"{_ms(r['liger_ms'], 10)} {_ms(r['cce_ms'], 9)}")
        print("       back-to-back (ms):", {k: (round(r[k], 2) if isinstance(r.get(k), float) else None) for k in (
            "gemm_fwd_pipelined_ms", "ours_pipelined_ms", "ours_pipelined_over_gemm", "cublas_log_softmax_pipelined_ms",
            "liger_pipelined_ms", "cce_pipelined_ms")})
        print("       backward passes (ms):", {k: round(r[k], 2) for k in ("dz_pass_ms", "dh_pass_ms", "dw_pass_ms",
                                                                       "cublas_z_fp32_pass_ms") if k in r})
        if isinstance(r.get("dz_ab"), dict):
            print("       dz configurations, interleaved (median ms, / GEMM):",
                  {k: (round(v, 2), round(r["dz_ab"]["over_gemm"][k], 3)) for k, v in r["dz_ab"]["median_ms"].items()})
    for name in peers:
        for r in rows:
            if r[f"{name}_error"] is not None:
                print(f"{name} N={r['N']}: {r[f'{name}_error']}")
            else:
                checks = {k[len(name) + 1:]: r[k] for k in r if k.startswith(name + "_") and k not in
                          (f"{name}_ms", f"{name}_error")}
                print(f"{name} N={r['N']}: {checks}")
    peers = {name: info for name, (_, info) in peers.items()}
    print("peers:", peers)
    out = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "chunk_bytes": autograd._CUDA_CHUNK_BYTES, "chunk": autograd.CUDA_CHUNK, "slice": autograd._CUDA_SLICE, "D": D, "V": V, "rows": rows, "peers": peers}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
