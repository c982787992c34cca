"""The forward kernels' SASS on the CPU: compile a launch configuration's translation unit for sm_90a, disassemble
it and count the instructions of its two FULL_K forward kernels (without and with the logits, "+logits") by opcode
(statically, whole kernel), and of the epilogue's item loop (the instructions between the loop's first and last line of stats_epilogue.cuh, by -lineinfo).

    python -P bench/sass_epilogue.py [--tu sm90_cta_128x256.cu,sm90_cta_64x256.cu] [--out DIR] [--loop]

--path also follows one item through the item loop on its common path and counts the instructions issued: a full
tile, every row real, no bias, no logits, the fast exp, the target elsewhere; at T = 1 (`t1`) and at T != 1 (`t07`,
the division guard passing). Each conditional branch is decided by the source `if` it belongs to (which side
holds its block, by the first instruction of stats_epilogue.cuh after it); a branch of another line takes the side
without a slow-path CALL. Predicated instructions count as issued. This is the per-item figure (instructions a logit
= the count / 32) that predicts an epilogue change's cost (docs/design/sm90-kernel.md).

--loop also prints the item loop (the backward branch of stats_epilogue.cuh's loop) by source line, one column a
translation unit, with the line's text: the table the per-item counts are read from. Which lines are on the
common path (and which are cold: the bias, the logits, `__fdiv_rn`'s fallback, the non-fast exp, the target search)
is for the reader to judge; a line that serves both exp paths (contract_math.cuh's exp_reduce) counts twice.

Needs nvcc, and nvdisasm from the CUDA toolkit or from the `nvidia-cuda-nvdisasm` wheel (NVDISASM=path). Static
counts are a prediction aid, not a timing: a loop body runs once an item, the rest once a tile or once a kernel.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "src" / "fused_logp" / "kernel" / "csrc"
sys.path.insert(0, str(ROOT / "src"))


def _includes(tmp: Path) -> list[str]:
    from torch.utils import cpp_extension
    incs = list(cpp_extension.include_paths())
    if not any((Path(p) / "c10/cuda/impl/cuda_cmake_macros.h").exists() for p in incs):
        shim = tmp / "shim"
        (shim / "c10/cuda/impl").mkdir(parents=True, exist_ok=True)
        (shim / "c10/cuda/impl/cuda_cmake_macros.h").write_text("#pragma once\n")
        incs = [str(shim)] + incs
    if Path("/usr/local/cuda/include").exists():
        incs.append("/usr/local/cuda/include")
    incs.append(sysconfig.get_paths()["include"])
    return incs


def _nvdisasm() -> str:
    for c in (os.environ.get("NVDISASM"), shutil.which("nvdisasm"), "/usr/local/cuda/bin/nvdisasm"):
        if c and Path(c).exists():
            return c
    sys.exit("nvdisasm not found: set NVDISASM (e.g. from the nvidia-cuda-nvdisasm wheel's nvidia/cu13/bin)")


def sass(tu: str, tmp: Path) -> str:
    from fused_logp.kernel import sm90
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    cubin = tmp / (tu + ".cubin")
    cmd = [nvcc, "-cubin", str(CSRC / tu), "-o", str(cubin), *sm90.CUDA_FLAGS, "-std=c++17",
           "-DTORCH_EXTENSION_NAME=sm90_ext", "-I", str(CSRC)]
    for p in _includes(tmp):
        cmd += ["-I", p]
    subprocess.run(cmd, check=True)
    return subprocess.run([_nvdisasm(), "-g", "-c", str(cubin)], check=True, stdout=subprocess.PIPE,
                          text=True).stdout


def listings(text: str) -> dict[str, list[tuple[str, str, str]]]:
    """function name -> [("label", name, "") | ("ins", instruction text, line marker)] of nvdisasm's output, the line
    marker being the last '//## File ..., line N' seen."""
    out: dict[str, list[tuple[str, str, str]]] = {}
    cur: list[tuple[str, str, str]] | None = None
    where = ""
    for line in text.splitlines():
        m = re.match(r"(_Z\w+):$", line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        if cur is None:
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = f"{Path(m.group(1)).name}:{m.group(2)}"
            continue
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            cur.append(("label", m.group(1), ""))
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            cur.append(("ins", m.group(1), where))
    return out


def opcode(ins: str) -> str:
    """The opcode of an instruction's text, without its predicate and modifiers."""
    return ins.split()[1 if ins.startswith("@") else 0].split(".")[0]


_BRA = re.compile(r"(@!?U?P\w+\s+)?BRA(\.\S+)?\s+(?:!?U?P\w+,\s*)?`?\(?(\.L_x_\d+)")


Split = tuple[list[tuple[str, str]], dict[str, int], "tuple[int, int] | None"]


def _split(listing: list[tuple[str, str, str]]) -> Split:
    """(instructions as (text, line marker), label -> instruction index, (first, last) index of the item loop: from
    the target of the last backward branch whose line is in stats_epilogue.cuh to that branch, or None)."""
    labels: dict[str, int] = {}
    flat: list[tuple[str, str]] = []
    for kind, a, b in listing:
        if kind == "label":
            labels[a] = len(flat)
        else:
            flat.append((a, b))
    loop = None
    for i, (txt, w) in enumerate(flat):
        m = _BRA.match(txt)
        if m and w.startswith("stats_epilogue.cuh") and labels[m.group(3)] < i:
            loop = (labels[m.group(3)], i)
    return flat, labels, loop


def item_loop(listing: list[tuple[str, str, str]]) -> list[tuple[str, str]]:
    """The item loop's instructions as (opcode, line marker), all paths."""
    flat, _, loop = _split(listing)
    return [] if loop is None else [(opcode(txt), w) for txt, w in flat[loop[0]:loop[1] + 1]]



# Scenarios of --path: the truth of each `if` of item_stats / cta_items_epilogue on the item's common path, by a
# fragment of its source line.
PATH_SCENARIOS = {
    "t1": {"p.bias != nullptr": False, "full && p.logits_vec4": True, "T[h] != 1.0f": False, "if (full)": True,
           "__all_sync(0xffffffffu, ok)": True, "if (bad[h])": False, "r >= p.n_rows": False,
           "tl >= 0 && tl < kTile": False, "q == 0": True, "rbase < p.n_rows": True,
           "row + 8 * h >= p.n_rows": False},
}
PATH_SCENARIOS["t07"] = dict(PATH_SCENARIOS["t1"], **{"T[h] != 1.0f": True, "T[h] >= kRowRcpTMin": True})


@functools.lru_cache(maxsize=None)
def _lines(name: str) -> list[str]:
    path = CSRC / name
    return path.read_text().splitlines() if path.exists() else []


def _source(where: str) -> tuple[str, int, list[str]]:
    """(file, line number, the file's lines) of a line marker; no lines for a file outside csrc."""
    f, _, ln = where.partition(":")
    return f, int(ln or 0), (_lines(f) if ln else [])


def _block(lines: list[str], ln: int) -> tuple[int, int] | None:
    """The source lines of the block the `if` at line ln opens, or None where it has no braces."""
    if not lines[ln - 1].split("//")[0].rstrip().endswith("{"):
        return None
    depth = 0
    for k in range(ln - 1, len(lines)):
        for ch in lines[k].split("//")[0]:
            depth += (ch == "{") - (ch == "}")
            if ch == "}" and depth == 0:
                return ln + 1, k + 1
    return None


def common_path(listing: list[tuple[str, str, str]], truth: dict[str, bool]) -> float:
    """Instructions issued an item on the path `truth` describes (see --path): the loop iteration's count divided by
    the items it takes (the times the path passes item_stats' vote, `__all_sync`)."""
    flat, labels, loop = _split(listing)
    if loop is None:
        return 0
    start, end = loop

    def slow(j: int) -> bool:
        return any("CALL" in flat[x][0] for x in range(j, min(j + 12, len(flat))))

    def decide(i: int, tgt: int) -> bool:
        f, ln, lines = _source(flat[i][1])
        text = lines[ln - 1] if lines else ""
        for frag, holds in truth.items():
            if frag not in text:
                continue
            blk = _block(lines, ln)
            if blk is None:       # `if (...) continue;` jumps when it holds; `if (...) stmt;` jumps over stmt
                return holds if re.search(r"\b(continue|break|return)\b", text) else not holds

            def in_block(j: int) -> bool:
                for x in range(j, min(j + 40, len(flat))):
                    xf, _, xl = flat[x][1].partition(":")
                    if xf == f and xl and int(xl) > ln:
                        return blk[0] <= int(xl) <= blk[1]
                return False
            tb, fb = in_block(tgt), in_block(i + 1)
            if tb != fb:
                return holds if tb else not holds
            return not holds
        if slow(tgt) != slow(i + 1):
            return slow(i + 1)
        return False

    i, count, items = start, 0, 0
    while count < 100000:
        txt, where = flat[i]
        count += 1
        if i == end:
            break
        m = _BRA.match(txt)
        if m:
            tgt = labels[m.group(3)]
            f, ln, lines = _source(where)
            items += bool(lines) and "__all_sync(0xffffffffu, ok)" in lines[ln - 1]
            i = tgt if m.group(1) is None or decide(i, tgt) else i + 1
        else:
            i += 1
    return count / max(items, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tu", default="sm90_cta_128x256.cu,sm90_cta_64x256.cu,sm90_cta_64x128.cu")
    ap.add_argument("--out", default=None, help="write sass-<tu>.txt and sass-counts.json here")
    ap.add_argument("--loop", action="store_true", help="the item loop by source line, side by side")
    ap.add_argument("--path", action="store_true", help="instructions of one item on its common path (t1, t07)")
    args = ap.parse_args()
    summary = {}
    loops: dict[str, collections.Counter] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for tu in args.tu.split(","):
            text = sass(tu, tmp)
            if args.out:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                (Path(args.out) / f"sass-{tu}.txt").write_text(text)
            for name, listing in listings(text).items():
                # the FULL_K forward statistics kernels: fused_cta_kernel<WM, WGN, true, false, LOGITS>
                m = re.search(r"Li\d+ELi\d+ELb1ELb0ELb([01])E", name)
                if "fused_cta_kernel" not in name or not m:
                    continue
                label = tu + (" +logits" if m.group(1) == "1" else "")
                ins = [(opcode(txt), w) for kind, txt, w in listing if kind == "ins"]
                hist = collections.Counter(op for op, _ in ins)
                epi = collections.Counter(op for op, w in ins if w.startswith("stats_epilogue.cuh")
                                          or w.startswith("contract_math.cuh"))
                loop = item_loop(listing)
                paths = None
                if args.path:
                    paths = {sc: common_path(listing, truth) for sc, truth in PATH_SCENARIOS.items()}
                    print(f"{label}: one item's common path: " + ", ".join(
                        f"{sc} {n:.0f} instructions ({n / 32:.1f} a logit)" for sc, n in paths.items()))
                loops[label] = collections.Counter(w for _, w in loop)
                summary[f"{tu}:{name}"] = {"total": len(ins), "epilogue_lines": sum(epi.values()),
                                           "item_loop": len(loop), "item_loop_by_line": dict(loops[label]),
                                           "common_path": paths,
                                           "by_opcode": dict(hist.most_common()),
                                           "epilogue_by_opcode": dict(epi.most_common())}
                top = ", ".join(f"{k} {v}" for k, v in epi.most_common(14))
                print(f"{label}: {name[:60]}...: {len(ins)} instructions, {sum(epi.values())} from the epilogue's "
                      f"sources ({top})")
    if args.loop and loops:
        tus = list(loops)
        keys = sorted(set().union(*loops.values()),
                      key=lambda w: (w.split(":")[0], int(w.split(":")[1]) if ":" in w else 0))
        print("item loop: " + ", ".join(f"{tu} {sum(loops[tu].values())}" for tu in tus))
        for w in keys:
            _, ln, lines = _source(w)
            text = lines[ln - 1].strip()[:70] if lines else ""
            print(f"{w:28s}" + "".join(f"{loops[tu].get(w, 0):7d}" for tu in tus) + f"  {text}")
    if args.out:
        (Path(args.out) / "sass-counts.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
