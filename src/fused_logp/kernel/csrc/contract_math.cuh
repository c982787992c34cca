// The contract's exp2 and log on the GPU. exp2 is SM90's ex2.approx.ftz.f32, whose exact model (a table and an
// exact scale, CONTRACT.md section 6) the CPU oracles reproduce; the log is binary32 add/sub/mul (round to
// nearest, never contracted into FMA) and exact bit manipulation only, as kernel/transcendentals.py.
#pragma once
#include <cstdint>

#include "contract_constants.h"

namespace contract {

// Bit patterns from shared_contract/constants.py, through the generated contract_constants.h.
constexpr uint32_t EXP_LOG2E = FL_EXP_LOG2E;
constexpr uint32_t LOG_LN2_HI = FL_LOG_LN2_HI;
constexpr uint32_t LOG_LN2_LO = FL_LOG_LN2_LO;
constexpr uint32_t LOG_POLY_0 = FL_LOG_Q0;
constexpr uint32_t LOG_POLY_1 = FL_LOG_Q1;
constexpr uint32_t LOG_POLY_2 = FL_LOG_Q2;
constexpr uint32_t LOG_POLY_3 = FL_LOG_Q3;
constexpr uint32_t LOG_POLY_4 = FL_LOG_Q4;
constexpr uint32_t LOG_POLY_5 = FL_LOG_Q5;
constexpr uint32_t LOG_POLY_6 = FL_LOG_Q6;
constexpr uint32_t LOG_POLY_7 = FL_LOG_Q7;
constexpr uint32_t LOG_POLY_8 = FL_LOG_Q8;
constexpr uint32_t LOG_POLY_9 = FL_LOG_Q9;
// Mantissa split of the log: m > sqrt(2) is halved.
constexpr uint32_t LOG_SQRT2_BITS = FL_LOG_SQRT2_BITS;
constexpr int VOCAB_TILE = FL_VOCAB_TILE;
constexpr int K_GROUP = FL_K_GROUP;

__device__ __forceinline__ float bits(uint32_t b) { return __int_as_float(static_cast<int>(b)); }

// The contract's exp2 for x <= 0: the hardware instruction itself (the model is what the CPU reproduces; the SM90
// backend checks this device against the table at first use, ex2_selftest).
__device__ __forceinline__ float contract_ex2(float x) {
#ifdef FUSED_LOGP_SIMT   // the device code run on the CPU (tests/sm90/simt): the instruction's exact model
  return simt::ex2_model(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
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
