"""The one constants header both compiled implementations include (kernel/csrc/contract_constants.h): the CUDA
extension (kernel/csrc/contract_math.cuh) and the compiled CPU oracle (kernel/cpu/oracle_cpu.cpp).

It is generated from shared_contract/constants.py and committed; tests/sm90/test_sm90_compile.py checks that it is
current. Regenerate with `python -m fused_logp.kernel.contract_header --write`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..shared_contract import constants as C

HEADER = Path(__file__).resolve().parent / "csrc" / "contract_constants.h"


def defines() -> list[tuple[str, int]]:
    """(name, value) of every compiled constant, in the order the extensions' contract_constants() return them."""
    return ([("VOCAB_TILE", C.VOCAB_TILE), ("K_GROUP", C.K_GROUP), ("ALIGN_FRAC_BITS", C.ALIGN_FRAC_BITS),
             ("ACC_BITS", C.ACC_SIGNIFICAND_BITS), ("ALIGN_EXP_FLOOR", C.ALIGN_EXP_FLOOR),
             ("GEMM_NAN_BITS", C.GEMM_NAN_BITS), ("EXP_LOG2E", C.EXP_LOG2E),
             ("EX2_FRAC_BITS", C.EX2_TABLE_FRAC_BITS),
             # the split point of log's mantissa: sqrt(2) = sqrt(1/2) with the exponent field one higher
             ("LOG_SQRT2_BITS", C.LOG_SQRT_HALF_BITS + 0x00800000),
             ("LOG_LN2_HI", C.LOG_LN2_HI), ("LOG_LN2_LO", C.LOG_LN2_LO)]
            + [(f"LOG_Q{i}", v) for i, v in enumerate(C.LOG_POLY)])


def _literal(name: str, value: int) -> str:
    if name.startswith(("EXP", "LOG", "GEMM")):
        return f"0x{value:08X}u"
    return str(value)


def render() -> str:
    lines = ["// Generated from shared_contract/constants.py by `python -m fused_logp.kernel.contract_header --write`;",
             "// do not edit. The contract constants both compiled implementations use (CUDA and the CPU oracle).",
             "#pragma once",
             f'#define FL_CONTRACT_VERSION "{C.CONTRACT_VERSION}"',
             f'#define FL_TRANSCENDENTAL_ID "{C.TRANSCENDENTAL_ID}"']
    lines += [f"#define FL_{name} {_literal(name, value)}" for name, value in defines()]
    lines.append("#define FL_CONTRACT_CONSTANTS_LIST " + ", ".join(f"FL_{n}" for n, _ in defines()))
    return "\n".join(lines) + "\n"


def generated_file_main(argv, header: Path, text: str, module: str, doc: str) -> int:
    """The command of a generated, committed source file: --write writes `text` to `header`; without it, exit 1 (and
    say how to regenerate) where the file is not `text`."""
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--write", action="store_true", help="write the header (default: check it)")
    a = p.parse_args(argv)
    if a.write:
        header.write_text(text)
        return 0
    if not header.exists() or header.read_text() != text:
        print(f"{header} is not current: run python -m {module} --write", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    return generated_file_main(argv, HEADER, render(), "fused_logp.kernel.contract_header", __doc__)


if __name__ == "__main__":
    sys.exit(main())
