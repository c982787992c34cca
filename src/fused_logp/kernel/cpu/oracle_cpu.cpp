// Contract v1 on the CPU, compiled: the Hopper k16 GEMM rule in integer arithmetic and the contract's
// statistics in binary32, with exactly the bytes of kernel/oracle.py (the numpy reference).
//
// Every contract constant arrives as a -D definition generated from shared_contract/constants.py by
// kernel/oracle_fast.py; contract_constants() returns them so the loader can check what was compiled in.
//
// Build flags that matter for the bytes: -ffp-contract=off (no fused multiply-add anywhere) and no fast-math:
// every float expression below is one IEEE binary32 operation rounded to nearest even, vectorised or not.
// The integer GEMM is exact whatever the instruction set; the AVX-512 path and the portable scalar path
// compute the same function (tests compare them).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512VPOPCNTDQ__)
#define FL_HAVE_AVX512 1
#include <immintrin.h>
#else
#define FL_HAVE_AVX512 0
#endif

#if !defined(FL_VOCAB_TILE) || !defined(FL_K_GROUP) || !defined(FL_ALIGN_FRAC_BITS) || !defined(FL_ACC_BITS) || \
    !defined(FL_ALIGN_EXP_FLOOR) || !defined(FL_GEMM_NAN_BITS)
#error "contract constants must be given with -D (kernel/oracle_fast.py does)"
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

const float LOG2E = u2f(FL_EXP_LOG2E), SHIFTER = u2f(FL_EXP_SHIFTER);
const float LN2_HI = u2f(FL_EXP_LN2_HI), LN2_LO = u2f(FL_EXP_LN2_LO);
const float EC2 = u2f(FL_EXP_C2), EC3 = u2f(FL_EXP_C3), EC4 = u2f(FL_EXP_C4), EC5 = u2f(FL_EXP_C5),
            EC6 = u2f(FL_EXP_C6), EC7 = u2f(FL_EXP_C7);
const float EXP_X_MAX = u2f(FL_EXP_X_MAX), EXP_X_MIN = u2f(FL_EXP_X_MIN);
const float LOG_LN2_HI = u2f(FL_LOG_LN2_HI), LOG_LN2_LO = u2f(FL_LOG_LN2_LO);
const float LQ[10] = {u2f(FL_LOG_Q0), u2f(FL_LOG_Q1), u2f(FL_LOG_Q2), u2f(FL_LOG_Q3), u2f(FL_LOG_Q4),
                      u2f(FL_LOG_Q5), u2f(FL_LOG_Q6), u2f(FL_LOG_Q7), u2f(FL_LOG_Q8), u2f(FL_LOG_Q9)};
const float F_INF = std::numeric_limits<float>::infinity();
const float F_NAN = u2f(0x7FC00000u);

inline float pow2i(int n) { return u2f(uint32_t(n + 127) << 23); }   // n in [-126, 127]: exact

inline float contract_exp(float x) {
  if (x != x) return x;
  if (x > EXP_X_MAX) return F_INF;
  if (x < EXP_X_MIN) return 0.0f;
  float k = (x * LOG2E + SHIFTER) - SHIFTER;          // round-to-nearest-even(x * log2e)
  float r = (x - k * LN2_HI) - k * LN2_LO;
  float p = EC6 + r * EC7;
  p = EC5 + r * p;
  p = EC4 + r * p;
  p = EC3 + r * p;
  p = EC2 + r * p;
  p = 1.0f + r * p;
  p = 1.0f + r * p;
  int n = static_cast<int>(k);
  int n1 = n >> 1;                                     // floor(n / 2)
  int n2 = n - n1;
  return (p * pow2i(n1)) * pow2i(n2);
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
// The GEMM, vectorised: 16 output columns per AVX-512 vector ("a panel"), one row at a time.
//
// A panel's weights are decoded once per call into [group][k][lane] arrays (significand << 11, nominal
// exponent, sign as 0/-1, and a 16-bit sign mask per group and lane) and reused by every row. For one row,
// group and 16 columns: pass 1 takes the largest nominal exponent, pass 2 adds the aligned, truncated
// products as (t XOR s): the one's complement of a negative term, corrected by adding the number of negative
// products (a popcount of the two sign masks). The 16 aligned products fit int32 (< 16 * 2^27); the
// accumulator's term is added in int64 and the sum goes through float64 (exact below 2^53) to a 24-bit
// truncation and the scale 2^(emax - 25). A lane whose old accumulator is not finite, or whose new value is
// not zero and not a normal binary32, is recomputed by group_update (the same rule, scalar).
// ---------------------------------------------------------------------------------------------------------

struct HRow {            // one decoded hidden row
  std::vector<int32_t> mag, exp, sgn;   // [D]: significand (8 bits), nominal exponent, sign 0/-1
  std::vector<int32_t> mask;            // [G]: bit k = sign of element g*16+k
};

void decode_row(const uint16_t* h, int d, int32_t* mag, int32_t* exp, int32_t* sgn, int32_t* mask) {
  for (int g = 0; g < d / KG; ++g) mask[g] = 0;
  for (int i = 0; i < d; ++i) {
    uint16_t b = h[i];
    int f = (b >> 7) & 0xFF;
    mag[i] = (b & 0x7F) | (f ? 0x80 : 0);
    exp[i] = (b & 0x7FFF) ? (f ? f : 1) - 127 : ZERO_EXP;
    sgn[i] = (b & 0x8000) ? -1 : 0;
    if (b & 0x8000) mask[i / KG] |= 1 << (i % KG);
  }
}

// Panel of 16 columns: arrays of [G][16 k][16 lanes] int32, and [G][16 lanes] masks.
struct Panel {
  std::vector<int32_t> mw, ew, sw, wm;
  void resize(int groups) {
    mw.resize(size_t(groups) * KG * 16); ew.resize(mw.size()); sw.resize(mw.size()); wm.resize(size_t(groups) * 16);
  }
};

void decode_panel_scalar(const uint16_t* w, int d, int64_t v0, int lanes, int g0, int g1, Panel& p) {
  for (int g = g0; g < g1; ++g) {
    for (int l = 0; l < 16; ++l) {
      const uint16_t* row = w + (v0 + (l < lanes ? l : lanes - 1)) * int64_t(d) + g * KG;
      int m = 0;
      for (int k = 0; k < KG; ++k) {
        uint16_t b = row[k];
        int f = (b >> 7) & 0xFF;
        size_t o = (size_t(g - g0) * KG + k) * 16 + l;
        p.mw[o] = ((b & 0x7F) | (f ? 0x80 : 0)) << PROD_PRESHIFT;
        p.ew[o] = (b & 0x7FFF) ? (f ? f : 1) - 127 : ZERO_EXP;
        p.sw[o] = (b & 0x8000) ? -1 : 0;
        if (b & 0x8000) m |= 1 << k;
      }
      p.wm[size_t(g - g0) * 16 + l] = m;
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
__mmask16 decode_panel_avx512(const uint16_t* w, int d, int64_t v0, int lanes, int g0, int g1, Panel& p) {
  static const TransposeIdx T;
  __mmask16 nonfinite = 0;
  const __m512i x7fff = _mm512_set1_epi32(0x7FFF), zexp = _mm512_set1_epi32(ZERO_EXP);
  const __m512i ff = _mm512_set1_epi32(0xFF), one = _mm512_set1_epi32(1), b127 = _mm512_set1_epi32(127);
  const __m512i f7 = _mm512_set1_epi32(0x7F), h80 = _mm512_set1_epi32(0x80), zero = _mm512_setzero_si512();
  const uint16_t* rows[16];
  for (int l = 0; l < 16; ++l) rows[l] = w + (v0 + (l < lanes ? l : lanes - 1)) * int64_t(d);
  for (int g = g0; g < g1; ++g) {
    __m512i r[16];
    int32_t* WM = p.wm.data() + size_t(g - g0) * 16;
    for (int l = 0; l < 16; ++l) {                 // lane l's 16 bf16 of this group, sign-extended: r[l][k]
      r[l] = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[l] + g * KG)));
      WM[l] = int32_t(_mm512_movepi32_mask(r[l]));  // the lane's 16 signs: bit k
    }
    for (int s = 0; s < 4; ++s) {
      int b = 8 >> s;
      for (int i = 0; i < 16; ++i) {
        if (i & b) continue;
        __m512i x = r[i], y = r[i + b];
        r[i] = _mm512_permutex2var_epi32(x, T.lo[s], y);
        r[i + b] = _mm512_permutex2var_epi32(x, T.hi[s], y);
      }
    }
    int32_t* MW = p.mw.data() + size_t(g - g0) * KG * 16;     // now r[k][lane]
    int32_t* EW = p.ew.data() + size_t(g - g0) * KG * 16;
    int32_t* SW = p.sw.data() + size_t(g - g0) * KG * 16;
    for (int k = 0; k < KG; ++k) {
      __m512i b = r[k];
      __m512i f = _mm512_and_si512(_mm512_srli_epi32(b, 7), ff);
      __m512i low = _mm512_and_si512(b, f7);
      __m512i mag = _mm512_mask_or_epi32(low, _mm512_cmpneq_epi32_mask(f, zero), low, h80);
      __m512i e = _mm512_sub_epi32(_mm512_max_epi32(f, one), b127);
      e = _mm512_mask_mov_epi32(e, _mm512_testn_epi32_mask(b, x7fff), zexp);
      nonfinite |= _mm512_cmpeq_epi32_mask(f, ff);
      _mm512_storeu_si512(MW + k * 16, _mm512_slli_epi32(mag, PROD_PRESHIFT));
      _mm512_storeu_si512(EW + k * 16, e);
      _mm512_storeu_si512(SW + k * 16, _mm512_srai_epi32(b, 31));
    }
  }
  return nonfinite;
}

// One row, groups [g0, g1), 16 lanes; acc holds the 16 accumulators' bits in and out.
inline void row_groups_avx512(const int32_t* hm, const int32_t* he, const int32_t* hs, const int32_t* hmask,
                              const Panel& p, int g0, int g1, int pg0, uint32_t* acc_io,
                              const uint16_t* hbits, const uint16_t* w, int d, int64_t v0, int lanes) {
  const __m512i zero = _mm512_setzero_si512(), one = _mm512_set1_epi32(1), ff = _mm512_set1_epi32(0xFF);
  const __m512i b127 = _mm512_set1_epi32(127), man = _mm512_set1_epi32(0x7FFFFF), hid = _mm512_set1_epi32(0x800000);
  const __m512i trunc29 = _mm512_set1_epi64(~int64_t((1 << 29) - 1));
  const __m512d lo_norm = _mm512_set1_pd(0x1p-126), hi_norm = _mm512_set1_pd(0x1p128);
  const __m512i absmask = _mm512_set1_epi64(0x7FFFFFFFFFFFFFFFLL);
  const __m512i floorv = _mm512_set1_epi32(EXP_FLOOR);
  __m512i acc = _mm512_loadu_si512(acc_io);
  for (int g = g0; g < g1; ++g) {
    const int32_t* MW = &p.mw[size_t(g - pg0) * KG * 16];
    const int32_t* EW = &p.ew[size_t(g - pg0) * KG * 16];
    const int32_t* SW = &p.sw[size_t(g - pg0) * KG * 16];
    const int32_t* hmg = hm + g * KG;
    const int32_t* heg = he + g * KG;
    const int32_t* hsg = hs + g * KG;
    // the accumulator's fields
    __m512i sc = _mm512_srai_epi32(acc, 31);
    __m512i cf = _mm512_and_si512(_mm512_srli_epi32(acc, 23), ff);
    __mmask16 cbad = _mm512_cmpeq_epi32_mask(cf, ff);
    __m512i mc = _mm512_mask_or_epi32(_mm512_and_si512(acc, man), _mm512_cmpneq_epi32_mask(cf, zero),
                                      _mm512_and_si512(acc, man), hid);
    __m512i ec = _mm512_sub_epi32(_mm512_max_epi32(cf, one), b127);
    // pass 1: emax over the 16 nominal product exponents, c's (c != 0) and the floor
    __mmask16 czero = _mm512_testn_epi32_mask(acc, _mm512_set1_epi32(0x7FFFFFFF));
    __m512i e[KG];
    __m512i emax = _mm512_max_epi32(_mm512_mask_mov_epi32(ec, czero, floorv), floorv);
    for (int k = 0; k < KG; ++k) {
      e[k] = _mm512_add_epi32(_mm512_set1_epi32(heg[k]), _mm512_loadu_si512(EW + k * 16));
      emax = _mm512_max_epi32(emax, e[k]);
    }
    // pass 2: aligned, truncated products in one's complement
    __m512i s0 = zero, s1 = zero;
    for (int k = 0; k < KG; k += 2) {
      __m512i t0 = _mm512_srlv_epi32(_mm512_mullo_epi32(_mm512_set1_epi32(hmg[k]), _mm512_loadu_si512(MW + k * 16)),
                                     _mm512_sub_epi32(emax, e[k]));
      __m512i t1 = _mm512_srlv_epi32(_mm512_mullo_epi32(_mm512_set1_epi32(hmg[k + 1]),
                                                        _mm512_loadu_si512(MW + (k + 1) * 16)),
                                     _mm512_sub_epi32(emax, e[k + 1]));
      s0 = _mm512_add_epi32(s0, _mm512_ternarylogic_epi32(t0, _mm512_loadu_si512(SW + k * 16),
                                                           _mm512_set1_epi32(hsg[k]), 0x96));
      s1 = _mm512_add_epi32(s1, _mm512_ternarylogic_epi32(t1, _mm512_loadu_si512(SW + (k + 1) * 16),
                                                           _mm512_set1_epi32(hsg[k + 1]), 0x96));
    }
    __m512i sum = _mm512_add_epi32(s0, s1);
    __m512i nneg = _mm512_popcnt_epi32(_mm512_xor_si512(_mm512_loadu_si512(&p.wm[size_t(g - pg0) * 16]),
                                                        _mm512_set1_epi32(hmask[g])));
    __m512i tc = _mm512_srlv_epi32(_mm512_slli_epi32(mc, ACC_PRESHIFT), _mm512_sub_epi32(emax, ec));
    __m512i small = _mm512_add_epi32(_mm512_sub_epi32(_mm512_xor_si512(tc, sc), sc), nneg);
    // exact int64 total, to float64, truncated to 24 bits, scaled by 2^(emax - 25)
    __m512i emb = _mm512_add_epi32(emax, _mm512_set1_epi32(1023 - FRAC));
    __m512 res;
    __mmask16 bad;
    {
      __m512i tlo = _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(sum)),
                                     _mm512_cvtepi32_epi64(_mm512_castsi512_si256(small)));
      __m512i thi = _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(sum, 1)),
                                     _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(small, 1)));
      __m512d xlo = _mm512_castsi512_pd(_mm512_and_si512(_mm512_castpd_si512(_mm512_cvtepi64_pd(tlo)), trunc29));
      __m512d xhi = _mm512_castsi512_pd(_mm512_and_si512(_mm512_castpd_si512(_mm512_cvtepi64_pd(thi)), trunc29));
      __m512d slo = _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(emb)), 52));
      __m512d shi = _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(emb, 1)), 52));
      __m512d ylo = _mm512_mul_pd(xlo, slo), yhi = _mm512_mul_pd(xhi, shi);
      __m512d alo = _mm512_castsi512_pd(_mm512_and_si512(_mm512_castpd_si512(ylo), absmask));
      __m512d ahi = _mm512_castsi512_pd(_mm512_and_si512(_mm512_castpd_si512(yhi), absmask));
      __mmask8 oklo = (_mm512_cmp_pd_mask(alo, lo_norm, _CMP_GE_OQ) & _mm512_cmp_pd_mask(alo, hi_norm, _CMP_LT_OQ)) |
                      _mm512_cmp_pd_mask(alo, _mm512_setzero_pd(), _CMP_EQ_OQ);
      __mmask8 okhi = (_mm512_cmp_pd_mask(ahi, lo_norm, _CMP_GE_OQ) & _mm512_cmp_pd_mask(ahi, hi_norm, _CMP_LT_OQ)) |
                      _mm512_cmp_pd_mask(ahi, _mm512_setzero_pd(), _CMP_EQ_OQ);
      bad = __mmask16(~(unsigned(oklo) | (unsigned(okhi) << 8))) | cbad;
      res = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(ylo)), _mm512_cvtpd_ps(yhi), 1);
    }
    __m512i newacc = _mm512_castps_si512(res);
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
    acc = newacc;
  }
  _mm512_storeu_si512(acc_io, acc);
}
#endif

// Rows with a non-finite value and columns with a non-finite value: their pairs are recomputed by
// dot_scalar after the vector pass (the vector kernel reads their fields as if finite).
std::vector<uint8_t> nonfinite_lines(const uint16_t* x, int64_t n, int d) {
  std::vector<uint8_t> bad(n, 0);
  at::parallel_for(0, n, 256, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const uint16_t* r = x + i * int64_t(d);
      uint8_t f = 0;
      for (int j = 0; j < d; ++j) f |= bf16_nonfinite(r[j]);
      bad[i] = f;
    }
  });
  return bad;
}

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
    bad += (a.mw != b.mw) + (a.ew != b.ew) + (a.sw != b.sw) + (a.wm != b.wm);
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

// z[n, v] for v < ncols: hidden [N, D] bf16, weight [>= ncols, D] bf16 -> [N, ncols] fp32 (the bits of c).
torch::Tensor hopper_logits(torch::Tensor hidden, torch::Tensor weight, int64_t ncols, bool force_scalar) {
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

  bool vector_path = FL_HAVE_AVX512 && !force_scalar;
  if (!vector_path) {
    at::parallel_for(0, n * ncols, 64, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        int64_t r = i / ncols, c = i % ncols;
        Z[i] = dot_scalar(H + r * d, W + c * int64_t(d), groups);
      }
    });
    return out;
  }
#if FL_HAVE_AVX512
  // decoded hidden rows
  std::vector<int32_t> hm(size_t(n) * d), he(size_t(n) * d), hs(size_t(n) * d), hmask(size_t(n) * groups);
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      decode_row(H + r * d, d, &hm[r * d], &he[r * d], &hs[r * d], &hmask[r * groups]);
  });
  const int64_t panels = (ncols + 15) / 16;
  // Groups decoded and then applied to every row before the next ones: the decoded slice stays in L1
  // (3 arrays * 16 * 16 * 4 B = 3 KiB a group).
  const int GC = 8;
  std::vector<uint8_t> wbad(ncols, 0);
  // At least ~2M multiply-adds (a few hundred microseconds) per thread's share: a small call (a serving step)
  // runs on one thread instead of paying a fork and a barrier for work shorter than they are.
  const int64_t panel_macs = std::max<int64_t>(1, n * 16 * int64_t(d));
  const int64_t panel_grain = std::max<int64_t>(1, (int64_t(1) << 21) / panel_macs);
  at::parallel_for(0, panels, panel_grain, [&](int64_t pb, int64_t pe) {
    Panel p;
    p.resize(GC);
    std::vector<uint32_t> acc(size_t(n) * 16);
    for (int64_t pi = pb; pi < pe; ++pi) {
      int64_t v0 = pi * 16;
      int lanes = int(std::min<int64_t>(16, ncols - v0));
      std::fill(acc.begin(), acc.end(), 0u);
      unsigned bad_lanes = 0;
      for (int g0 = 0; g0 < groups; g0 += GC) {
        int g1 = std::min(groups, g0 + GC);
        bad_lanes |= decode_panel_avx512(W, d, v0, lanes, g0, g1, p);
        for (int64_t r = 0; r < n; ++r)
          row_groups_avx512(&hm[r * d], &he[r * d], &hs[r * d], &hmask[r * groups], p, g0, g1, g0, &acc[r * 16],
                            H + r * d, W, d, v0, lanes);
      }
      for (int64_t r = 0; r < n; ++r)
        std::memcpy(Z + r * ncols + v0, &acc[r * 16], size_t(lanes) * 4);
      for (int l = 0; l < lanes; ++l) wbad[v0 + l] = (bad_lanes >> l) & 1;
    }
  });
  // pairs with a non-finite input: the scalar rule (IEEE where an operand or c is not finite)
  auto hbad = nonfinite_lines(H, n, d);
  std::vector<int64_t> brows, bcols;
  for (int64_t r = 0; r < n; ++r) if (hbad[r]) brows.push_back(r);
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
#endif
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// Tile statistics (section 4) and the row merge (section 5)
// ---------------------------------------------------------------------------------------------------------

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
  at::parallel_for(0, n * nt, 2048, [&](int64_t b, int64_t e) {
    float lanes[TILE];
    for (int64_t i = b; i < e; ++i) {
      int64_t r = i / nt, t = i % nt;
      const float* zr = Z + r * ld + t * TILE;
      int real = int(std::min<int64_t>(TILE, n_real - t * TILE));
      float tr = T[r];
      bool nonfinite = false;
      float m = -F_INF;
      for (int j = 0; j < real; ++j) {
        float x = zr[j] / tr;
        lanes[j] = x;
        nonfinite |= !std::isfinite(x);
        m = x > m ? x : m;
      }
      if (nonfinite) m = F_NAN;
      for (int j = 0; j < real; ++j) lanes[j] = contract_exp(lanes[j] - m);
      for (int j = real; j < TILE; ++j) lanes[j] = 0.0f;
      for (int w = TILE / 2; w >= 1; w /= 2)                       // adjacent-pairwise tree, six levels
        for (int j = 0; j < w; ++j) lanes[j] = lanes[2 * j] + lanes[2 * j + 1];
      M[i] = m;
      S[i] = lanes[0];
    }
  });
  return {tmax, tsum};
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
      float s = s_r[0] * contract_exp(m_r[0] - m);
      for (int64_t t = 1; t < nt; ++t) s = s + s_r[t] * contract_exp(m_r[t] - m);
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

torch::Tensor map_f32(torch::Tensor x, bool is_log) {
  x = x.contiguous();
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "fp32 input");
  auto y = torch::empty_like(x);
  const float* X = x.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, x.numel(), 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) Y[i] = is_log ? contract_log(X[i]) : contract_exp(X[i]);
  });
  return y;
}

std::vector<int64_t> contract_constants() {
  return {FL_VOCAB_TILE, FL_K_GROUP, FL_ALIGN_FRAC_BITS, FL_ACC_BITS, FL_ALIGN_EXP_FLOOR, FL_GEMM_NAN_BITS, FL_EXP_LOG2E, FL_EXP_SHIFTER, FL_EXP_LN2_HI,
          FL_EXP_LN2_LO, FL_EXP_C2, FL_EXP_C3, FL_EXP_C4, FL_EXP_C5, FL_EXP_C6, FL_EXP_C7, FL_EXP_X_MAX,
          FL_EXP_X_MIN, FL_LOG_SQRT2_BITS, FL_LOG_LN2_HI, FL_LOG_LN2_LO, FL_LOG_Q0, FL_LOG_Q1, FL_LOG_Q2,
          FL_LOG_Q3, FL_LOG_Q4, FL_LOG_Q5, FL_LOG_Q6, FL_LOG_Q7, FL_LOG_Q8, FL_LOG_Q9};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("hopper_logits", &hopper_logits, "z = hidden @ weight[:ncols].T under the Hopper k16 rule");
  m.def("tile_stats", &tile_stats, "tile max and adjacent-pairwise sum of exp(z/T - max) per 64-column tile");
  m.def("merge", &merge, "row merge over tiles in ascending order; logp = min(z'_target - lse, 0)");
  m.def("contract_exp", [](torch::Tensor x) { return map_f32(x, false); });
  m.def("contract_log", [](torch::Tensor x) { return map_f32(x, true); });
  m.def("contract_constants", &contract_constants);
  m.def("panel_decode_mismatches", &panel_decode_mismatches);
  m.def("vector_isa", []() { return std::string(FL_HAVE_AVX512 ? "avx512" : "scalar"); });
}
