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
   | `contract_version` | str (`.pt`; metadata in `.safetensors`) | the contract the rollout ran under          |

   A row with a non-neutral program (top_k/top_p/min_p) is compared with its logp under the program
   (CONTRACT.md section 13; an id outside the kept set is -inf there).

2. The vLLM plugin's captured rows (settings `capture: true`, read with `fused_logp_captured`): a `.json` list
   or `.jsonl` (one record a line) of {"hidden": [bf16 bit patterns], "ids": [...], "logprobs": [...],
   "temperature": T, "program": {...} or null} (a bit pattern may be signed, -32768..32767, or unsigned,
   0..65535). A recorded -inf there carries no logprob (vLLM's padding column, or an id outside the program's
   kept set) and is not compared; every finite value is. A record may also carry "vocab_size" and
   "contract_version" (equal in every record that has them), and a record {"kind": "header", ...} carries only
   those two.

A capture stamped with another contract version than this installation's is refused (exit 2) with both versions
named: its bytes are another contract's. `--vocab-size` overrides the capture's vocab_size; without either, the
weight's row count is the vocabulary, which is wrong for a padded checkpoint (a warning says so).

`write_capture(path, ...)` writes format 1, stamped with this installation's contract version.

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
    try:
        return _load_weight(path, key)
    except AuditInputError:
        raise
    except Exception as exc:
        raise AuditInputError(f"--weight {str(path)!r} cannot be read ({_first_line(exc)}); expected a .safetensors "
                              f"file, a sharded checkpoint (folder or *.safetensors.index.json) or a torch file of "
                              f"a tensor or a dict of tensors") from None


def _load_weight(path, key):
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
        try:
            wmap = json.loads(p.read_text()).get("weight_map", {})
            if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
                raise ValueError("'weight_map' must map tensor names to shard file names")
        except (ValueError, AttributeError) as exc:
            raise AuditInputError(f"--weight index {str(p)!r} is not a safetensors index ({_first_line(exc)}): "
                                  f"expected {{\"weight_map\": {{tensor: shard file}}}}") from None
        if not wmap:
            raise AuditInputError(f"--weight index {str(p)!r} has an empty 'weight_map'")
        k = _pick_key(list(wmap), key, str(p))
        shard = p.parent / wmap[k]
        if not shard.is_file():
            raise AuditInputError(f"--weight index {str(p)!r} puts {k!r} in the shard {wmap[k]!r}, which does not exist "
                                  f"in {str(p.parent)!r}")
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
    if t.device.type != "cpu":
        raise AuditInputError(f"the lm_head weight {where} is on the {t.device.type} device; the audit needs its "
                              f"values on the CPU (a checkpoint saved from meta tensors holds none)")
    if t.dim() != 2 or t.dtype != torch.bfloat16:
        raise AuditInputError(f"the lm_head weight {where} must be a 2-D bfloat16 tensor [V, D] (the contract covers "
                              f"bf16 inputs only; nothing is cast); got {t.dtype} {tuple(t.shape)}")
    if t.shape[0] == 0 or t.shape[1] == 0:
        raise AuditInputError(f"the lm_head weight {where} is empty ({tuple(t.shape)})")
    return t.contiguous(), where


_ACCEPTED = "a torch.save dict or .safetensors file of tensors, or the vLLM plugin's .json/.jsonl rows (fused-logp audit --help)"


def _first_line(exc) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def _tensor_file(path: Path) -> dict:
    if path.suffix == ".safetensors":
        try:
            from safetensors import safe_open
            with safe_open(str(path), framework="pt") as f:
                out = {k: f.get_tensor(k) for k in f.keys()}
                meta = f.metadata() or {}
        except Exception as exc:
            raise AuditInputError(f"capture {str(path)!r} cannot be read as safetensors ({_first_line(exc)}); "
                                  f"expected {_ACCEPTED}") from None
        for k in ("contract_version", "vocab_size"):
            if k in meta and k not in out:
                out[k] = meta[k]
        return out
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise AuditInputError(f"capture {str(path)!r} cannot be read as a torch file ({_first_line(exc)}); expected "
                              f"{_ACCEPTED}") from None
    if not isinstance(obj, dict):
        raise AuditInputError(f"capture {str(path)!r}: a torch capture must be a dict of tensors; got {type(obj).__name__}")
    return obj


def _int_list(value, what) -> list:
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise AuditInputError(f"{what} must be a list of integers")
    return value


def _logprob(x, what) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, str)):
        raise AuditInputError(f"{what} must be a number or one of '-inf', 'inf', 'nan'; got {x!r}")
    try:
        return float(x)
    except ValueError:
        raise AuditInputError(f"{what} must be a number or one of '-inf', 'inf', 'nan'; got {x!r}") from None


def _plugin_records(path: Path) -> dict:
    """The vLLM plugin's captured rows -> the tensor capture's keys (padded to the widest row)."""
    where = f"capture {str(path)!r}"
    try:
        text = path.read_text()
        if text.lstrip().startswith("["):
            recs = json.loads(text)
        else:
            recs = [json.loads(x) for x in text.splitlines() if x.strip()]
    except (UnicodeDecodeError, ValueError) as exc:
        raise AuditInputError(f"{where} is not JSON ({_first_line(exc)}): the plugin's rows are a JSON list or "
                              f"JSON lines of {{hidden, ids, logprobs, temperature, program}} records") from None
    if not isinstance(recs, list) or not all(isinstance(r, dict) for r in recs):
        raise AuditInputError(f"{where}: every row must be a JSON object {{hidden, ids, logprobs, temperature, "
                              f"program}}")
    meta: dict = {}
    for i, r in enumerate(recs):
        for k in ("vocab_size", "contract_version"):
            if k in r:
                if k in meta and meta[k] != r[k]:
                    raise AuditInputError(f"{where}: records give different {k} values ({meta[k]!r} and {r[k]!r})")
                meta[k] = r[k]
    rows = [r for r in recs if r.get("kind") != "header"]
    if not rows:
        raise AuditInputError(f"{where} holds no rows")
    width = 0
    d = None
    for i, r in enumerate(rows):
        for k in ("hidden", "ids", "logprobs"):
            if k not in r:
                raise AuditInputError(f"{where}: row {i} has no {k!r} (keys: {sorted(r)}); a row needs hidden, ids "
                                      f"and logprobs")
        hid = _int_list(r["hidden"], f"{where}: row {i} 'hidden'")
        if not hid or any(x < -32768 or x > 65535 for x in hid):
            raise AuditInputError(f"{where}: row {i} 'hidden' must be a non-empty list of bfloat16 bit patterns, "
                                  f"-32768..32767 or 0..65535")
        if d is None:
            d = len(hid)
        elif len(hid) != d:
            raise AuditInputError(f"{where}: row {i} 'hidden' has {len(hid)} values, row 0 has {d}")
        ids = _int_list(r["ids"], f"{where}: row {i} 'ids'")
        if not isinstance(r["logprobs"], list) or len(r["logprobs"]) != len(ids):
            raise AuditInputError(f"{where}: row {i} 'logprobs' must be a list as long as 'ids' ({len(ids)})")
        if any(x < -(1 << 63) or x >= (1 << 63) for x in ids):
            raise AuditInputError(f"{where}: row {i} 'ids' must be int64 token ids")
        t = r.get("temperature", 1.0)
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise AuditInputError(f"{where}: row {i} 'temperature' must be a number; got {t!r}")
        if r.get("program") is not None and not isinstance(r["program"], dict):
            raise AuditInputError(f"{where}: row {i} 'program' must be an object or null")
        width = max(width, len(ids))
    if width == 0:
        raise AuditInputError(f"{where}: no row has any ids")
    bits = torch.tensor([r["hidden"] for r in rows], dtype=torch.int32)
    hid = torch.where(bits > 32767, bits - 65536, bits).to(torch.int16).view(torch.bfloat16)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    logp = torch.full((len(rows), width), float("-inf"), dtype=torch.float32)
    for i, r in enumerate(rows):
        ids[i, : len(r["ids"])] = torch.tensor(r["ids"], dtype=torch.int64)
        logp[i, : len(r["ids"])] = torch.tensor([_logprob(x, f"{where}: row {i} logprob") for x in r["logprobs"]],
                                                dtype=torch.float32)
    out = {"hidden": hid, "targets": ids, "logp": logp,
           "temperature": torch.tensor([float(r.get("temperature", 1.0)) for r in rows], dtype=torch.float32),
           "programs": [r.get("program") for r in rows], "plugin": True}
    out.update(meta)
    return out


def _check_tensor(cap, key, where, *, shape=None, kinds=None, required=True):
    v = cap.get(key)
    if v is None:
        if required:
            raise AuditInputError(f"{where} has no {key!r} (keys: {sorted(map(str, cap))}); see `fused-logp audit --help`")
        return None
    if not isinstance(v, torch.Tensor):
        raise AuditInputError(f"{where} {key!r} must be a tensor; got {type(v).__name__}")
    if v.device.type != "cpu":
        raise AuditInputError(f"{where} {key!r} is on the {v.device.type} device; a capture's tensors must hold "
                              f"their values on the CPU")
    if kinds == "int" and (v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool):
        raise AuditInputError(f"{where} {key!r} must be an integer tensor; got {v.dtype}")
    if kinds == "float" and not v.dtype.is_floating_point:
        raise AuditInputError(f"{where} {key!r} must be a floating-point tensor; got {v.dtype}")
    if shape is not None and tuple(v.shape) != tuple(shape) and not (v.numel() == 1 and key == "temperature"):
        raise AuditInputError(f"{where} {key!r} must have shape {list(shape)}; got {list(v.shape)}")
    return v


def _scalar_int(v, what) -> int:
    try:
        if isinstance(v, torch.Tensor):
            if v.numel() != 1 or v.dtype.is_floating_point or v.device.type != "cpu":
                raise ValueError
            v = int(v.item())
        elif isinstance(v, str):
            v = int(v)
        elif isinstance(v, bool) or not isinstance(v, int):
            raise ValueError
    except (ValueError, TypeError):
        raise AuditInputError(f"{what} must be an integer >= 1; got {v!r}") from None
    if v < 1:
        raise AuditInputError(f"{what} must be an integer >= 1; got {v}")
    return v


def load_capture(path) -> dict:
    from .shared_contract.constants import CONTRACT_VERSION
    p = Path(path)
    if not p.exists():
        raise AuditInputError(f"capture {str(path)!r} does not exist")
    if p.is_dir():
        raise AuditInputError(f"capture {str(path)!r} is a folder; expected {_ACCEPTED}")
    cap = _plugin_records(p) if p.suffix in (".json", ".jsonl") else _tensor_file(p)
    where = f"capture {str(p)!r}"
    version = cap.get("contract_version")
    if version is not None:
        if isinstance(version, torch.Tensor) or not isinstance(version, str):
            raise AuditInputError(f"{where} 'contract_version' must be a string; got {type(version).__name__}")
        if version != CONTRACT_VERSION:
            raise AuditInputError(f"{where} was recorded under contract {version}; this fused-logp implements "
                                  f"{CONTRACT_VERSION}: its bytes are another contract's (audit it with a fused-logp "
                                  f"of contract {version})")
    h = _check_tensor(cap, "hidden", where, kinds="float")
    t = _check_tensor(cap, "targets", where, kinds="int")
    lp = _check_tensor(cap, "logp", where, kinds="float")
    if h.dim() != 2 or h.dtype != torch.bfloat16:
        raise AuditInputError(f"capture 'hidden' must be [N, D] bfloat16; got {h.dtype} {tuple(h.shape)}")
    n = h.shape[0]
    if n == 0 or h.shape[1] == 0:
        raise AuditInputError(f"{where} holds no rows (hidden {list(h.shape)})")
    if t.dim() not in (1, 2) or t.shape[0] != n or lp.shape != t.shape or (t.dim() == 2 and t.shape[1] == 0):
        raise AuditInputError(f"capture 'targets' must be [N] or [N, C] with N={n} and 'logp' the same shape; got "
                              f"{tuple(t.shape)} and {tuple(lp.shape)}")
    cap["targets"] = t.to(torch.int64)
    cap["logp"] = lp.to(torch.float32)
    temp = _check_tensor(cap, "temperature", where, shape=(n,), kinds="float", required=False)
    cap["temperature"] = torch.ones(n) if temp is None else temp.to(torch.float32).reshape(-1).expand(n).contiguous()
    if _check_tensor(cap, "lse", where, shape=(n,), kinds="float", required=False) is not None:
        cap["lse"] = cap["lse"].to(torch.float32)
    _check_tensor(cap, "top_k", where, shape=(n,), kinds="int", required=False)
    _check_tensor(cap, "top_p", where, shape=(n,), kinds="float", required=False)
    _check_tensor(cap, "min_p", where, shape=(n,), kinds="float", required=False)
    if cap.get("vocab_size") is not None:
        cap["vocab_size"] = _scalar_int(cap["vocab_size"], f"{where} 'vocab_size'")
    else:
        cap.pop("vocab_size", None)
    if "programs" not in cap:
        cap["programs"] = _programs_from_tensors(cap, n)
    from .kernel.transforms import TransformProgram
    for i, prog in enumerate(cap["programs"]):
        if prog is not None:
            try:
                TransformProgram.from_dict(prog)
            except Exception as exc:
                raise AuditInputError(f"{where}: row {i}'s sampling program {prog!r} is not one ({_first_line(exc)})") from None
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
    from .atomic_io import atomic_path
    from .shared_contract.constants import CONTRACT_VERSION
    if vocab_size is not None:
        d["vocab_size"] = torch.tensor(int(vocab_size), dtype=torch.int64)
    with atomic_path(path) as tmp:
        if str(path).endswith(".safetensors"):
            from safetensors.torch import save_file
            meta = {"contract_version": CONTRACT_VERSION}
            if vocab_size is not None:
                meta["vocab_size"] = str(int(vocab_size))
            save_file(d, tmp, metadata=meta)
        else:
            d["contract_version"] = CONTRACT_VERSION
            torch.save(d, tmp)


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
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= weight.shape[0]:
        raise AuditInputError(f"vocab_size must be an integer in [1, {weight.shape[0]}] (the weight's rows); got "
                              f"{vocab_size!r}")
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
        raise AuditInputError(f"max_rows must be an integer >= 1 or None; got {max_rows!r}")
    if isinstance(rows_per_batch, bool) or not isinstance(rows_per_batch, int) or rows_per_batch < 1:
        raise AuditInputError(f"rows_per_batch must be an integer >= 1; got {rows_per_batch!r}")
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


def _int_arg(name, low):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {v}")
        return v
    parse.__name__ = name
    return parse


def _main(argv) -> int:
    from .atomic_io import atomic_write_text, check_output_file
    from .cli import CliError, Parser
    p = Parser(prog="fused-logp audit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("capture", help="a tensor capture (.pt/.safetensors) or the vLLM plugin's rows (.json/.jsonl)")
    p.add_argument("--weight", required=True, help="lm_head checkpoint: .safetensors, sharded dir/index.json, or torch file")
    p.add_argument("--weight-key", default=None, help=f"tensor name (default: {' / '.join(DEFAULT_KEYS)} / the only 2-D one)")
    p.add_argument("--vocab-size", type=_int_arg("vocab-size", 1), default=None,
                   help="real vocabulary, 1..weight rows (default: the capture's, else weight rows)")
    p.add_argument("--backend", default="oracle-fast", choices=("oracle-fast", "oracle"),
                   help="contract-bearing CPU backend (default oracle-fast; oracle = the numpy reference)")
    p.add_argument("--rows-per-batch", type=_int_arg("rows-per-batch", 1), default=64, help=">= 1 (default 64)")
    p.add_argument("--max-rows", type=_int_arg("max-rows", 1), default=None, help="check the first N >= 1 rows only")
    p.add_argument("--show", type=_int_arg("show", 0), default=10, help="mismatching rows listed in the report (>= 0)")
    p.add_argument("--out", default=None, help="write the report as JSON here (a file path)")
    p.add_argument("--expect-fingerprint", default=None,
                   help="the rollout's lm_head fingerprint (the plugin's status reports it): refuse a different weight")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.out is not None:
        check_output_file(args.out, "--out")
    cap = load_capture(args.capture)
    weight, where = load_weight(args.weight, args.weight_key)
    rows = weight.shape[0]
    if args.vocab_size is not None and args.vocab_size > rows:
        raise CliError(f"argument --vocab-size: expected 1..{rows} (the rows of {where}); got {args.vocab_size}")
    if args.vocab_size is None and cap.get("vocab_size") is not None and cap["vocab_size"] > rows:
        raise CliError(f"capture {str(args.capture)!r} has vocab_size {cap['vocab_size']}, more than the {rows} rows of "
                       f"{where}: not the rollout's lm_head")
    vocab = args.vocab_size or cap.get("vocab_size") or rows
    if args.vocab_size is None and cap.get("vocab_size") is None:
        print(f"fused-logp audit: warning: capture {str(args.capture)!r} carries no vocab_size; the vocabulary is taken "
              f"as the weight's {rows} rows (pass --vocab-size when the checkpoint is padded)", file=sys.stderr)
    from . import weight_fingerprint
    fp = weight_fingerprint(weight[:vocab], vocab_size=vocab)
    if args.expect_fingerprint is not None and args.expect_fingerprint != fp:
        raise AuditInputError(f"the weight {where} has fingerprint {fp}, not the expected {args.expect_fingerprint}: "
                              f"it is not the lm_head the rollout used")
    rep = audit(cap, weight, vocab_size=vocab, backend=args.backend, rows_per_batch=args.rows_per_batch,
                max_rows=args.max_rows, show=args.show, progress=not args.no_progress)
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
    if rep["values_checked"] == 0 and not rep["lse_recorded"]:
        raise CliError(f"capture {str(args.capture)!r}: nothing to compare (every recorded logprob of the "
                       f"{rep['rows']} rows is -inf, which carries no value); no report written")
    print("  result: " + ("every checked byte equal" if rep["ok"] else "MISMATCH"))
    if args.out:
        atomic_write_text(args.out, json.dumps(rep, indent=2, default=str) + "\n")
    return 0 if rep["ok"] else 1


def main(argv=None, _wrapped: bool = False) -> int:
    """`fused-logp audit`: exit 0 every checked byte equal, 1 a mismatch, 2 the inputs cannot be audited (one line
    on stderr), 3 an internal error (docs/cli.md)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if _wrapped:
        return _main(argv)
    from .cli import main as top
    return top(["audit"] + argv)


if __name__ == "__main__":
    sys.exit(main())
