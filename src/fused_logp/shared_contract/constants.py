"""Every bit-relevant constant of contract v1, in one place.

Changing any value here changes result bytes, so it requires a new contract version (and new golden
fingerprints). Nothing may override these at run time: `check_no_overrides` refuses environment variables
and configuration keys that try to.
"""
from __future__ import annotations

import os
from types import MappingProxyType

CONTRACT_VERSION = "cuda-fused-linear-logp-sm90-contract-v1"

# Global vocabulary tile width: tile t holds real vocabulary ids [64t, 64t+64).
VOCAB_TILE = 64
# The K dimension is walked in ascending groups of 16 (one wgmma ... k16 step each), one FP32 accumulator.
K_GROUP = 16
# The design document's name for the K order: two k16 groups per slab, ascending. Bit-neutral by construction.
K_SLAB = 32
# The per-tile sum: adjacent-pairwise balanced tree over the 64 lanes (six levels).
TREE_ID = "adjacent-pairwise-64"
# The row merge: order-free max, then a sequential chain over tiles in ascending global order.
MERGE_ID = "max-then-ascending-chain"
# The exp/log of the contract: binary32 add/sub/mul and exact bit manipulation only (see transcendentals).
TRANSCENDENTAL_ID = "contract-explog-v1"
# The GEMM accumulation rule (Hopper bf16 tensor core, CONTRACT.md section 2).
GEMM_RULE_ID = "hopper-bf16-k16-trunc25-v1"
# n_split is a function of V only: the merge always runs over ceil(V_real / 64) tiles.
N_SPLIT_POLICY = "ceil(V_real/64) global tiles; CTA split of tiles is free"
# Fractional bits kept when aligning the 17 terms of one k16 group (truncation toward zero).
ALIGN_FRAC_BITS = 25
# Significand bits of the FP32 accumulator (truncation toward zero after each k16 group).
ACC_SIGNIFICAND_BITS = 24
# The alignment exponent emax of one k16 group is never below this (a zero accumulator takes no part; 2^-133 is
# the smallest bf16 subnormal). Measured on the H200 (CONTRACT.md section 2, erratum of 2026-12-01).
ALIGN_EXP_FLOOR = -133
# The NaN the tensor core writes into a logit (binary32 bits). NaN payloads of lse/logp are not part of the contract.
GEMM_NAN_BITS = 0x7FFFFFFF
# Weight fingerprint construction id (a change detector, not a cryptographic commitment).
FINGERPRINT_ID = "rowhash-sum-mod2^64x2-v1"
# The sampling-transform program (temperature -> top-k -> top-p -> min-p), versioned like the contract.
TRANSFORM_PROGRAM_VERSION = "transform-program-v1"

# --- the contract's exp (x <= 0 domain used by the contract; defined for all binary32) ---------------------
# n = round-to-nearest-even(x * LOG2E) via the 1.5*2^23 shifter; r = (x - n*LN2_HI) - n*LN2_LO;
# p(r) = 1 + r*(1 + r*(C2 + r*(C3 + r*(C4 + r*(C5 + r*(C6 + r*C7)))))); result = p * 2^n (two exact steps).
EXP_LOG2E = 0x3FB8AA3B            # 1.44269502 (binary32 bits)
EXP_SHIFTER = 0x4B400000          # 12582912.0 = 1.5 * 2^23
EXP_LN2_HI = 0x3F317200           # 0.693145752 (16 significant bits: n*LN2_HI is exact for |n| < 256)
EXP_LN2_LO = 0x35BFBE8E           # 1.42860677e-06 (LN2 - LN2_HI rounded)
EXP_POLY = (                      # C2..C7 as binary32 bits (Taylor coefficients 1/k!, rounded)
    0x3F000000,                   # 1/2
    0x3E2AAAAB,                   # 1/6
    0x3D2AAAAB,                   # 1/24
    0x3C088889,                   # 1/120
    0x3AB60B61,                   # 1/720
    0x39500D01,                   # 1/5040
)
EXP_X_MAX = 0x42B17217            # 88.7228394: above, +inf
EXP_X_MIN = 0xC2CFF1B5            # -103.972076: below, +0

# --- the contract's log (x > 0) ---------------------------------------------------------------------------
# x = 2^e * m with m in [sqrt(1/2), sqrt(2)); f = m - 1 (exact); log x = e*LN2_HI + (f + (f*f*q(f) + e*LN2_LO))
LOG_SQRT_HALF_BITS = 0x3F3504F3   # the mantissa split point sqrt(1/2)
LOG_LN2_HI = EXP_LN2_HI
LOG_LN2_LO = EXP_LN2_LO
LOG_POLY = (                      # q(f) ~ (log1p(f) - f) / f^2, degree 9, binary32 bits, constant term first
    0xBF000000,                   # -0.5
    0x3EAAAAA3,                   # 0.3333331048
    0xBE80001B,                   # -0.2500008047
    0x3E4CD2A0,                   # 0.2000222206
    0xBE2AA805,                   # -0.1666565686
    0x3E119335,                   # 0.1421631128
    0xBDFEAEC9,                   # -0.1243568137
    0x3DF47039,                   # 0.1193546727
    0xBDEC58E2,                   # -0.1154039055
    0x3D851DBD,                   # 0.0649981275
)

_ALL = {
    "CONTRACT_VERSION": CONTRACT_VERSION,
    "VOCAB_TILE": VOCAB_TILE,
    "K_GROUP": K_GROUP,
    "K_SLAB": K_SLAB,
    "TREE_ID": TREE_ID,
    "MERGE_ID": MERGE_ID,
    "TRANSCENDENTAL_ID": TRANSCENDENTAL_ID,
    "GEMM_RULE_ID": GEMM_RULE_ID,
    "N_SPLIT_POLICY": N_SPLIT_POLICY,
    "ALIGN_FRAC_BITS": ALIGN_FRAC_BITS,
    "ACC_SIGNIFICAND_BITS": ACC_SIGNIFICAND_BITS,
    "ALIGN_EXP_FLOOR": ALIGN_EXP_FLOOR,
    "GEMM_NAN_BITS": GEMM_NAN_BITS,
    "FINGERPRINT_ID": FINGERPRINT_ID,
    "TRANSFORM_PROGRAM_VERSION": TRANSFORM_PROGRAM_VERSION,
}
CONSTANTS = MappingProxyType(_ALL)

ENV_PREFIX = "FUSED_LOGP_"


class ContractOverrideError(ValueError):
    """A contract constant was given a value from outside this module."""


def _override_message(name: str, source: str) -> str:
    return (f"{name} is a bit-relevant constant of {CONTRACT_VERSION} and cannot be overridden "
            f"(attempted from {source}); a different value needs a new contract version")


def check_no_overrides(mapping=None, source: str = "configuration") -> None:
    """Raise ContractOverrideError if `mapping` (or the environment) tries to set a contract constant."""
    if mapping is None:
        for key in os.environ:
            if key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX):].upper() in _ALL:
                raise ContractOverrideError(_override_message(key[len(ENV_PREFIX):].upper(), f"environment variable {key}"))
        return
    for key in mapping:
        if str(key).upper() in _ALL:
            raise ContractOverrideError(_override_message(str(key).upper(), source))
