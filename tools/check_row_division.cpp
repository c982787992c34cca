// The forward's division by a row's temperature with the reciprocal computed once a row (stats_epilogue.cuh,
// div_rn_rowrcp), checked against the IEEE quotient on the CPU: the same five operations (binary32 multiply, four
// fused multiply-adds, each rounded once to nearest even) on y = RN(1 / T), compared bit for bit with RN(z / T).
//
//   check_row_division exhaustive T_BITS...   every z with 2^-100 <= |z| < 2^101 for each T (~3.4e9 values a T)
//   check_row_division sample N SEED         N pseudo-random (z, T) pairs over the guarded ranges, plus the ends
//
// Prints one line a T (exhaustive) or one line (sample): checked and mismatching counts; exit 1 on any mismatch.
// Build: c++ -O2 -std=c++17 -ffp-contract=off -pthread (the multiply must stay a separate rounding).
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

static float f(uint32_t b) { float x; std::memcpy(&x, &b, 4); return x; }
static uint32_t u(float x) { uint32_t b; std::memcpy(&b, &x, 4); return b; }

// The guarded domain (the kernel's guard constants): T in [2^-20, 2^20], |z| in [2^-100, 2^100] (exponent field).
static constexpr uint32_t kZExpLo = 127 - 100, kZExpHi = 127 + 100;
static constexpr uint32_t kTExpLo = 127 - 20, kTExpHi = 127 + 20;

static float div_rowrcp(float z, float t, float y) {
  const float q0 = z * y;
  const float r0 = std::fmaf(-t, q0, z);
  const float q1 = std::fmaf(r0, y, q0);
  const float r1 = std::fmaf(-t, q1, z);
  return std::fmaf(r1, y, q1);
}

static uint64_t check_t(float t, uint64_t* checked) {
  const float y = 1.0f / t;
  const unsigned nth = std::max(1u, std::thread::hardware_concurrency());
  std::vector<uint64_t> bad(nth, 0), seen(nth, 0);
  std::vector<std::thread> pool;
  const uint64_t lo = uint64_t(kZExpLo) << 23, hi = (uint64_t(kZExpHi) + 1) << 23;   // [2^-100, 2^101)
  for (unsigned w = 0; w < nth; ++w)
    pool.emplace_back([&, w] {
      uint64_t b = 0, s = 0;
      for (uint64_t m = lo + w; m < hi; m += nth) {
        for (uint32_t sign = 0; sign < 2; ++sign) {
          const float z = f(uint32_t(m) | (sign << 31));
          b += u(div_rowrcp(z, t, y)) != u(z / t);
          ++s;
        }
      }
      bad[w] = b;
      seen[w] = s;
    });
  for (auto& th : pool) th.join();
  uint64_t nb = 0;
  for (unsigned w = 0; w < nth; ++w) {
    nb += bad[w];
    *checked += seen[w];
  }
  return nb;
}

int main(int argc, char** argv) {
  if (argc >= 3 && std::strcmp(argv[1], "exhaustive") == 0) {
    uint64_t total_bad = 0;
    for (int i = 2; i < argc; ++i) {
      const float t = f(uint32_t(std::strtoul(argv[i], nullptr, 0)));
      const uint32_t e = (u(t) >> 23) & 0xFF;
      if (!(t > 0.0f) || e < kTExpLo || e > kTExpHi) {
        std::printf("T %s outside [2^-20, 2^20]\n", argv[i]);
        return 2;
      }
      uint64_t checked = 0;
      const uint64_t nb = check_t(t, &checked);
      std::printf("T 0x%08" PRIx32 " (%.9g): %" PRIu64 " z checked, %" PRIu64 " mismatches\n", u(t), t, checked, nb);
      std::fflush(stdout);
      total_bad += nb;
    }
    return total_bad ? 1 : 0;
  }
  if (argc == 4 && std::strcmp(argv[1], "sample") == 0) {
    const uint64_t n = std::strtoull(argv[2], nullptr, 0);
    uint64_t x = std::strtoull(argv[3], nullptr, 0) | 1;
    auto next = [&x] { x ^= x << 13; x ^= x >> 7; x ^= x << 17; return x; };
    auto draw = [&](uint32_t elo, uint32_t ehi, bool sign) {
      const uint64_t r = next();
      const uint32_t e = elo + uint32_t(r % (ehi - elo + 1));
      return f(((sign && (r >> 40) & 1) ? 0x80000000u : 0u) | (e << 23) | uint32_t((r >> 8) & 0x7FFFFF));
    };
    uint64_t bad = 0, checked = 0;
    const float ends_t[] = {f(kTExpLo << 23), f((kTExpHi << 23) | 0x7FFFFF), 0.7f, 1.0f, 0.3f, 2.0f, 1.99999988f};
    const float ends_z[] = {f(kZExpLo << 23), f((kZExpHi << 23) | 0x7FFFFF), 1.0f, 3.0f, 0.1f};
    for (float t : ends_t)
      for (float z : ends_z)
        for (float s : {1.0f, -1.0f}) {
          bad += u(div_rowrcp(s * z, t, 1.0f / t)) != u(s * z / t);
          ++checked;
        }
    for (uint64_t i = 0; i < n; ++i) {
      const float t = draw(kTExpLo, kTExpHi, false);
      const float z = draw(kZExpLo, kZExpHi, true);
      bad += u(div_rowrcp(z, t, 1.0f / t)) != u(z / t);
      ++checked;
    }
    std::printf("sample: %" PRIu64 " (z, T) pairs checked, %" PRIu64 " mismatches\n", checked, bad);
    return bad ? 1 : 0;
  }
  std::fprintf(stderr, "usage: %s exhaustive T_BITS... | sample N SEED\n", argv[0]);
  return 2;
}
