// The bf16 pair and conversion the kernels' dz epilogue uses (cuda_bf16.h), for simt.h's builds, which have no CUDA
// toolkit: __floats2bfloat162_rn rounds each float to the nearest bf16, ties to even (subnormals kept), a NaN to the
// canonical 0x7FFF (cvt.rn.bf16x2.f32); .x holds the first float, in the low 16 bits.
#pragma once
#include <cstdint>
#include <cstring>

struct __nv_bfloat162 {
  uint16_t x, y;
};

inline uint16_t simt_bf16_rn(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {simt_bf16_rn(a), simt_bf16_rn(b)}; }
