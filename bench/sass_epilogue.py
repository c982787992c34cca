"""The forward kernels' SASS on the CPU: compile a launch configuration's translation unit for sm_90a, disassemble
it and count the instructions of its FULL_K forward kernel by opcode (statically, whole kernel), and of the
epilogue's item loop (the instructions between the loop's first and last line of stats_epilogue.cuh, by -lineinfo).

    python -P bench/sass_epilogue.py [--tu sm90_cta_128x256.cu,sm90_cta_128x256_lean.cu] [--out DIR] [--loop]

--loop also prints the item loop (the backward branch of stats_epilogue.cuh's loop) by source line, one column a
translation unit, with the line's text: the table the NOTES' per-item counts were read from. Which lines are on the
common path (and which are cold: the bias, the logits, `__fdiv_rn`'s fallback, the non-fast exp, the target search)
is for the reader to judge; a line that serves both exp paths (contract_math.cuh's exp_reduce) counts twice.

Needs nvcc, and nvdisasm from the CUDA toolkit or from the `nvidia-cuda-nvdisasm` wheel (NVDISASM=path). Static
counts are a prediction aid, not a timing: a loop body runs once an item, the rest once a tile or once a kernel.
"""
from __future__ import annotations

import argparse
import collections
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


def kernels(text: str) -> dict[str, list[tuple[str, str]]]:
    """function name -> [(opcode, line marker)], the line marker being the last '//## File ..., line N' seen."""
    out: dict[str, list[tuple[str, str]]] = {}
    cur, where = None, ""
    for line in text.splitlines():
        m = re.match(r"(_Z\w+):$", line)
        if m:
            cur = m.group(1)
            out[cur] = []
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = f"{Path(m.group(1)).name}:{m.group(2)}"
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m and cur is not None:
            out[cur].append((m.group(1).split(".")[0], where))
    return out


def item_loop(ins: list[tuple[str, str]], text_ops: list[tuple[str, str, str]]) -> list[tuple[str, str]]:
    """The instructions of the item loop: from the target of the last backward branch whose line is in
    stats_epilogue.cuh to that branch."""
    labels: dict[str, int] = {}
    flat: list[tuple[str, str, str]] = []
    for kind, a, b in text_ops:
        if kind == "label":
            labels[a] = len(flat)
        else:
            flat.append((kind, a, b))
    loop = None
    for i, (_, txt, where) in enumerate(flat):
        m = re.search(r"BRA\b.*?(\.L_x_\d+)", txt)
        if m and where.startswith("stats_epilogue.cuh") and labels.get(m.group(1), i + 1) < i:
            loop = (labels[m.group(1)], i + 1)
    if loop is None:
        return []
    return [(txt.split()[0] if not txt.startswith("@") else txt.split()[1], w) for _, txt, w in flat[loop[0]:loop[1]]]


def kernel_listing(text: str, name: str) -> list[tuple[str, str, str]]:
    """[("label", name, "") | ("ins", instruction text, line marker)] of one function of nvdisasm's output."""
    out: list[tuple[str, str, str]] = []
    inside, where = False, ""
    for line in text.splitlines():
        m = re.match(r"(_Z\w+):$", line)
        if m:
            inside = m.group(1) == name
            continue
        if not inside:
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = f"{Path(m.group(1)).name}:{m.group(2)}"
            continue
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            out.append(("label", m.group(1), ""))
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            out.append(("ins", m.group(1), where))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tu", default="sm90_cta_128x256.cu,sm90_cta_128x256_lean.cu")
    ap.add_argument("--out", default=None, help="write sass-<tu>.txt and sass-counts.json here")
    ap.add_argument("--loop", action="store_true", help="the item loop by source line, side by side")
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
            for name, ins in kernels(text).items():
                # the FULL_K forward statistics kernel: fused_cta_kernel<WM, WGN, true, false, ...>
                if "fused_cta_kernel" not in name or not re.search(r"Li\d+ELi\d+ELb1ELb0E", name):
                    continue
                hist = collections.Counter(op for op, _ in ins)
                epi = collections.Counter(op for op, w in ins if w.startswith("stats_epilogue.cuh")
                                          or w.startswith("contract_math.cuh"))
                loop = item_loop(ins, kernel_listing(text, name))
                loops[tu] = collections.Counter(w for _, w in loop)
                summary[f"{tu}:{name}"] = {"total": len(ins), "epilogue_lines": sum(epi.values()),
                                           "item_loop": len(loop), "item_loop_by_line": dict(loops[tu]),
                                           "by_opcode": dict(hist.most_common()),
                                           "epilogue_by_opcode": dict(epi.most_common())}
                top = ", ".join(f"{k} {v}" for k, v in epi.most_common(14))
                print(f"{tu}: {name[:60]}...: {len(ins)} instructions, {sum(epi.values())} from the epilogue's "
                      f"sources ({top})")
    if args.loop and loops:
        tus = list(loops)
        keys = sorted(set().union(*loops.values()),
                      key=lambda w: (w.split(":")[0], int(w.split(":")[1]) if ":" in w else 0))
        print(f"item loop: " + ", ".join(f"{tu} {sum(loops[tu].values())}" for tu in tus))
        for w in keys:
            f, _, ln = w.partition(":")
            src = CSRC / f
            text = src.read_text().splitlines()[int(ln) - 1].strip()[:70] if src.exists() and ln else ""
            print(f"{w:28s}" + "".join(f"{loops[tu].get(w, 0):7d}" for tu in tus) + f"  {text}")
    if args.out:
        (Path(args.out) / "sass-counts.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
