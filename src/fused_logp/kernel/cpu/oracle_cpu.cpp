// The contract on the CPU, compiled: the Hopper k16 GEMM rule in integer arithmetic and the contract's
// statistics in binary32, with exactly the bytes of kernel/oracle.py (the numpy reference).
//
// Every contract constant comes from ../csrc/contract_constants.h, generated from shared_contract/constants.py
// (kernel/contract_header.py) and shared with the CUDA build; contract_constants() returns them so the loader can
// check what was compiled in.
//
// Build flags that matter for the bytes: -ffp-contract=off (no fused multiply-add anywhere) and no fast-math:
// every float expression below is one IEEE binary32 operation rounded to nearest even, vectorised or not.
// The integer GEMM is exact whatever the instruction set; the AVX-512 path and the portable scalar path
// compute the same function (tests compare them).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "../csrc/contract_constants.h"

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__) && defined(__BMI2__)
#define FL_HAVE_AVX512 1
#include <immintrin.h>
#else
#define FL_HAVE_AVX512 0
#endif

#if !defined(FL_VOCAB_TILE) || !defined(FL_K_GROUP) || !defined(FL_ALIGN_FRAC_BITS) || !defined(FL_ACC_BITS) || \
    !defined(FL_ALIGN_EXP_FLOOR) || !defined(FL_GEMM_NAN_BITS)
#error "contract constants come from ../csrc/contract_constants.h"
#endif
static_assert(FL_VOCAB_TILE == 64, "the tile tree below is written for 64-lane tiles");
static_assert(FL_K_GROUP == 16, "the GEMM kernel is written for k16 groups");
static_assert(FL_ALIGN_FRAC_BITS == 25, "the aligned-term bounds below assume 25 fractional bits");
static_assert(FL_ACC_BITS == 24, "the accumulator is a binary32 significand");

namespace {

constexpr int TILE = FL_VOCAB_TILE;
constexpr int KG = FL_K_GROUP;
constexpr int FRAC = FL_ALIGN_FRAC_BITS;
constexpr int EXP_FLOOR = FL_ALIGN_EXP_FLOOR;      // emax of a group is never below this; c = 0 brings no term
constexpr uint32_t GEMM_NAN = uint32_t(FL_GEMM_NAN_BITS);
// The exponent the decoded inputs give a zero: a product with a zero factor is no term and never sets emax
// (its sum with any bf16 exponent stays far below EXP_FLOOR; its aligned value is 0 whatever the shift).
constexpr int ZERO_EXP = -1000;
static_assert(FL_ALIGN_EXP_FLOOR >= -133 && FL_ALIGN_EXP_FLOOR <= -126, "the alignment floor lies in the bf16 range");
// A product of two 8-bit bf16 significands has 14 fractional bits; aligned to 25 fractional bits it is
// shifted left by 11 before the right shift by (emax - e). A binary32 significand has 23: shifted left by 2.
constexpr int PROD_PRESHIFT = FRAC - 14;
constexpr int ACC_PRESHIFT = FRAC - 23;

inline float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// ---------------------------------------------------------------------------------------------------------
// The contract's exp and log (CONTRACT.md section 6), one binary32 operation per step.
// ---------------------------------------------------------------------------------------------------------

const float LOG2E = u2f(FL_EXP_LOG2E);
const float LOG_LN2_HI = u2f(FL_LOG_LN2_HI), LOG_LN2_LO = u2f(FL_LOG_LN2_LO);
const float LQ[10] = {u2f(FL_LOG_Q0), u2f(FL_LOG_Q1), u2f(FL_LOG_Q2), u2f(FL_LOG_Q3), u2f(FL_LOG_Q4),
                      u2f(FL_LOG_Q5), u2f(FL_LOG_Q6), u2f(FL_LOG_Q7), u2f(FL_LOG_Q8), u2f(FL_LOG_Q9)};
const float F_INF = std::numeric_limits<float>::infinity();
const float F_NAN = u2f(0x7FC00000u);

// The exp2 table T[j] = ex2.approx.ftz.f32(-j * 2^-23), j = 0 .. 2^23 (shared_contract/ex2_table.py), set once by
// the loader (set_ex2_table) before any statistic is computed.
constexpr int64_t EX2_ENTRIES = (int64_t(1) << FL_EX2_FRAC_BITS) + 1;
torch::Tensor g_ex2_holder;
const uint32_t* g_ex2 = nullptr;

void set_ex2_table(torch::Tensor bits) {
  TORCH_CHECK(bits.device().is_cpu() && bits.scalar_type() == torch::kInt32 && bits.dim() == 1 &&
                  bits.numel() == EX2_ENTRIES && bits.is_contiguous(),
              "the exp2 table must be a contiguous CPU int32 tensor of ", EX2_ENTRIES, " bit patterns");
  g_ex2_holder = bits.clone();
  g_ex2 = reinterpret_cast<const uint32_t*>(g_ex2_holder.data_ptr<int32_t>());
}

// 2^-k times a table entry (an entry is in [1/2, 1]: exponent field 126 or 127) by exponent arithmetic: exact where
// the result is normal, +0 (flush) where it would be below 2^-126.
inline float ex2_scaled(uint32_t entry, int k) {
  const int field = int(entry >> 23);
  return field > k ? u2f(entry - (uint32_t(k) << 23)) : 0.0f;
}

// ex2(x) for x <= 0 (CONTRACT.md section 6): k = floor(-x), j = floor(|x + k| * 2^23), T[j] * 2^-k, +0 below 2^-126.
// A subnormal x, +-0 and positive x below 2^-23 give T[0] = 1; -inf gives +0; NaN stays NaN. The contract never
// forms a larger positive argument.
inline float contract_ex2(float x) {
  if (x != x) return x;
  const float a = x > 0.0f ? 0.0f : -x;
  if (!(a < 160.0f)) return 0.0f;                       // every entry times 2^-160 flushes (and -inf)
  const float k = std::floor(a);
  const float frac = a - k;                             // exact: a multiple of ulp(a), below 1
  const int j = int(frac * 8388608.0f);                 // exact scaling; truncation toward zero
  return ex2_scaled(g_ex2[j], int(k));
}

inline float contract_log(float x) {
  if (x != x || x < 0.0f) return F_NAN;
  if (x == 0.0f) return -F_INF;
  if (x == F_INF) return F_INF;
  bool sub = x < u2f(0x00800000u);
  float xs = sub ? x * 8388608.0f : x;                  // subnormals: exact scaling by 2^23
  uint32_t bits = f2u(xs);
  int e = int((bits >> 23) & 0xFF) - 127 - (sub ? 23 : 0);
  uint32_t mbits = (bits & 0x7FFFFFu) | 0x3F800000u;
  if (mbits > FL_LOG_SQRT2_BITS) { mbits -= 0x00800000u; e += 1; }
  float f = u2f(mbits) - 1.0f;                         // exact
  float q = LQ[9];
  for (int i = 8; i >= 0; --i) q = LQ[i] + f * q;
  float ef = static_cast<float>(e);
  float t = (f * f) * q;
  return ef * LOG_LN2_HI + (f + (t + ef * LOG_LN2_LO));
}

// ---------------------------------------------------------------------------------------------------------
// The GEMM rule (CONTRACT.md section 2), scalar: one k16 group updates the binary32 accumulator c.
// This function is the whole rule, edges included; the vector kernel below defers to it for every lane
// whose old or new accumulator is outside the normal binary32 range and for every input pair with a
// non-finite value.
// ---------------------------------------------------------------------------------------------------------

inline bool bf16_nonfinite(uint16_t b) { return ((b >> 7) & 0xFF) == 0xFF; }

uint32_t group_update(uint32_t c, const uint16_t* a, const uint16_t* b) {
  // Non-finite operands or accumulator: IEEE semantics (inf * 0 = NaN, inf - inf = NaN).
  uint32_t cfield = (c >> 23) & 0xFF;
  bool any_nonfinite = cfield == 0xFF;
  for (int k = 0; k < KG && !any_nonfinite; ++k) any_nonfinite = bf16_nonfinite(a[k]) || bf16_nonfinite(b[k]);
  if (any_nonfinite) {
    bool nan = false, pos = false, neg = false;
    if (cfield == 0xFF) {
      if (c & 0x7FFFFFu) nan = true; else (c >> 31 ? neg : pos) = true;
    }
    for (int k = 0; k < KG; ++k) {
      uint16_t x = a[k], y = b[k];
      bool xn = bf16_nonfinite(x) && (x & 0x7F), yn = bf16_nonfinite(y) && (y & 0x7F);
      bool xi = bf16_nonfinite(x) && !(x & 0x7F), yi = bf16_nonfinite(y) && !(y & 0x7F);
      bool xz = (x & 0x7FFF) == 0, yz = (y & 0x7FFF) == 0;
      if (xn || yn || (xi && yz) || (yi && xz)) nan = true;
      else if (xi || yi) (((x ^ y) >> 15) ? neg : pos) = true;
    }
    if (nan || (pos && neg)) return GEMM_NAN;
    return pos ? 0x7F800000u : 0xFF800000u;
  }
  int e[KG];
  const bool c_zero = (c & 0x7FFFFFFFu) == 0;                      // c = 0 brings no term and no exponent
  int emax = EXP_FLOOR;
  if (!c_zero && int(cfield ? cfield : 1) - 127 > emax) emax = int(cfield ? cfield : 1) - 127;
  for (int k = 0; k < KG; ++k) {
    int fa = (a[k] >> 7) & 0xFF, fb = (b[k] >> 7) & 0xFF;
    bool zero = (a[k] & 0x7FFF) == 0 || (b[k] & 0x7FFF) == 0;       // a product with a zero factor: no term
    e[k] = (fa ? fa : 1) + (fb ? fb : 1) - 254;
    if (!zero && e[k] > emax) emax = e[k];
  }
  int64_t total = 0;
  for (int k = 0; k < KG; ++k) {
    int fa = (a[k] >> 7) & 0xFF, fb = (b[k] >> 7) & 0xFF;
    int64_t ma = (a[k] & 0x7F) | (fa ? 0x80 : 0), mb = (b[k] & 0x7F) | (fb ? 0x80 : 0);
    int sh = emax - e[k];
    int64_t t = sh >= 40 ? 0 : ((ma * mb) << PROD_PRESHIFT) >> sh;    // truncation toward zero
    total += ((a[k] ^ b[k]) & 0x8000) ? -t : t;
  }
  {
    int64_t mc = (c & 0x7FFFFFu) | (cfield ? 0x800000u : 0u);
    int sh = emax - (int(cfield ? cfield : 1) - 127);
    int64_t t = sh >= 40 ? 0 : (mc << ACC_PRESHIFT) >> sh;
    total += (c >> 31) ? -t : t;
  }
  if (total == 0) return 0u;                                        // +0
  uint32_t sign = total < 0 ? 0x80000000u : 0u;
  uint64_t mag = uint64_t(total < 0 ? -total : total);
  int exp = emax - FRAC;                                            // value = mag * 2^exp
  int nb = 64 - __builtin_clzll(mag);
  if (nb > 24) { mag >>= (nb - 24); exp += nb - 24; }               // truncate to a 24-bit significand
  else { mag <<= (24 - nb); exp -= 24 - nb; }                       // exact
  // now mag in [2^23, 2^24): value = mag * 2^exp, leading bit at 2^(exp + 23)
  int lead = exp + 23;
  if (lead > 127) return sign | 0x7F800000u;                        // beyond binary32: +-inf
  if (lead >= -126) return sign | (uint32_t(lead + 127) << 23) | uint32_t(mag & 0x7FFFFFu);
  int sh = -149 - exp;                                              // onto the subnormal grid 2^-149
  uint64_t sub = sh >= 64 ? 0 : (mag >> sh);
  return sub ? (sign | uint32_t(sub)) : 0u;                         // truncated to zero: +0
}

uint32_t dot_scalar(const uint16_t* a, const uint16_t* b, int groups) {
  uint32_t c = 0;
  for (int g = 0; g < groups; ++g) c = group_update(c, a + g * KG, b + g * KG);
  return c;
}

// ---------------------------------------------------------------------------------------------------------
// The GEMM, vectorised: 16 output columns per AVX-512 vector ("a panel"), two rows at a time.
//
// A panel's weights are decoded once per call into [group][k][lane] arrays: the weight as a binary32 (a bf16
// is the top half of one) and its biased exponent field f twice, as two int16 halves of an int32. Hidden rows
// are decoded once per call: the value times 2^64 as a binary32, the nominal exponents minus 127 of two rows
// packed as int16 pairs (a zero: ZERO_EXP - 127), and a flag per all-zero group (such a group leaves every
// finite c unchanged, and c = inf or NaN too). A row with |h| >= 2^36, an inf or a NaN goes to the scalar rule
// whole.
//
// One group, 16 columns, two rows:
//   pass 1: emax of both rows at once in int16 lanes: e_k = (e_h - 127) + f_w, then the max. For a normal
//           weight f_w - 127 is its nominal exponent; a zero or subnormal weight gets -127 (its nominal exponent
//           is "none" or -126). With |h| < 2^36 such a product's e_k is <= -92, below EMAX_LO: where it is the
//           max the lane goes to the scalar rule, elsewhere it does not matter (terms are computed from the
//           values). A zero hidden value carries ZERO_EXP, so its products never lead. Then per row the max with
//           c's exponent (group_row_f32);
//   pass 2: each product term is trunc(h * w * 2^(25 - emax)), computed as cvtt((h 2^64 * w) * 2^(-39 - emax))
//           in binary32. Where -90 <= emax <= 60 every step is exact: h 2^64 * w has a 16-bit significand and
//           lies in the normal range unless it is below 2^-126 (then the term is below 2^-32: trunc gives 0
//           either way) or at/above 2^128 (impossible for emax <= 60); the scale is a normal power of two; the
//           scaled value is exact or below 1; cvtt truncates toward zero, sign included. Each term is
//           < 2^27 in magnitude (a product is < 4 * 2^e_k), so the 16 terms sum in int32 without overflow;
//           c's term (< 2^26) is added with an overflow check.
//   normalise: the int32 sum converted to binary32 rounding toward zero IS the truncation to a 24-bit
//           significand; times 2^(emax - 25) (a normal power of two) it is exact and normal (>= 2^-115) or +0.
// A lane is recomputed by group_update (the same rule, scalar) where c is not finite, emax lies outside
// [-90, 60] (subnormal or tiny sums, overflow) or the int32 sum overflowed. Lanes of a column or row with a
// non-finite value are recomputed whole afterwards (their vector values are discarded).
// ---------------------------------------------------------------------------------------------------------

constexpr int EMAX_LO = -90, EMAX_HI = 60;      // the exact range of the vector path (see above)
constexpr int HIDDEN_PRESCALE = 64;             // hidden values are held as h * 2^64
constexpr int HIDDEN_EXP_MAX = 35;              // rows with a larger nominal exponent (|h| >= 2^36) go scalar
const float TWO_64 = 18446744073709551616.0f;

struct HRows {           // decoded hidden rows
  std::vector<float> hf;          // [N][D] h * 2^64
  std::vector<int32_t> ep;        // [ceil(N/2)][D] int16 exponent pairs (row 2p low, row 2p+1 high)
  std::vector<uint8_t> gz;        // [N][G] 1 = the group's hidden values are all zero
  std::vector<uint8_t> scalar;    // [N] 1 = the row goes to the scalar rule whole (|h| >= 2^36, inf, NaN)
};

inline int bf16_nominal_exp(uint16_t b) {
  int f = (b >> 7) & 0xFF;
  return (b & 0x7FFF) ? (f ? f : 1) - 127 : ZERO_EXP;
}

void decode_rows(const uint16_t* H, int64_t n, int d, HRows& r) {
  const int groups = d / KG;
  const int64_t pairs = (n + 1) / 2;
  r.hf.resize(size_t(n) * d);
  r.ep.resize(size_t(pairs) * d);
  r.gz.assign(size_t(n) * groups, 1);
  r.scalar.assign(size_t(n), 0);
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t* h = H + i * d;
    for (int j = 0; j < d; ++j) {
      uint16_t b = h[j];
      int f = (b >> 7) & 0xFF;
      if (f > 127 + HIDDEN_EXP_MAX) r.scalar[i] = 1;            // |h| >= 2^36, inf or NaN
      r.hf[size_t(i) * d + j] = u2f(uint32_t(b) << 16) * TWO_64;
      if (b & 0x7FFF) r.gz[size_t(i) * groups + j / KG] = 0;
    }
    if (r.scalar[i]) std::fill(r.gz.begin() + i * groups, r.gz.begin() + (i + 1) * groups, 1);   // recomputed whole
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* a = H + (2 * p) * d;
    const uint16_t* b = H + std::min<int64_t>(2 * p + 1, n - 1) * d;
    for (int j = 0; j < d; ++j)
      r.ep[size_t(p) * d + j] = int32_t((uint32_t(bf16_nominal_exp(a[j]) - 127) & 0xFFFFu) |
                                        (uint32_t(bf16_nominal_exp(b[j]) - 127) << 16));
  }
}

// Panel of 16 columns: [G][16 k][16 lanes] of the weight's binary32 bits and of its exponent field pair.
struct Panel {
  std::vector<int32_t> wf, we;
  void resize(int groups) { wf.resize(size_t(groups) * KG * 16); we.resize(wf.size()); }
};

inline int32_t exp_pair(int e) { return int32_t((uint32_t(e) & 0xFFFFu) | (uint32_t(e) << 16)); }

void decode_panel_scalar(const uint16_t* w, int d, int64_t v0, int lanes, int g0, int g1, Panel& p) {
  for (int g = g0; g < g1; ++g) {
    for (int l = 0; l < 16; ++l) {
      const uint16_t* row = w + (v0 + (l < lanes ? l : lanes - 1)) * int64_t(d) + g * KG;
      for (int k = 0; k < KG; ++k) {
        size_t o = (size_t(g - g0) * KG + k) * 16 + l;
        p.wf[o] = int32_t(uint32_t(row[k]) << 16);
        p.we[o] = exp_pair((row[k] >> 7) & 0xFF);
      }
    }
  }
}

#if FL_HAVE_AVX512
// Index vectors of the 16 x 16 int32 transpose: at block size b (8, 4, 2, 1) rows i and i + b (bit b of i
// clear) exchange their off-diagonal b-column blocks; after the four sizes the matrix is transposed.
struct TransposeIdx {
  __m512i lo[4], hi[4];
  TransposeIdx() {
    for (int s = 0; s < 4; ++s) {
      int b = 8 >> s;
      alignas(64) int32_t a[16], c[16];
      for (int x = 0; x < 16; ++x) {
        bool first = (x % (2 * b)) < b;
        a[x] = first ? x : 16 + (x - b);          // row i: keep its first block, take row j's first block
        c[x] = first ? x + b : 16 + x;            // row j: take row i's second block, keep its second block
      }
      lo[s] = _mm512_load_si512(a);
      hi[s] = _mm512_load_si512(c);
    }
  }
};

// Decodes groups [g0, g1) of a panel into p (indexed from g0); returns the lanes with an inf or NaN there.
// Two groups at a time: each lane's 32 bf16 are 16 dwords of adjacent k pairs (k even low, k odd high); one
// 16 x 16 dword transpose gives, per k pair, the 16 lanes' pairs, which are split into the two k's.
__mmask16 decode_panel_avx512(const uint16_t* w, int d, int64_t v0, int lanes, int g0, int g1, Panel& p) {
  static const TransposeIdx T;
  __mmask16 nonfinite = 0;
  const __m512i ff2 = _mm512_set1_epi32(0x00FF00FF), hi16 = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  // within each dword: the low word in both halves / the high word in both halves
  const __m512i dup_lo = _mm512_set4_epi32(0x0D0C0D0C, 0x09080908, 0x05040504, 0x01000100);
  const __m512i dup_hi = _mm512_set4_epi32(0x0F0E0F0E, 0x0B0A0B0A, 0x07060706, 0x03020302);
  const uint16_t* rows[16];
  for (int l = 0; l < 16; ++l) rows[l] = w + (v0 + (l < lanes ? l : lanes - 1)) * int64_t(d);
  for (int g = g0; g < g1; g += 2) {
    const bool two = g + 1 < g1;
    const __mmask16 ld = two ? __mmask16(0xFFFF) : __mmask16(0x00FF);
    __m512i r[16];
    for (int l = 0; l < 16; ++l)                   // lane l's k pairs of groups g, g + 1: r[l][j]
      r[l] = _mm512_maskz_loadu_epi32(ld, rows[l] + g * KG);
    for (int s = 0; s < 4; ++s) {
      int b = 8 >> s;
      for (int i = 0; i < 16; ++i) {
        if (i & b) continue;
        __m512i x = r[i], y = r[i + b];
        r[i] = _mm512_permutex2var_epi32(x, T.lo[s], y);
        r[i + b] = _mm512_permutex2var_epi32(x, T.hi[s], y);
      }
    }
    for (int j = 0; j < (two ? 16 : 8); ++j) {      // now r[j][lane]: k = 2 (j % 8) and 2 (j % 8) + 1 of g + j / 8
      const int k = 2 * (j & 7);
      int32_t* WF = p.wf.data() + (size_t(g + (j >> 3) - g0) * KG + k) * 16;
      int32_t* WE = p.we.data() + (size_t(g + (j >> 3) - g0) * KG + k) * 16;
      const __m512i x = r[j];
      const __m512i f2 = _mm512_and_si512(_mm512_srli_epi16(x, 7), ff2);   // both exponent fields
      const __mmask32 inf_nan = _mm512_cmpeq_epi16_mask(f2, _mm512_set1_epi16(0xFF));
      nonfinite |= __mmask16(_pext_u32(uint32_t(inf_nan) | (uint32_t(inf_nan) >> 1), 0x55555555u));
      _mm512_storeu_si512(WF, _mm512_slli_epi32(x, 16));                     // k even: the weight's binary32
      _mm512_storeu_si512(WF + 16, _mm512_and_si512(x, hi16));               // k odd
      _mm512_storeu_si512(WE, _mm512_shuffle_epi8(f2, dup_lo));
      _mm512_storeu_si512(WE + 16, _mm512_shuffle_epi8(f2, dup_hi));
    }
  }
  return nonfinite;
}

// One row's update of one group: 16 lanes, emax given (its pass-1 value, before c and the floor).
inline __m512i group_row_f32(__m512i acc, __m512i e_prod, const float* hf, const int32_t* WF,
                             const uint16_t* hbits, const uint16_t* w, int d, int64_t v0, int lanes, int g) {
  // emax, as far as the vector path needs it: the max of the products' exponents from pass 1 (exact for nonzero
  // products of normal weights; <= -92 for a zero or subnormal weight, <= ZERO_EXP + 128 for a zero hidden value)
  // and c's exponent field - 127. That is c's nominal exponent for a normal c, -127 for c = 0
  // or a subnormal c, 128 for an infinite or NaN c. Where this value lies in [EMAX_LO, EMAX_HI] it comes from a
  // nonzero product or a normal c, and it is the rule's emax (the floor, -133, and a subnormal c's -126 lie below
  // it); everywhere else the lane goes to the scalar rule (u = emax - EMAX_LO outside [0, EMAX_HI - EMAX_LO],
  // as an unsigned compare).
  const __m512i cf = _mm512_and_si512(_mm512_srli_epi32(acc, 23), _mm512_set1_epi32(0xFF));
  const __m512i emax = _mm512_max_epi32(e_prod, _mm512_sub_epi32(cf, _mm512_set1_epi32(127)));
  const __m512i u = _mm512_sub_epi32(emax, _mm512_set1_epi32(EMAX_LO));
  __mmask16 bad = _mm512_cmpgt_epu32_mask(u, _mm512_set1_epi32(EMAX_HI - EMAX_LO));
  // 2^(-39 - emax) = 2^(25 - emax) / 2^64: exponent field 88 - emax (normal for emax in [EMAX_LO, EMAX_HI])
  const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(88 - EMAX_LO), u), 23));
  __m512i sk[4];
  for (int k = 0; k < KG; ++k) {
    __m512 pk = _mm512_mul_ps(_mm512_set1_ps(hf[k]), _mm512_castsi512_ps(_mm512_loadu_si512(WF + k * 16)));
    __m512i tk = _mm512_cvttps_epi32(_mm512_mul_ps(pk, scale));
    sk[k & 3] = k < 4 ? tk : _mm512_add_epi32(sk[k & 3], tk);       // four chains of four terms
  }
  const __m512i s0 = _mm512_add_epi32(sk[0], sk[1]), s1 = _mm512_add_epi32(sk[2], sk[3]);
  // c's term: trunc(c * 2^(25 - emax)) = cvtt((c * 2^64) * 2^(-39 - emax)); |c| < 2^61 where emax <= 60
  const __m512i tc = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_mul_ps(_mm512_castsi512_ps(acc), _mm512_set1_ps(TWO_64)),
                                                       scale));
  const __m512i sum = _mm512_add_epi32(s0, s1);
  const __m512i total = _mm512_add_epi32(sum, tc);
  // signed overflow of sum + tc: both operands' signs differ from the result's
  bad |= _mm512_movepi32_mask(_mm512_ternarylogic_epi32(sum, tc, total, 0x42 /* (~a & ~b & c) | (a & b & ~c) */));
  const __m512 t24 = _mm512_cvt_roundepi32_ps(total, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  // 2^(emax - 25): exponent field emax + 102 = 190 - (88 - emax), from the scale's bits with one subtraction
  const __m512 up = _mm512_castsi512_ps(_mm512_sub_epi32(_mm512_set1_epi32(190 << 23), _mm512_castps_si512(scale)));
  __m512i newacc = _mm512_castps_si512(_mm512_mul_ps(t24, up));
  if (__builtin_expect(bad != 0, 0)) {
    alignas(64) uint32_t old_c[16], new_c[16];
    _mm512_store_si512(old_c, acc);
    _mm512_store_si512(new_c, newacc);
    for (int l = 0; l < 16; ++l) {
      if (!((bad >> l) & 1)) continue;
      int64_t col = v0 + (l < lanes ? l : lanes - 1);
      new_c[l] = group_update(old_c[l], hbits + g * KG, w + col * int64_t(d) + g * KG);
    }
    newacc = _mm512_load_si512(new_c);
  }
  return newacc;
}

// NP row pairs (pairs q0 .. q0 + NP - 1; the second row of the last pair may repeat the first), groups [g0, g1)
// of a panel decoded from group pg0; acc: the rows' 16 accumulators each ([row][16]). Several pairs per group
// give the out-of-order core independent accumulator chains to overlap.
template <int NP>
inline void row_pairs_groups_avx512(const HRows& hr, int64_t n, int64_t q0, const Panel& p, int g0, int g1, int pg0,
                                    uint32_t* acc, const uint16_t* H, const uint16_t* w, int d, int64_t v0,
                                    int lanes) {
  const int groups = d / KG;
  int64_t row[2 * NP];
  __m512i c[2 * NP];
  for (int i = 0; i < 2 * NP; ++i) {
    row[i] = std::min<int64_t>(2 * q0 + i, n - 1);
    c[i] = _mm512_loadu_si512(acc + row[i] * 16);
  }
  for (int g = g0; g < g1; ++g) {
    const int32_t* WF = &p.wf[size_t(g - pg0) * KG * 16];
    const int32_t* WE = &p.we[size_t(g - pg0) * KG * 16];
    __m512i e[2 * NP];
    for (int j = 0; j < NP; ++j) {               // pass 1 of pair j: int16 lanes (first row low, second high)
      const int32_t* epg = hr.ep.data() + size_t(q0 + j) * d + g * KG;
      __m512i x = _mm512_add_epi16(_mm512_set1_epi32(epg[0]), _mm512_loadu_si512(WE));
      for (int k = 1; k < KG; ++k)
        x = _mm512_max_epi16(x, _mm512_add_epi16(_mm512_set1_epi32(epg[k]), _mm512_loadu_si512(WE + k * 16)));
      e[2 * j] = _mm512_srai_epi32(_mm512_slli_epi32(x, 16), 16);
      e[2 * j + 1] = _mm512_srai_epi32(x, 16);
    }
    for (int i = 0; i < 2 * NP; ++i) {
      if (hr.gz[size_t(row[i]) * groups + g] || (i > 0 && row[i] == row[i - 1])) continue;   // c unchanged
      c[i] = group_row_f32(c[i], e[i], hr.hf.data() + size_t(row[i]) * d + g * KG, WF, H + row[i] * d, w, d, v0,
                           lanes, g);
    }
  }
  for (int i = 0; i < 2 * NP; ++i)
    if (i == 0 || row[i] != row[i - 1]) _mm512_storeu_si512(acc + row[i] * 16, c[i]);
}
#endif

// Tests: the AVX-512 panel decode against the scalar one over every panel of a weight; the count that differ.
int64_t panel_decode_mismatches(torch::Tensor weight) {
  int64_t bad = 0;
#if FL_HAVE_AVX512
  TORCH_CHECK(weight.scalar_type() == torch::kBFloat16 && weight.dim() == 2, "weight must be bf16 [V, D]");
  weight = weight.contiguous();
  const int d = int(weight.size(1));
  const int64_t v = weight.size(0);
  const uint16_t* W = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  Panel a, b;
  a.resize(d / KG);
  b.resize(d / KG);
  for (int64_t v0 = 0; v0 < v; v0 += 16) {
    int lanes = int(std::min<int64_t>(16, v - v0));
    decode_panel_avx512(W, d, v0, lanes, 0, d / KG, a);
    decode_panel_scalar(W, d, v0, lanes, 0, d / KG, b);
    bad += (a.wf != b.wf) + (a.we != b.we);
  }
#endif
  return bad;
}

torch::Tensor check_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16, name, " must be bfloat16");
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D");
  return t.contiguous();
}

inline void tile_one(const float* zr, float tr, int real, float* m_out, float* s_out);

// Tile statistics of rows [0, n) and tiles [t0, t1) of logits Z [n, ncols] (section 4), into M, S [n, nt].
void tiles_of(const float* Z, int64_t n, int64_t ncols, const float* T, int64_t t0, int64_t t1, float* M, float* S) {
  const int64_t nt = (ncols + TILE - 1) / TILE;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t t = t0; t < t1; ++t)
      tile_one(Z + r * ncols + t * TILE, T[r], int(std::min<int64_t>(TILE, ncols - t * TILE)), M + r * nt + t,
               S + r * nt + t);
}

// z[n, v] for v < ncols: hidden [N, D] bf16, weight [>= ncols, D] bf16 -> [N, ncols] fp32 (the bits of c).
// With temperature T [N] (else nullptr), also the tile statistics of z (section 4) into M, S [N, ceil(ncols/64)]:
// computed by the thread that computed the tile's logits, right after them (whole tiles per work chunk), or
// afterwards where the scalar rule replaced logits.
torch::Tensor hopper_logits_impl(torch::Tensor hidden, torch::Tensor weight, int64_t ncols, bool force_scalar,
                                 const float* T, float* M, float* S) {
  hidden = check_bf16(hidden, "hidden");
  weight = check_bf16(weight, "weight");
  const int64_t n = hidden.size(0);
  const int d = int(hidden.size(1));
  TORCH_CHECK(d % KG == 0 && d > 0, "D must be a positive multiple of 16");
  TORCH_CHECK(weight.size(1) == d, "weight must have D columns");
  TORCH_CHECK(ncols >= 0 && ncols <= weight.size(0), "ncols must be in [0, weight rows]");
  auto out = torch::empty({n, ncols}, torch::dtype(torch::kFloat32));
  if (n == 0 || ncols == 0) return out;
  const uint16_t* H = reinterpret_cast<const uint16_t*>(hidden.data_ptr());
  const uint16_t* W = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  uint32_t* Z = reinterpret_cast<uint32_t*>(out.data_ptr<float>());
  const int groups = d / KG;

  const int64_t nt = (ncols + TILE - 1) / TILE;
  auto stats_after = [&]() {
    if (T != nullptr)
      at::parallel_for(0, nt, std::max<int64_t>(1, 256 / n), [&](int64_t b, int64_t e) {
        tiles_of(reinterpret_cast<const float*>(Z), n, ncols, T, b, e, M, S);
      });
  };
  bool vector_path = FL_HAVE_AVX512 && !force_scalar;
  if (!vector_path) {
    at::parallel_for(0, n * ncols, 64, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        int64_t r = i / ncols, c = i % ncols;
        Z[i] = dot_scalar(H + r * d, W + c * int64_t(d), groups);
      }
    });
    stats_after();
    return out;
  }
#if FL_HAVE_AVX512
  // decoded hidden rows
  HRows hr;
  decode_rows(H, n, d, hr);
  const int64_t pairs = (n + 1) / 2;
  const int64_t panels = (ncols + 15) / 16;
  // Groups decoded and then applied to every row before the next ones: the decoded slice stays in L1
  // (2 arrays * 16 * 16 * 4 B = 2 KiB a group).
  const int GC = 8;
  std::vector<uint8_t> wbad(ncols, 0);
  // Work chunks of whole tiles (4 panels) and ~2^18 multiply-adds, taken by the threads from a shared counter
  // (a thread that starts late takes fewer). A call below 2^18 multiply-adds runs on one thread instead of
  // paying a fork and a barrier for work shorter than they are.
  const int64_t panel_macs = std::max<int64_t>(1, n * 16 * int64_t(d));
  const int64_t chunk = 4 * std::max<int64_t>(1, (int64_t(1) << 18) / (4 * panel_macs));
  const int64_t nchunks = (panels + chunk - 1) / chunk;
  const int64_t workers = n * int64_t(ncols) * d < (int64_t(1) << 18) ? 1 : std::min<int64_t>(at::get_num_threads(), nchunks);
  std::atomic<int64_t> next{0};
  const bool stats_inside = T != nullptr && !std::any_of(hr.scalar.begin(), hr.scalar.end(), [](uint8_t x) { return x; });
  std::atomic<bool> any_bad_column{false};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Panel p;
    p.resize(GC);
    std::vector<uint32_t> acc(size_t(n) * 16);
    for (int64_t ch = next.fetch_add(1); ch < nchunks; ch = next.fetch_add(1)) {
    const int64_t pb = ch * chunk, pe = std::min(panels, pb + chunk);
    for (int64_t pi = pb; pi < pe; ++pi) {
      int64_t v0 = pi * 16;
      int lanes = int(std::min<int64_t>(16, ncols - v0));
      std::fill(acc.begin(), acc.end(), 0u);
      unsigned bad_lanes = 0;
      for (int g0 = 0; g0 < groups; g0 += GC) {
        int g1 = std::min(groups, g0 + GC);
        bad_lanes |= decode_panel_avx512(W, d, v0, lanes, g0, g1, p);
        int64_t q = 0;
        for (; q + 2 <= pairs; q += 2) row_pairs_groups_avx512<2>(hr, n, q, p, g0, g1, g0, acc.data(), H, W, d, v0, lanes);
        if (q < pairs) row_pairs_groups_avx512<1>(hr, n, q, p, g0, g1, g0, acc.data(), H, W, d, v0, lanes);
      }
      for (int64_t r = 0; r < n; ++r)
        std::memcpy(Z + r * ncols + v0, &acc[r * 16], size_t(lanes) * 4);
      for (int l = 0; l < lanes; ++l) wbad[v0 + l] = (bad_lanes >> l) & 1;
      if (bad_lanes) any_bad_column = true;
    }
    if (stats_inside) tiles_of(reinterpret_cast<const float*>(Z), n, ncols, T, pb / 4, (pe + 3) / 4, M, S);
    }
  });
  // rows with a value the vector path does not hold (|h| >= 2^64, inf, NaN) and columns with a non-finite value:
  // the scalar rule (IEEE where an operand or c is not finite)
  std::vector<int64_t> brows, bcols;
  for (int64_t r = 0; r < n; ++r) if (hr.scalar[r]) brows.push_back(r);
  for (int64_t c = 0; c < ncols; ++c) if (wbad[c]) bcols.push_back(c);
  if (!brows.empty()) {
    at::parallel_for(0, int64_t(brows.size()) * ncols, 64, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        int64_t r = brows[i / ncols], c = i % ncols;
        Z[r * ncols + c] = dot_scalar(H + r * d, W + c * int64_t(d), groups);
      }
    });
  }
  if (!bcols.empty()) {
    at::parallel_for(0, n * int64_t(bcols.size()), 64, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        int64_t r = i / int64_t(bcols.size()), c = bcols[i % int64_t(bcols.size())];
        Z[r * ncols + c] = dot_scalar(H + r * d, W + c * int64_t(d), groups);
      }
    });
  }
  if (T != nullptr && (!stats_inside || any_bad_column)) stats_after();
#endif
  return out;
}

torch::Tensor hopper_logits(torch::Tensor hidden, torch::Tensor weight, int64_t ncols, bool force_scalar) {
  return hopper_logits_impl(hidden, weight, ncols, force_scalar, nullptr, nullptr, nullptr);
}

// ---------------------------------------------------------------------------------------------------------
// Tile statistics (section 4) and the row merge (section 5)
// ---------------------------------------------------------------------------------------------------------

// One tile: real lanes zr[0..real) of unscaled logits, temperature tr -> (m_t, s_t) (section 4): M = max z (NaN if a
// real z is not finite), s_t = the tree over ex2((z - M) * c) with c = LOG2E / tr, m_t = M / tr. Scalar, the
// definition.
inline void tile_one_scalar(const float* zr, float tr, int real, float* m_out, float* s_out) {
  float lanes[TILE];
  bool nonfinite = false;
  float m = -F_INF;
  for (int j = 0; j < real; ++j) {
    const float x = zr[j];
    nonfinite |= !std::isfinite(x);
    m = x > m ? x : m;
  }
  if (nonfinite) {
    *m_out = F_NAN;
    *s_out = F_NAN;
    return;
  }
  const float c = LOG2E / tr;
  for (int j = 0; j < real; ++j) lanes[j] = contract_ex2((zr[j] - m) * c);
  for (int j = real; j < TILE; ++j) lanes[j] = 0.0f;
  for (int w = TILE / 2; w >= 1; w /= 2)                       // adjacent-pairwise tree, six levels
    for (int j = 0; j < w; ++j) lanes[j] = lanes[2 * j] + lanes[2 * j + 1];
  *m_out = m / tr;
  *s_out = lanes[0];
}

#if FL_HAVE_AVX512
// contract_ex2 on 16 lanes of arguments <= 0 (or NaN): the same steps as the scalar function.
inline __m512 contract_ex2_16(__m512 x) {
  const __m512 a = _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), _mm512_setzero_ps());   // -x (x <= 0)
  const __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(160.0f), _CMP_LT_OQ);             // false: NaN, big
  const __m512 ac = _mm512_maskz_mov_ps(small, a);
  const __m512 k = _mm512_roundscale_ps(ac, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512i j = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_sub_ps(ac, k), _mm512_set1_ps(8388608.0f)));
  const __m512i e = _mm512_i32gather_epi32(j, reinterpret_cast<const int*>(g_ex2), 4);
  const __m512i ki = _mm512_cvttps_epi32(k);
  const __mmask16 normal = _mm512_cmpgt_epi32_mask(_mm512_srli_epi32(e, 23), ki);
  __m512 y = _mm512_castsi512_ps(_mm512_maskz_sub_epi32(normal & small, e, _mm512_slli_epi32(ki, 23)));
  return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);           // NaN -> x
}

// One tile, 16 lanes at a time; the same operations as tile_one_scalar (the max is order-free, the tree is the
// same adjacent pairs in the same operand order).
inline void tile_one_avx512(const float* zr, float tr, int real, float* m_out, float* s_out) {
  __m512 v[4];
  __mmask16 mks[4];
  __m512 mx = _mm512_set1_ps(-F_INF);
  __mmask16 nonfinite = 0;
  for (int q = 0; q < 4; ++q) {
    int left = real - 16 * q;
    __mmask16 mk = left >= 16 ? __mmask16(0xFFFF) : (left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1));
    mks[q] = mk;
    __m512 x = _mm512_maskz_loadu_ps(mk, zr + 16 * q);
    v[q] = x;
    // not finite: the exponent field all ones
    nonfinite |= mk & _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7F800000)),
                                              _mm512_set1_epi32(0x7F800000));
    mx = _mm512_mask_max_ps(mx, mk, mx, x);
  }
  if (nonfinite) {
    *m_out = F_NAN;
    *s_out = F_NAN;
    return;
  }
  const float m = _mm512_reduce_max_ps(mx);
  if (m == 0.0f) {            // +0 and -0 tie: the scalar loop keeps the first one met; so does this
    tile_one_scalar(zr, tr, real, m_out, s_out);
    return;
  }
  const __m512 mv = _mm512_set1_ps(m);
  const __m512 cv = _mm512_set1_ps(LOG2E / tr);
  for (int q = 0; q < 4; ++q)
    v[q] = _mm512_maskz_mov_ps(mks[q], contract_ex2_16(_mm512_mul_ps(_mm512_sub_ps(v[q], mv), cv)));
  alignas(64) static const int32_t ev[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  alignas(64) static const int32_t od[16] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  const __m512i ie = _mm512_load_si512(ev), io = _mm512_load_si512(od);
  auto level = [&](__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_permutex2var_ps(a, ie, b), _mm512_permutex2var_ps(a, io, b));
  };
  __m512 w0 = level(v[0], v[1]), w1 = level(v[2], v[3]);        // 32 values
  __m512 x = level(w0, w1);                                      // 16
  x = level(x, x);                                               // 8 (twice)
  x = level(x, x);                                               // 4
  x = level(x, x);                                               // 2
  x = level(x, x);                                               // 1
  *m_out = m / tr;
  *s_out = _mm512_cvtss_f32(x);
}
#endif

inline void tile_one(const float* zr, float tr, int real, float* m_out, float* s_out) {
#if FL_HAVE_AVX512
  tile_one_avx512(zr, tr, real, m_out, s_out);
#else
  tile_one_scalar(zr, tr, real, m_out, s_out);
#endif
}

// z [N, >= n_real] fp32 unscaled (row stride arbitrary), temperature [N] fp32 -> (tile_max, tile_sum) [N, nt].
std::vector<torch::Tensor> tile_stats(torch::Tensor z, torch::Tensor temperature, int64_t n_real) {
  TORCH_CHECK(z.device().is_cpu() && z.scalar_type() == torch::kFloat32 && z.dim() == 2, "z must be CPU fp32 [N, V]");
  TORCH_CHECK(z.stride(1) == 1, "z rows must be contiguous");
  temperature = temperature.contiguous();
  TORCH_CHECK(temperature.scalar_type() == torch::kFloat32 && temperature.numel() == z.size(0),
              "temperature must be fp32 [N]");
  TORCH_CHECK(n_real >= 0 && n_real <= z.size(1), "n_real must be in [0, V]");
  const int64_t n = z.size(0), ld = z.stride(0);
  const int64_t nt = (n_real + TILE - 1) / TILE;
  auto tmax = torch::empty({n, nt}, torch::dtype(torch::kFloat32));
  auto tsum = torch::empty({n, nt}, torch::dtype(torch::kFloat32));
  const float* Z = z.data_ptr<float>();
  const float* T = temperature.data_ptr<float>();
  float* M = tmax.data_ptr<float>();
  float* S = tsum.data_ptr<float>();
  at::parallel_for(0, n * nt, 256, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      int64_t r = i / nt, t = i % nt;
      tile_one(Z + r * ld + t * TILE, T[r], int(std::min<int64_t>(TILE, n_real - t * TILE)), M + i, S + i);
    }
  });
  return {tmax, tsum};
}

// Tests: the vector tile statistics against the scalar definition; the number of tiles whose bytes differ.
int64_t tile_stats_mismatches(torch::Tensor z, torch::Tensor temperature, int64_t n_real) {
  int64_t bad = 0;
#if FL_HAVE_AVX512
  z = z.contiguous();
  temperature = temperature.contiguous();
  const int64_t n = z.size(0), ld = z.size(1), nt = (n_real + TILE - 1) / TILE;
  const float* Z = z.data_ptr<float>();
  const float* T = temperature.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t t = 0; t < nt; ++t) {
      float m1, s1, m2, s2;
      int real = int(std::min<int64_t>(TILE, n_real - t * TILE));
      tile_one_scalar(Z + r * ld + t * TILE, T[r], real, &m1, &s1);
      tile_one_avx512(Z + r * ld + t * TILE, T[r], real, &m2, &s2);
      bool same_m = (m1 != m1 && m2 != m2) || f2u(m1) == f2u(m2);
      bool same_s = (s1 != s1 && s2 != s2) || f2u(s1) == f2u(s2);
      bad += !(same_m && same_s);
    }
#endif
  return bad;
}

// Row merge: tile_max, tile_sum [N, T]; target_logit [N] or [N, C] -> (logp like target_logit, lse [N]).
std::vector<torch::Tensor> merge(torch::Tensor tile_max, torch::Tensor tile_sum, torch::Tensor target_logit) {
  tile_max = tile_max.contiguous();
  tile_sum = tile_sum.contiguous();
  target_logit = target_logit.contiguous();
  TORCH_CHECK(tile_max.scalar_type() == torch::kFloat32 && tile_sum.scalar_type() == torch::kFloat32 &&
              target_logit.scalar_type() == torch::kFloat32, "merge takes fp32 tensors");
  TORCH_CHECK(tile_max.dim() == 2 && tile_max.sizes() == tile_sum.sizes(), "tile_max/tile_sum must be [N, T]");
  const int64_t n = tile_max.size(0), nt = tile_max.size(1);
  TORCH_CHECK(nt >= 1, "the merge needs at least one tile");
  TORCH_CHECK(target_logit.size(0) == n && target_logit.dim() <= 2, "target_logit must be [N] or [N, C]");
  const int64_t cols = target_logit.dim() == 2 ? target_logit.size(1) : 1;
  auto lse = torch::empty({n}, torch::dtype(torch::kFloat32));
  auto logp = torch::empty_like(target_logit);
  const float* M = tile_max.data_ptr<float>();
  const float* S = tile_sum.data_ptr<float>();
  const float* Zt = target_logit.data_ptr<float>();
  float* L = lse.data_ptr<float>();
  float* P = logp.data_ptr<float>();
  at::parallel_for(0, n, std::max<int64_t>(1, 32768 / nt), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* m_r = M + r * nt;
      const float* s_r = S + r * nt;
      float m = m_r[0];
      for (int64_t t = 1; t < nt; ++t) {
        float x = m_r[t];
        if (m != m) break;
        if (x != x || x > m) m = x;
      }
      float s = s_r[0] * contract_ex2((m_r[0] - m) * LOG2E);
      for (int64_t t = 1; t < nt; ++t) s = s + s_r[t] * contract_ex2((m_r[t] - m) * LOG2E);
      float l = m + contract_log(s);
      L[r] = l;
      for (int64_t c = 0; c < cols; ++c) {
        float dlt = Zt[r * cols + c] - l;
        P[r * cols + c] = (dlt != dlt) ? dlt : (dlt < 0.0f ? dlt : 0.0f);
      }
    }
  });
  return {logp, lse};
}

// The targets' scaled logits: z'_target = div(z[r, t], T[r]) where 0 <= t < n_real, else -inf (not owned).
// z [N, >= n_real] fp32 (rows contiguous), temperature [N] fp32, targets [N] or [N, C] int64 relative to column 0
// -> (target_logit, owned), both shaped like targets.
std::vector<torch::Tensor> targets_of(const torch::Tensor& z, const torch::Tensor& temperature, int64_t n_real,
                                      torch::Tensor targets) {
  targets = targets.contiguous();
  TORCH_CHECK(targets.scalar_type() == torch::kInt64 && targets.dim() >= 1 && targets.dim() <= 2 &&
              targets.size(0) == z.size(0), "targets must be int64 [N] or [N, C]");
  const int64_t n = z.size(0), ld = z.stride(0), cols = targets.dim() == 2 ? targets.size(1) : 1;
  auto tl = torch::empty(targets.sizes(), torch::dtype(torch::kFloat32));
  auto owned = torch::empty(targets.sizes(), torch::dtype(torch::kBool));
  const float* Z = z.data_ptr<float>();
  const float* T = temperature.data_ptr<float>();
  const int64_t* G = targets.data_ptr<int64_t>();
  float* L = tl.data_ptr<float>();
  bool* O = owned.data_ptr<bool>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      int64_t t = G[r * cols + c];
      bool own = t >= 0 && t < n_real;
      O[r * cols + c] = own;
      L[r * cols + c] = own ? Z[r * ld + t] / T[r] : -F_INF;
    }
  return {tl, owned};
}

// Tile statistics and target logits of logits z [N, >= n_real] (rows contiguous) -> (tile_max, tile_sum,
// target_logit, owned).
std::vector<torch::Tensor> stats_targets(torch::Tensor z, torch::Tensor temperature, int64_t n_real,
                                         torch::Tensor targets) {
  temperature = temperature.contiguous();
  auto st = tile_stats(z, temperature, n_real);
  auto to = targets_of(z, temperature, n_real, targets);
  return {st[0], st[1], to[0], to[1]};
}

// The logits of a shard and their statistics in one pass: hidden [N, D] bf16, weight [>= n_real, D] bf16,
// temperature [N] fp32, targets [N] or [N, C] int64 relative to the shard's column 0 -> (logits [N, n_real],
// tile_max, tile_sum [N, ceil(n_real / 64)], target_logit, owned). The same functions as hopper_logits followed
// by stats_targets.
std::vector<torch::Tensor> shard_stats_fused(torch::Tensor hidden, torch::Tensor weight, int64_t n_real,
                                             torch::Tensor temperature, torch::Tensor targets, bool force_scalar) {
  temperature = temperature.contiguous();
  TORCH_CHECK(temperature.scalar_type() == torch::kFloat32 && temperature.numel() == hidden.size(0),
              "temperature must be fp32 [N]");
  const int64_t n = hidden.size(0), nt = (n_real + TILE - 1) / TILE;
  auto tmax = torch::empty({n, nt}, torch::dtype(torch::kFloat32));
  auto tsum = torch::empty({n, nt}, torch::dtype(torch::kFloat32));
  auto z = hopper_logits_impl(hidden, weight, n_real, force_scalar, temperature.data_ptr<float>(),
                              tmax.data_ptr<float>(), tsum.data_ptr<float>());
  auto to = targets_of(z, temperature, n_real, targets);
  return {z, tmax, tsum, to[0], to[1]};
}

// linear_logp in one call (no bias, logits not returned): hidden [N, D] bf16, weight [>= n_real, D] bf16,
// temperature [N] fp32, targets [N] int64 relative to column 0 -> (logp [N], lse [N]): shard_stats_fused, then
// merge.
std::vector<torch::Tensor> linear_logp_fused(torch::Tensor hidden, torch::Tensor weight, int64_t n_real,
                                             torch::Tensor temperature, torch::Tensor targets, bool force_scalar) {
  TORCH_CHECK(n_real >= 1, "n_real must be >= 1");
  TORCH_CHECK(targets.dim() == 1, "targets must be [N]");
  auto st = shard_stats_fused(hidden, weight, n_real, temperature, targets, force_scalar);
  return merge(st[1], st[2], st[3]);
}

torch::Tensor map_f32(torch::Tensor x, bool is_log) {
  x = x.contiguous();
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "fp32 input");
  auto y = torch::empty_like(x);
  const float* X = x.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, x.numel(), 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) Y[i] = is_log ? contract_log(X[i]) : contract_ex2(X[i]);
  });
  return y;
}

std::vector<int64_t> contract_constants() { return {FL_CONTRACT_CONSTANTS_LIST}; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("hopper_logits", &hopper_logits, "z = hidden @ weight[:ncols].T under the Hopper k16 rule");
  m.def("tile_stats", &tile_stats, "tile max / T and adjacent-pairwise sum of ex2((z - max) * LOG2E / T) per 64-column tile");
  m.def("merge", &merge, "row merge over tiles in ascending order; logp = min(z'_target - lse, 0)");
  m.def("linear_logp_fused", &linear_logp_fused, "hopper_logits, tile_stats, target logit and merge in one call");
  m.def("tile_stats_mismatches", &tile_stats_mismatches);
  m.def("shard_stats_fused", &shard_stats_fused, "logits, tile statistics and the targets' scaled logits");
  m.def("stats_targets", &stats_targets, "tile statistics and the targets' scaled logits (-inf where not owned)");
  m.def("contract_ex2", [](torch::Tensor x) { return map_f32(x, false); });
  m.def("set_ex2_table", &set_ex2_table, "the exp2 table's 2^23 + 1 bit patterns (int32), once before use");
  m.def("contract_log", [](torch::Tensor x) { return map_f32(x, true); });
  m.def("contract_constants", &contract_constants);
  m.def("panel_decode_mismatches", &panel_decode_mismatches);
  m.def("vector_isa", []() { return std::string(FL_HAVE_AVX512 ? "avx512" : "scalar"); });
}
