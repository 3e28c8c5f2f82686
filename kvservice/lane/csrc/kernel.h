// The lane's copy kernel, compiled by NVRTC at run time for the GPU it runs on (copy.cpp
// Lane::device). Grid: x = page pair, y = segment (a region of one receiver rank), z = chunk of
// ``chunk`` bytes of the page's region; kLaneThreads threads a block, 16-byte words where every address
// and length allows (vec16). bench/sweep_lane_kernel.py compiles this same text through CuPy.
#pragma once

namespace kvlane {

// The launch shape, given to NVRTC as -DLANE_THREADS / -DLANE_UNROLL (bench/sweep_lane_kernel.py
// measures others against a device copy).
inline constexpr unsigned kLaneThreads = 512;
inline constexpr unsigned kLaneUnroll = 4;

inline constexpr const char* KERNEL_SRC = R"(
// One segment: a region of one receiver rank. A page's bytes move as runs of ``run`` bytes,
// ``src_run`` / ``dst_run`` apart (a head slice, token-major pages); run >= nbytes: one run.
struct Region {
  unsigned long long src, dst, src_stride, dst_stride, nbytes, run, src_run, dst_run, pairs;
};
#ifndef LANE_THREADS  // threads a block (the launch in copy.cpp uses kLaneThreads, the same)
#define LANE_THREADS 512
#endif
#ifndef LANE_UNROLL  // 16-byte words a thread has in flight
#define LANE_UNROLL 4
#endif
// Segments come grouped by target, ``per_target`` regions each, and target t's pairs start at
// t x ``moved`` (Region::pairs says the same): a block's page pair is read beside its region, not
// after it (one dependent load fewer before the copy's first load).
extern "C" __global__ void __launch_bounds__(LANE_THREADS) lane_copy(
    const Region* __restrict__ regions, const int* __restrict__ pairs, int vec16, unsigned chunk,
    unsigned per_target, unsigned moved) {
  const int2 pr = ((const int2*)pairs)[(unsigned long long)(blockIdx.y / per_target) * moved + blockIdx.x];
  const Region R = regions[blockIdx.y];
  const unsigned long long start = (unsigned long long)blockIdx.z * chunk;
  if (start >= R.nbytes) return;
  unsigned long long n = R.nbytes - start;
  if (n > chunk) n = chunk;
  const int sp = pr.x, dp = pr.y;
  if (R.run < R.nbytes) {  // runs: thread j moves 16-byte word i0 + j of the page's runs, end to end
    const char* s = (const char*)(R.src + (unsigned long long)sp * R.src_stride);
    char* d = (char*)(R.dst + (unsigned long long)dp * R.dst_stride);
    if (vec16) {
      const unsigned run4 = (unsigned)(R.run >> 4), i0 = (unsigned)(start >> 4), n4 = (unsigned)(n >> 4);
      unsigned j = threadIdx.x;
      for (; j + (LANE_UNROLL - 1) * LANE_THREADS < n4; j += LANE_UNROLL * LANE_THREADS) {
        uint4 v[LANE_UNROLL];
        unsigned long long so[LANE_UNROLL], dof[LANE_UNROLL];
#pragma unroll
        for (int u = 0; u < LANE_UNROLL; ++u) {
          const unsigned i = i0 + j + u * LANE_THREADS, k = i / run4, w = i - k * run4;
          so[u] = k * R.src_run + 16ull * w;
          dof[u] = k * R.dst_run + 16ull * w;
        }
#pragma unroll
        for (int u = 0; u < LANE_UNROLL; ++u) v[u] = *(const uint4*)(s + so[u]);
#pragma unroll
        for (int u = 0; u < LANE_UNROLL; ++u) *(uint4*)(d + dof[u]) = v[u];
      }
      for (; j < n4; j += LANE_THREADS) {
        const unsigned i = i0 + j, k = i / run4, w = i - k * run4;
        *(uint4*)(d + k * R.dst_run + 16ull * w) = *(const uint4*)(s + k * R.src_run + 16ull * w);
      }
    } else {
      for (unsigned long long i = start + threadIdx.x; i < start + n; i += LANE_THREADS) {
        const unsigned long long k = i / R.run, w = i - k * R.run;
        d[k * R.dst_run + w] = s[k * R.src_run + w];
      }
    }
    return;
  }
  const char* s = (const char*)(R.src + (unsigned long long)sp * R.src_stride + start);
  char* d = (char*)(R.dst + (unsigned long long)dp * R.dst_stride + start);
  if (vec16) {
    const uint4* s4 = (const uint4*)s;
    uint4* d4 = (uint4*)d;
    const unsigned n4 = (unsigned)(n >> 4);
    unsigned i = threadIdx.x;
    for (; i + (LANE_UNROLL - 1) * LANE_THREADS < n4; i += LANE_UNROLL * LANE_THREADS) {
      uint4 v[LANE_UNROLL];
#pragma unroll
      for (int u = 0; u < LANE_UNROLL; ++u) v[u] = s4[i + u * LANE_THREADS];
#pragma unroll
      for (int u = 0; u < LANE_UNROLL; ++u) d4[i + u * LANE_THREADS] = v[u];
    }
    for (; i < n4; i += LANE_THREADS) d4[i] = s4[i];
  } else {
    for (unsigned long long i = threadIdx.x; i < n; i += LANE_THREADS) d[i] = s[i];
  }
}
)";

}  // namespace kvlane
