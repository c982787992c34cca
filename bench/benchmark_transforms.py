"""Trainer-side cost of replaying a sampling-transform program (CONTRACT.md section 13) against the plain op, at
the Qwen3-8B lm_head shape (D=4096, V=151936), plus the lm_head weight fingerprint's time. The kept set and the
program logp run on the logits' device (kernel/transforms.py, the torch path: on an SM90 GPU with the SM90 merge
and top-p kernels) at N in {64, 512, 2048}; the numpy path (the reference, on the host) is timed at 64 rows
only, for contrast, and its bytes are compared with the device path's there. Prints one table and writes JSON to
--out (default $OUT). About 30-60 s on an H200."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch

from fused_logp import linear_logp, weight_fingerprint
from fused_logp.kernel import op as op_mod
from fused_logp.kernel import transforms
from fused_logp.kernel.op import linear_logp_program
from fused_logp.kernel.transforms import TransformProgram, kept_mask, program_logp_from_logits

D, V = 4096, 151936
PROGRAMS = {"top_p=0.9": TransformProgram(1.0, top_p=0.9), "top_k=50,top_p=0.9": TransformProgram(1.0, top_k=50, top_p=0.9),
            "min_p=0.1": TransformProgram(1.0, min_p=0.1)}
NUMPY_ROWS = 64


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn, reps=3, warm=True):
    if warm:
        fn()
    out = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2] * 1e3


def _peak_mib(fn):
    """Peak device memory (MiB) fn allocates above what is allocated before it."""
    if not torch.cuda.is_available():
        return None
    _sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    _sync()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _same_bytes(a, b):
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    na, nb = torch.isnan(a), torch.isnan(b)
    return bool(torch.equal(na, nb) and torch.equal(torch.where(na, 0, a.view(torch.int32)),
                                                    torch.where(nb, 0, b.view(torch.int32))))


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, nargs="*", default=None, help="N values (default 64 512 2048 on CUDA, 8 on CPU)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows_list = args.rows or ([64, 512, 2048] if dev == "cuda" else [8])
    device_path = transforms.describe_path(None, dev)
    numpy_path = transforms.describe_path("numpy", dev)
    w = (torch.randn(V, D, device=dev) * D ** -0.5).bfloat16()
    rows = []
    for n in rows_list:
        h = (torch.randn(n, D, device=dev) * 2).bfloat16()
        zeros = torch.zeros(n, dtype=torch.long, device=dev)
        z = linear_logp(h, w, zeros, return_logits=True).logits
        r = {"N": n, "plain_ms": _time(lambda: linear_logp(h, w, zeros)),
             "with_logits_ms": _time(lambda: linear_logp(h, w, zeros, return_logits=True))}
        for name, prog in PROGRAMS.items():
            t = kept_mask(z, prog).to(torch.uint8).argmax(dim=1)          # a kept id per row
            r[f"{name}_ms"] = _time(lambda: linear_logp_program(h, w, t, prog))                # GEMM chunks + program
            r[f"{name}_transform_ms"] = _time(lambda: program_logp_from_logits(z, t, prog))    # program on given logits
            r[f"{name}_transform_peak_mib"] = _peak_mib(lambda: program_logp_from_logits(z, t, prog))
            if n == NUMPY_ROWS and dev == "cuda":
                box = []
                r[f"{name}_numpy_transform_ms"] = _time(
                    lambda: box.append(program_logp_from_logits(z, t, prog, path="numpy")), reps=1, warm=False)
                got = program_logp_from_logits(z, t, prog)
                r[f"{name}_numpy_bytes_equal"] = all(_same_bytes(a, b) for a, b in zip(got, box[0]))
                r[f"{name}_kept_mask_equal"] = _same_bytes(kept_mask(z, prog), kept_mask(z, prog, path="numpy"))
        rows.append(r)
        del z, h
    fp_ms = _time(lambda: weight_fingerprint(w))
    print(f"device {dev}; transform path: {device_path}; lm_head fingerprint of [{V}, {D}] bf16: {fp_ms:.2f} ms")
    print("ms: end to end (linear_logp_program) / transform only (program_logp_from_logits on given logits)")
    names = list(PROGRAMS)
    print(f"{'N':>6} {'plain':>8} {'+logits':>8} " + " ".join(f"{n:>26}" for n in names))
    for r in rows:
        cells = " ".join(f"{r[f'{n}_ms']:12.2f} / {r[f'{n}_transform_ms']:10.2f}" for n in names)
        print(f"{r['N']:6d} {r['plain_ms']:8.2f} {r['with_logits_ms']:8.2f} {cells}")
    for r in rows:
        if f"{names[0]}_numpy_transform_ms" in r:
            print(f"numpy path at N={r['N']} (transform only, ms): " + ", ".join(
                f"{n}: {r[f'{n}_numpy_transform_ms']:.0f} (bytes equal: {r[f'{n}_numpy_bytes_equal']}, "
                f"kept masks equal: {r[f'{n}_kept_mask_equal']})" for n in names))
    out = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "fingerprint_ms": fp_ms, "rows": rows,
           "transform_path": device_path, "numpy_path": numpy_path,
           "device_rows_per_chunk": transforms.DEVICE_ROWS_PER_CHUNK,
           "program_gemm_rows_per_chunk": op_mod.PROGRAM_ROWS_PER_CHUNK_CUDA if dev == "cuda" else 64,
           "note": (f"'<program>_ms': linear_logp_program end to end; '_transform_ms': program_logp_from_logits on "
                    f"the given logits, on the '{device_path}' path; '_numpy_transform_ms': the numpy reference "
                    f"path at N={NUMPY_ROWS} ({numpy_path}); '_transform_peak_mib': peak device memory of the "
                    f"transform above its inputs")}
    with open(os.path.join(args.out, "transforms.json"), "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
