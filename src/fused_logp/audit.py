"""`fused-logp audit`: recompute recorded rollout logprobs on a CPU and report every byte that differs.

    fused-logp audit CAPTURE --weight CHECKPOINT [--weight-key KEY] [--vocab-size V] [--backend oracle-fast]
                     [--rows-per-batch 64] [--max-rows N] [--out report.json] [--show 10]
                     [--expect-fingerprint FP]

Given the final hidden rows a rollout fed to its lm_head, the lm_head weight, the token ids and the rows'
temperatures or sampling-transform programs, the contract (CONTRACT.md) fixes every logp bit: the audit
recomputes them with a contract-bearing CPU backend (the compiled oracle by default; `--backend oracle` for the
numpy reference) and compares bytes. A progress bar shows rows/s; the exit status is 0 when every checked value
matches, 1 when any differs, 2 when the inputs cannot be audited.

Capture formats (CAPTURE):

1. A tensor file, `.pt` (torch.save of a dict) or `.safetensors`, with these keys:

   | key            | shape / dtype            | meaning                                                        |
   |----------------|--------------------------|----------------------------------------------------------------|
   | `hidden`       | [N, D] bfloat16          | the rows fed to the lm_head (required)                         |
   | `targets`      | [N] or [N, C] int64      | token ids whose logp was recorded (required)                   |
   | `logp`         | like `targets`, float32  | the recorded logp (required)                                   |
   | `temperature`  | [N] float32              | per-row temperature (default 1)                                |
   | `lse`          | [N] float32              | recorded lse of rows without a program (optional, compared)    |
   | `top_k`        | [N] int64                | program top-k per row; 0 = none (optional)                     |
   | `top_p`        | [N] float32              | program top-p per row; 1 = none (optional)                     |
   | `min_p`        | [N] float32              | program min-p per row; 0 = none (optional)                     |
   | `vocab_size`   | [] int64                 | the real vocabulary (default: --vocab-size, else weight rows)  |

   A row with a non-neutral program (top_k/top_p/min_p) is compared with its logp under the program
   (CONTRACT.md section 13; an id outside the kept set is -inf there).

2. The vLLM plugin's captured rows (settings `capture: true`, read with `fused_logp_captured`): a `.json` list
   or `.jsonl` (one record a line) of {"hidden": [bf16 bit patterns], "ids": [...], "logprobs": [...],
   "temperature": T, "program": {...} or null}. A recorded -inf there carries no logprob (vLLM's padding column,
   or an id outside the program's kept set) and is not compared; every finite value is.

`write_capture(path, ...)` writes format 1.

CHECKPOINT: a `.safetensors` file, a directory or `*.safetensors.index.json` of a sharded checkpoint, or a torch
file. The key is `--weight-key`, else `lm_head.weight`, else `model.embed_tokens.weight` (tied embeddings),
else the file's only 2-D tensor. The weight must be bfloat16 (the contract covers bf16 only; nothing is cast).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

DEFAULT_KEYS = ("lm_head.weight", "model.embed_tokens.weight")


class AuditInputError(ValueError):
    """The capture or the checkpoint cannot be audited (the message names what and why)."""


# ---------------------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------------------

def _safetensors_keys(path: Path) -> list[str]:
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def _safetensors_get(path: Path, key: str) -> torch.Tensor:
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(key)


def _pick_key(keys, key, where, shapes=None) -> str:
    if key is not None:
        if key not in keys:
            raise AuditInputError(f"--weight-key {key!r} is not in {where}; it has {len(keys)} tensors, e.g. "
                                  f"{sorted(keys)[:8]}")
        return key
    for k in DEFAULT_KEYS:
        if k in keys:
            return k
    two_d = [k for k in keys if shapes is not None and len(shapes[k]) == 2]
    if len(two_d) == 1:
        return two_d[0]
    raise AuditInputError(f"{where} has no {' or '.join(DEFAULT_KEYS)}; name the lm_head tensor with --weight-key "
                          f"(tensors: {sorted(keys)[:12]}{' ...' if len(keys) > 12 else ''})")


def load_weight(path, key: str | None = None) -> tuple[torch.Tensor, str]:
    """(lm_head weight [V, D] bf16, 'file:key') from a checkpoint file, sharded checkpoint or torch file."""
    p = Path(path)
    if not p.exists():
        raise AuditInputError(f"--weight {str(path)!r} does not exist")
    if p.is_dir():
        idx = sorted(p.glob("*.safetensors.index.json"))
        files = sorted(p.glob("*.safetensors"))
        if idx:
            p = idx[0]
        elif len(files) == 1:
            p = files[0]
        else:
            raise AuditInputError(f"--weight {str(path)!r}: a directory needs one *.safetensors file or a "
                                  f"*.safetensors.index.json; found {len(files)} files and no index")
    if p.name.endswith(".index.json"):
        wmap = json.loads(p.read_text()).get("weight_map", {})
        k = _pick_key(list(wmap), key, str(p))
        shard = p.parent / wmap[k]
        t = _safetensors_get(shard, k)
        where = f"{shard}:{k}"
    elif p.suffix == ".safetensors":
        from safetensors import safe_open
        with safe_open(str(p), framework="pt") as f:
            keys = list(f.keys())
            shapes = {k: f.get_slice(k).get_shape() for k in keys}
        k = _pick_key(keys, key, str(p), shapes)
        t = _safetensors_get(p, k)
        where = f"{p}:{k}"
    else:
        obj = torch.load(str(p), map_location="cpu", weights_only=True)
        if isinstance(obj, torch.Tensor):
            t, where = obj, str(p)
        elif isinstance(obj, dict):
            tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
            k = _pick_key(list(tensors), key, str(p), {k: tuple(v.shape) for k, v in tensors.items()})
            t, where = tensors[k], f"{p}:{k}"
        else:
            raise AuditInputError(f"--weight {str(p)!r}: a torch file must hold a tensor or a dict of tensors; "
                                  f"got {type(obj).__name__}")
    if t.dim() != 2 or t.dtype != torch.bfloat16:
        raise AuditInputError(f"the lm_head weight {where} must be a 2-D bfloat16 tensor [V, D] (the contract covers "
                              f"bf16 inputs only; nothing is cast); got {t.dtype} {tuple(t.shape)}")
    return t.contiguous(), where


def _tensor_file(path: Path) -> dict:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        return dict(load_file(str(path)))
    obj = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(obj, dict):
        raise AuditInputError(f"capture {str(path)!r}: a torch capture must be a dict of tensors; got {type(obj).__name__}")
    return obj


def _plugin_records(path: Path) -> dict:
    """The vLLM plugin's captured rows -> the tensor capture's keys (padded to the widest row)."""
    text = path.read_text()
    recs = json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines() if x.strip()]
    if not recs:
        raise AuditInputError(f"capture {str(path)!r} holds no rows")
    width = max(len(r["ids"]) for r in recs)
    hid = torch.tensor([r["hidden"] for r in recs], dtype=torch.int16).view(torch.bfloat16)
    ids = torch.zeros(len(recs), width, dtype=torch.int64)
    logp = torch.full((len(recs), width), float("-inf"), dtype=torch.float32)
    for i, r in enumerate(recs):
        ids[i, : len(r["ids"])] = torch.tensor(r["ids"], dtype=torch.int64)
        logp[i, : len(r["ids"])] = torch.tensor([float(x) for x in r["logprobs"]], dtype=torch.float32)
    out = {"hidden": hid, "targets": ids, "logp": logp,
           "temperature": torch.tensor([float(r.get("temperature", 1.0)) for r in recs], dtype=torch.float32),
           "programs": [r.get("program") for r in recs], "plugin": True}
    return out


def load_capture(path) -> dict:
    p = Path(path)
    if not p.exists():
        raise AuditInputError(f"capture {str(path)!r} does not exist")
    cap = _plugin_records(p) if p.suffix in (".json", ".jsonl") else _tensor_file(p)
    for k in ("hidden", "targets", "logp"):
        if k not in cap:
            raise AuditInputError(f"capture {str(p)!r} has no {k!r} (keys: {sorted(cap)}); see `fused-logp audit --help`")
    h, t, lp = cap["hidden"], cap["targets"], cap["logp"]
    if h.dim() != 2 or h.dtype != torch.bfloat16:
        raise AuditInputError(f"capture 'hidden' must be [N, D] bfloat16; got {h.dtype} {tuple(h.shape)}")
    n = h.shape[0]
    if t.shape[0] != n or t.dim() not in (1, 2) or lp.shape != t.shape:
        raise AuditInputError(f"capture 'targets' must be [N] or [N, C] with N={n} and 'logp' the same shape; got "
                              f"{tuple(t.shape)} and {tuple(lp.shape)}")
    cap["targets"] = t.to(torch.int64)
    cap["logp"] = lp.to(torch.float32)
    temp = cap.get("temperature")
    cap["temperature"] = torch.ones(n) if temp is None else temp.to(torch.float32).reshape(n)
    if "programs" not in cap:
        cap["programs"] = _programs_from_tensors(cap, n)
    return cap


def _programs_from_tensors(cap, n) -> list:
    keys = [k for k in ("top_k", "top_p", "min_p") if k in cap]
    if not keys:
        return [None] * n
    out = []
    tk = cap.get("top_k")
    tp = cap.get("top_p")
    mp = cap.get("min_p")
    for r in range(n):
        k = int(tk[r]) if tk is not None else 0
        p = float(tp[r]) if tp is not None else 1.0
        m = float(mp[r]) if mp is not None else 0.0
        if k <= 0 and p >= 1.0 and m <= 0.0:
            out.append(None)
        else:
            out.append({"temperature": float(cap["temperature"][r]), "top_k": k if k > 0 else None,
                        "top_p": p if p < 1.0 else None, "min_p": m if m > 0.0 else None})
    return out


def write_capture(path, *, hidden, targets, logp, temperature=None, lse=None, top_k=None, top_p=None, min_p=None,
                  vocab_size=None) -> None:
    """Write a tensor capture (format 1) as .pt or .safetensors, by the path's suffix."""
    d = {"hidden": hidden.detach().cpu().contiguous(), "targets": targets.detach().cpu().to(torch.int64).contiguous(),
         "logp": logp.detach().cpu().to(torch.float32).contiguous()}
    for k, v in (("temperature", temperature), ("lse", lse), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        if v is not None:
            d[k] = v.detach().cpu().contiguous()
    if vocab_size is not None:
        d["vocab_size"] = torch.tensor(int(vocab_size), dtype=torch.int64)
    if str(path).endswith(".safetensors"):
        from safetensors.torch import save_file
        save_file(d, str(path))
    else:
        torch.save(d, str(path))


# ---------------------------------------------------------------------------------------------------------
# the audit
# ---------------------------------------------------------------------------------------------------------

def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _differs(got: torch.Tensor, rec: torch.Tensor) -> torch.Tensor:
    """Byte difference; NaN matches NaN (the contract does not fix NaN payloads of logp/lse)."""
    both_nan = torch.isnan(got) & torch.isnan(rec)
    return (_bits(got) != _bits(rec)) & ~both_nan


def audit(capture: dict, weight: torch.Tensor, *, vocab_size: int | None = None, backend: str = "oracle-fast",
          rows_per_batch: int = 64, max_rows: int | None = None, show: int = 10, progress: bool = True) -> dict:
    """Recompute the capture's logp (and lse where recorded) and compare bytes. Returns the report dict."""
    from . import linear_logp, logp_from_logits
    from .kernel.transforms import TransformProgram, program_logp_from_logits

    if vocab_size is None:
        vocab_size = int(capture["vocab_size"]) if "vocab_size" in capture else weight.shape[0]
    h, tg, rec = capture["hidden"], capture["targets"], capture["logp"]
    n = h.shape[0] if max_rows is None else min(h.shape[0], int(max_rows))
    if h.shape[1] != weight.shape[1]:
        raise AuditInputError(f"capture hidden size D={h.shape[1]} differs from the weight's {weight.shape[1]}")
    if n and (int(tg[:n].min()) < 0 or int(tg[:n].max()) >= vocab_size):
        raise AuditInputError(f"capture targets must lie in [0, {vocab_size}); got [{int(tg[:n].min())}, "
                              f"{int(tg[:n].max())}]")
    temp, rec_lse, programs = capture["temperature"], capture.get("lse"), capture["programs"]
    plugin = bool(capture.get("plugin", False))
    two_d = tg.dim() == 2
    checked = skipped = mism_logp = mism_lse = 0
    first: list = []
    provenance = None
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=n, unit="row", desc="audit", file=sys.stderr, dynamic_ncols=True)
    t0 = time.perf_counter()
    for r0 in range(0, n, rows_per_batch):
        r1 = min(n, r0 + rows_per_batch)
        hb, tb, rb, pb = h[r0:r1].contiguous(), tg[r0:r1], rec[r0:r1], programs[r0:r1]
        first_col = tb if not two_d else tb[:, 0].contiguous()
        res = linear_logp(hb, weight, first_col, temperature=temp[r0:r1].contiguous(), vocab_size=vocab_size,
                          return_logits=True, backend=backend, strict=True)
        provenance = res.provenance
        if two_d:
            got = logp_from_logits(res.logits, tb.contiguous(), temperature=temp[r0:r1].contiguous(),
                                   vocab_size=vocab_size, backend=backend, strict=True).logp
        else:
            got = res.logp.clone()
        got_lse = res.lse.clone()
        compare = torch.ones_like(rb, dtype=torch.bool)
        prog_rows = [i for i, p in enumerate(pb) if p is not None]
        groups: dict = {}
        for i in prog_rows:
            prog = TransformProgram.from_dict(pb[i])
            if not prog.is_neutral(vocab_size):
                groups.setdefault(prog, []).append(i)
        for prog, rows in groups.items():
            idx = torch.tensor(rows, dtype=torch.int64)
            ids = tb.index_select(0, idx)
            lp, _, kept = program_logp_from_logits(res.logits.index_select(0, idx), ids, prog,
                                                   vocab_size=vocab_size, require_kept=False)
            got[idx] = torch.where(kept, lp, torch.full_like(lp, float("-inf")))
        program_row = torch.zeros(r1 - r0, dtype=torch.bool)
        for rows in groups.values():
            program_row[rows] = True
        if plugin:        # -inf in the plugin's rows carries no logprob: vLLM's padding column or an id outside the
            compare &= ~torch.isneginf(rb)                  # kept set; both are left out (counted as skipped)
        diff = _differs(got, rb) & compare
        checked += int(compare.sum())
        skipped += int((~compare).sum())
        mism_logp += int(diff.sum())
        if rec_lse is not None:
            dl = _differs(got_lse, rec_lse[r0:r1]) & ~program_row
            mism_lse += int(dl.sum())
        else:
            dl = torch.zeros(r1 - r0, dtype=torch.bool)
        bad_rows = (diff.any(dim=1) if two_d else diff) | dl
        for i in torch.nonzero(bad_rows).flatten().tolist():
            if len(first) >= show:
                break
            cols = torch.nonzero(diff[i]).flatten().tolist() if two_d else ([0] if bool(diff[i]) else [])
            entry = {"row": r0 + i, "lse_differs": bool(dl[i])}
            if cols:
                c = cols[0]
                g = float(got[i, c] if two_d else got[i])
                rcd = float(rb[i, c] if two_d else rb[i])
                entry.update({"column": c, "target": int(tb[i, c] if two_d else tb[i]), "recorded": rcd,
                              "recomputed": g, "abs_diff": abs(g - rcd) if math.isfinite(g - rcd) else None})
            first.append(entry)
        if bar is not None:
            el = time.perf_counter() - t0
            bar.update(r1 - r0)
            bar.set_postfix(rows_per_s=f"{r1 / el:.1f}", mismatches=mism_logp + mism_lse)
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t0
    return {
        "rows": n, "values_checked": checked, "values_skipped": skipped,
        "logp_mismatches": mism_logp, "lse_mismatches": mism_lse, "lse_recorded": rec_lse is not None,
        "program_rows": sum(1 for p in programs[:n] if p is not None),
        "seconds": seconds, "rows_per_s": (n / seconds) if seconds > 0 else None,
        "vocab_size": vocab_size, "hidden_size": int(h.shape[1]), "backend": backend,
        "provenance": provenance.to_dict() if provenance is not None else None,
        "first_mismatches": first, "ok": mism_logp == 0 and mism_lse == 0,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fused-logp audit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("capture", help="a tensor capture (.pt/.safetensors) or the vLLM plugin's rows (.json/.jsonl)")
    p.add_argument("--weight", required=True, help="lm_head checkpoint: .safetensors, sharded dir/index.json, or torch file")
    p.add_argument("--weight-key", default=None, help=f"tensor name (default: {' / '.join(DEFAULT_KEYS)} / the only 2-D one)")
    p.add_argument("--vocab-size", type=int, default=None, help="real vocabulary (default: the capture's, else weight rows)")
    p.add_argument("--backend", default="oracle-fast", choices=("oracle-fast", "oracle"),
                   help="contract-bearing CPU backend (default oracle-fast; oracle = the numpy reference)")
    p.add_argument("--rows-per-batch", type=int, default=64)
    p.add_argument("--max-rows", type=int, default=None)
    p.add_argument("--show", type=int, default=10, help="mismatching rows listed in the report")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    p.add_argument("--expect-fingerprint", default=None,
                   help="the rollout's lm_head fingerprint (the plugin's status reports it): refuse a different weight")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.rows_per_batch < 1:
        p.error(f"--rows-per-batch must be >= 1; got {args.rows_per_batch}")
    try:
        cap = load_capture(args.capture)
        weight, where = load_weight(args.weight, args.weight_key)
        from . import weight_fingerprint
        vocab = args.vocab_size or (int(cap["vocab_size"]) if "vocab_size" in cap else weight.shape[0])
        fp = weight_fingerprint(weight[:vocab], vocab_size=vocab)
        if args.expect_fingerprint is not None and args.expect_fingerprint != fp:
            raise AuditInputError(f"the weight {where} has fingerprint {fp}, not the expected {args.expect_fingerprint}: "
                                  f"it is not the lm_head the rollout used")
        rep = audit(cap, weight, vocab_size=args.vocab_size, backend=args.backend, rows_per_batch=args.rows_per_batch,
                    max_rows=args.max_rows, show=args.show, progress=not args.no_progress)
    except (AuditInputError, ValueError) as exc:
        print(f"fused-logp audit: {exc}", file=sys.stderr)
        return 2
    rep["capture"], rep["weight"], rep["weight_fingerprint"] = str(args.capture), where, fp
    print(f"audit: {rep['rows']} rows ({rep['program_rows']} with a sampling program), D={rep['hidden_size']}, "
          f"V={rep['vocab_size']}, backend {rep['backend']}")
    print(f"  lm_head {where}, fingerprint {fp}")
    print(f"  logp values checked: {rep['values_checked']}, mismatching: {rep['logp_mismatches']}"
          + (f" (skipped {rep['values_skipped']} recorded -inf)" if rep['values_skipped'] else ""))
    if rep["lse_recorded"]:
        print(f"  lse mismatching: {rep['lse_mismatches']}")
    for m in rep["first_mismatches"]:
        print(f"  row {m['row']}: " + (f"target {m['target']} recorded {m['recorded']!r} recomputed {m['recomputed']!r}"
                                       if "target" in m else "") + (" (lse differs)" if m["lse_differs"] else ""))
    print(f"  {rep['rows_per_s']:.2f} rows/s ({rep['seconds']:.2f} s)" if rep["rows_per_s"] else "  no rows")
    print("  result: " + ("every checked byte equal" if rep["ok"] else "MISMATCH"))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        Path(args.out).write_text(json.dumps(rep, indent=2, default=str) + "\n")
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
