"""Every bit-relevant constant of contract v2, in one place.

Changing any value here changes result bytes, so it requires a new contract version (and new golden
fingerprints). Nothing may override these at run time: `check_no_overrides` refuses environment variables
and configuration keys that try to.
"""
from __future__ import annotations

import os
from types import MappingProxyType

CONTRACT_VERSION = "cuda-fused-linear-logp-sm90-contract-v2"
# The contract versions this one replaces: a result stamped with one of them is refused, naming both versions.
RETIRED_CONTRACT_VERSIONS = ("cuda-fused-linear-logp-sm90-contract-v1",)

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
# The transcendentals: SM90's ex2.approx.ftz.f32 as the exp2 (an exact model: a table of 2^23 + 1 entries and an
# exact scale, CONTRACT.md section 6) and the contract's own log (binary32 add/sub/mul, exact bit manipulation).
TRANSCENDENTAL_ID = "sm90-ex2-approx-ftz-table-v1+contract-log-v1"
# The GEMM accumulation rule (Hopper bf16 tensor core, CONTRACT.md section 2).
GEMM_RULE_ID = "hopper-bf16-k16-trunc25-v1"
# n_split is a function of V only: the merge always runs over ceil(V_real / 64) tiles.
N_SPLIT_POLICY = "ceil(V_real/64) global tiles; CTA split of tiles is free"
# Fractional bits kept when aligning the 17 terms of one k16 group (truncation toward zero).
ALIGN_FRAC_BITS = 25
# Significand bits of the FP32 accumulator (truncation toward zero after each k16 group).
ACC_SIGNIFICAND_BITS = 24
# The alignment exponent emax of one k16 group is never below this (a zero accumulator takes no part; 2^-133 is
# the smallest bf16 subnormal). Measured on the H200 (CONTRACT.md section 2).
ALIGN_EXP_FLOOR = -133
# The NaN the tensor core writes into a logit (binary32 bits). NaN payloads of lse/logp are not part of the contract.
GEMM_NAN_BITS = 0x7FFFFFFF
# Weight fingerprint construction id (a change detector, not a cryptographic commitment).
FINGERPRINT_ID = "rowhash-sum-mod2^64x2-v1"
# The sampling-transform program (temperature -> top-k -> top-p -> min-p), versioned like the contract.
TRANSFORM_PROGRAM_VERSION = "transform-program-v2"

# --- the temperature and the exp2 (CONTRACT.md sections 3 and 6) -------------------------------------------
# Accepted temperatures as binary32: [2^-20, 2^20]. Per row c = div(LOG2E, T); the exp2 argument of a logit z in a
# tile of raw maximum M is mul(sub(z, M), c), always <= 0.
TEMPERATURE_MIN = 2.0 ** -20
TEMPERATURE_MAX = 2.0 ** 20
EXP_LOG2E = 0x3FB8AA3B            # 1.44269502 (binary32 bits): log2(e) rounded
# ex2(x) for x <= 0: k = floor(-x), j = floor(|x + k| * 2^23), ex2(x) = EX2_TABLE[j] * 2^-k, +0 below 2^-126;
# a subnormal x is 0 (ex2 = 1), ex2(-inf) = +0, NaN stays NaN. EX2_TABLE[j] = ex2(-j * 2^-23) as measured on SM90
# (tools/ex2_table.py), shipped compressed beside this module; the sha256 is of the 2^23 + 1 little-endian uint32s.
EX2_ID = "sm90-ex2.approx.ftz.f32-v1"
EX2_TABLE_FILE = "ex2_sm90.bin.xz"
EX2_TABLE_ENTRIES = (1 << 23) + 1
EX2_TABLE_FRAC_BITS = 23
EX2_TABLE_SHA256 = "e1751ad2a8f73e05cc12f8f29cc7a984aa6f879435613d4cb3d04ce2b84d58cc"
EX2_FLUSH_BELOW = 2.0 ** -126     # results below are +0 (ftz)

# --- the contract's log (x > 0) ---------------------------------------------------------------------------
# x = 2^e * m with m in [sqrt(1/2), sqrt(2)); f = m - 1 (exact); log x = e*LN2_HI + (f + (f*f*q(f) + e*LN2_LO))
LOG_SQRT_HALF_BITS = 0x3F3504F3   # the mantissa split point sqrt(1/2)
LOG_LN2_HI = 0x3F317200          # 0.693145752 (16 significant bits)
LOG_LN2_LO = 0x35BFBE8E          # 1.42860677e-06 (LN2 - LN2_HI rounded)
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
    "TEMPERATURE_MIN": TEMPERATURE_MIN,
    "TEMPERATURE_MAX": TEMPERATURE_MAX,
    "EXP_LOG2E": EXP_LOG2E,
    "EX2_ID": EX2_ID,
    "EX2_TABLE_SHA256": EX2_TABLE_SHA256,
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
