// The one CUDA driver type the kernels' headers name (CUtensorMap, in kernel parameters the SIMT harness never
// builds): enough for simt.h's builds, which have no CUDA toolkit.
#pragma once
struct CUtensorMap_st {
  alignas(64) unsigned long long opaque[16];
};
typedef CUtensorMap_st CUtensorMap;
