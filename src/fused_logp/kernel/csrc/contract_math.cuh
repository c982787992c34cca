// Contract v1 exp and log on the GPU: binary32 add/sub/mul (round to nearest, never contracted into FMA)
// and exact bit manipulation only. Mirrors kernel/transcendentals.py operation for operation.
#pragma once
#include <cstdint>

namespace contract {

// Bit patterns from shared_contract/constants.py (checked by tests/test_sm90_compile.py).
constexpr uint32_t EXP_LOG2E = 0x3FB8AA3Bu;
constexpr uint32_t EXP_SHIFTER = 0x4B400000u;
constexpr uint32_t EXP_LN2_HI = 0x3F317200u;
constexpr uint32_t EXP_LN2_LO = 0x35BFBE8Eu;
constexpr uint32_t EXP_POLY_C2 = 0x3F000000u;
constexpr uint32_t EXP_POLY_C3 = 0x3E2AAAABu;
constexpr uint32_t EXP_POLY_C4 = 0x3D2AAAABu;
constexpr uint32_t EXP_POLY_C5 = 0x3C088889u;
constexpr uint32_t EXP_POLY_C6 = 0x3AB60B61u;
constexpr uint32_t EXP_POLY_C7 = 0x39500D01u;
constexpr uint32_t EXP_X_MAX = 0x42B17217u;
constexpr uint32_t EXP_X_MIN = 0xC2CFF1B5u;
constexpr uint32_t LOG_SQRT_HALF_BITS = 0x3F3504F3u;
constexpr uint32_t LOG_LN2_HI = 0x3F317200u;
constexpr uint32_t LOG_LN2_LO = 0x35BFBE8Eu;
constexpr uint32_t LOG_POLY_0 = 0xBF000000u;
constexpr uint32_t LOG_POLY_1 = 0x3EAAAAA3u;
constexpr uint32_t LOG_POLY_2 = 0xBE80001Bu;
constexpr uint32_t LOG_POLY_3 = 0x3E4CD2A0u;
constexpr uint32_t LOG_POLY_4 = 0xBE2AA805u;
constexpr uint32_t LOG_POLY_5 = 0x3E119335u;
constexpr uint32_t LOG_POLY_6 = 0xBDFEAEC9u;
constexpr uint32_t LOG_POLY_7 = 0x3DF47039u;
constexpr uint32_t LOG_POLY_8 = 0xBDEC58E2u;
constexpr uint32_t LOG_POLY_9 = 0x3D851DBDu;
// Mantissa split of the log: m > sqrt(2) (bits 0x3FB504F3 = sqrt(1/2) bits + 2^23) is halved.
constexpr uint32_t LOG_SQRT2_BITS = LOG_SQRT_HALF_BITS + 0x00800000u;
constexpr int VOCAB_TILE = 64;
constexpr int K_GROUP = 16;

__device__ __forceinline__ float bits(uint32_t b) { return __int_as_float(static_cast<int>(b)); }

// 2^n for integer n in [-126, 127], exact.
__device__ __forceinline__ float pow2i(int n) { return __int_as_float((n + 127) << 23); }

// The steps every exp variant shares, on an already clamped argument xc: t = xc * LOG2E + SHIFTER, k = t - SHIFTER
// (round(xc * LOG2E) as a float), the two-part reduction r = xc - k LN2_HI - k LN2_LO and the degree-7 polynomial
// p ~ exp(r). The variants differ only in the clamp before and the 2^k scaling after.
struct ExpReduced {
  float t, k, p;
};
//
// xc - k LN2_HI is one fused multiply-add with the contract's bits: on the clamped domain k is an integer in
// [-150, 128] (8 bits) and LN2_HI has 15 significant bits, so the product k LN2_HI is exact in binary32 and the
// contract's xc - RN(k LN2_HI) rounds the same exact difference once (tests/test_sm90_compile.py checks the product
// for every such k). The contract's other multiplies and adds stay separately rounded.
__device__ __forceinline__ ExpReduced exp_reduce(float xc) {
  const float t = __fadd_rn(__fmul_rn(xc, bits(EXP_LOG2E)), bits(EXP_SHIFTER));
  const float k = __fsub_rn(t, bits(EXP_SHIFTER));
  const float hi = __fmaf_rn(-k, bits(EXP_LN2_HI), xc);
  const float r = __fsub_rn(hi, __fmul_rn(k, bits(EXP_LN2_LO)));
  float p = __fadd_rn(bits(EXP_POLY_C6), __fmul_rn(r, bits(EXP_POLY_C7)));
  p = __fadd_rn(bits(EXP_POLY_C5), __fmul_rn(r, p));
  p = __fadd_rn(bits(EXP_POLY_C4), __fmul_rn(r, p));
  p = __fadd_rn(bits(EXP_POLY_C3), __fmul_rn(r, p));
  p = __fadd_rn(bits(EXP_POLY_C2), __fmul_rn(r, p));
  p = __fadd_rn(1.0f, __fmul_rn(r, p));
  p = __fadd_rn(1.0f, __fmul_rn(r, p));
  return {t, k, p};
}

// p * 2^n for n = k, as two multiplies by powers of two (n split in halves so that each is a normal float).
__device__ __forceinline__ float exp_scale(const ExpReduced& e) {
  const int n = __float2int_rz(e.k);
  const int n1 = n >> 1;  // floor(n/2)
  const int n2 = n - n1;
  return __fmul_rn(__fmul_rn(e.p, pow2i(n1)), pow2i(n2));
}

// exp(x): exp(0) = 1 exactly, exp(-inf) = 0, exp(NaN) = NaN.
__device__ __forceinline__ float contract_exp(float x) {
  const float xmax = bits(EXP_X_MAX), xmin = bits(EXP_X_MIN);
  float y = exp_scale(exp_reduce(fminf(fmaxf(x, xmin), xmax)));
  y = (x > xmax) ? __int_as_float(0x7F800000) : y;
  y = (x < xmin) ? 0.0f : y;
  y = (x != x) ? x : y;
  return y;
}

// contract_exp for finite x <= 0 only (the tile sum's z' - m_t): the same operations and bits, without the
// selects that cannot fire there (x > EXP_X_MAX, NaN) and with the clamp reduced to its lower end.
__device__ __forceinline__ float contract_exp_nonpos(float x) {
  const float xmin = bits(EXP_X_MIN);
  const float y = exp_scale(exp_reduce(fmaxf(x, xmin)));
  return (x < xmin) ? 0.0f : y;
}

// contract_exp for -87 <= x <= 0 only: the same operations and bits with the final scaling as one multiply.
// There the clamp and the select cannot fire, t = x * LOG2E + SHIFTER holds n = round(x * LOG2E) in [-126, 0] as
// bits(t) - bits(SHIFTER), so 2^n is the normal float with bits (n + 127) << 23 = (bits(t) << 23) + (127 << 23)
// (bits(SHIFTER) << 23 wraps to 0), and p * 2^n rounds the same exact product once, as p * 2^n1 * 2^n2 does (the
// first factor exact, the second rounding once). The tile epilogue takes it only when every lane of the warp
// qualifies (FAST_EXP_MIN below), else contract_exp_nonpos.
constexpr float FAST_EXP_MIN = -87.0f;   // -87 * LOG2E = -125.5..: n >= -126
__device__ __forceinline__ float contract_exp_fast(float x) {
  const ExpReduced e = exp_reduce(x);
  const uint32_t scale = (static_cast<uint32_t>(__float_as_int(e.t)) << 23) + 0x3F800000u;
  return __fmul_rn(e.p, __int_as_float(static_cast<int>(scale)));
}

// log(x): log(1) = 0 exactly, log(0) = -inf, log(+inf) = +inf, log(x < 0) = log(NaN) = NaN.
__device__ __forceinline__ float contract_log(float x) {
  const bool sub = (x > 0.0f) && (x < __int_as_float(0x00800000));
  float xs = sub ? __fmul_rn(x, 8388608.0f) : x;
  uint32_t b = static_cast<uint32_t>(__float_as_int(xs));
  int e = static_cast<int>((b >> 23) & 0xFFu) - 127 - (sub ? 23 : 0);
  uint32_t mb = (b & 0x7FFFFFu) | 0x3F800000u;
  const bool big = mb > LOG_SQRT2_BITS;
  mb = big ? mb - 0x00800000u : mb;
  e += big ? 1 : 0;
  float f = __fsub_rn(__int_as_float(static_cast<int>(mb)), 1.0f);
  float q = bits(LOG_POLY_9);
  q = __fadd_rn(bits(LOG_POLY_8), __fmul_rn(f, q));
  q = __fadd_rn(bits(LOG_POLY_7), __fmul_rn(f, q));
  q = __fadd_rn(bits(LOG_POLY_6), __fmul_rn(f, q));
  q = __fadd_rn(bits(LOG_POLY_5), __fmul_rn(f, q));
  q = __fadd_rn(bits(LOG_POLY_4), __fmul_rn(f, q));
  q = __fadd_rn(bits(LOG_POLY_3), __fmul_rn(f, q));
  q = __fadd_rn(bits(LOG_POLY_2), __fmul_rn(f, q));
  q = __fadd_rn(bits(LOG_POLY_1), __fmul_rn(f, q));
  q = __fadd_rn(bits(LOG_POLY_0), __fmul_rn(f, q));
  float ef = static_cast<float>(e);
  float t = __fmul_rn(__fmul_rn(f, f), q);
  float y = __fadd_rn(__fmul_rn(ef, bits(LOG_LN2_HI)),
                      __fadd_rn(f, __fadd_rn(t, __fmul_rn(ef, bits(LOG_LN2_LO)))));
  y = (x == 0.0f) ? __int_as_float(0xFF800000) : y;
  y = (x == __int_as_float(0x7F800000)) ? x : y;
  y = (x < 0.0f || x != x) ? __int_as_float(0x7FFFFFFF) : y;
  return y;
}

// NaN-propagating max (fmaxf drops NaN).
__device__ __forceinline__ float nan_max(float a, float b) {
  return (a != a) ? a : ((b != b) ? b : fmaxf(a, b));
}

// NaN-propagating min against 0: the logp clamp.
__device__ __forceinline__ float clamp_nonpos(float d) { return (d != d) ? d : fminf(d, 0.0f); }

}  // namespace contract
