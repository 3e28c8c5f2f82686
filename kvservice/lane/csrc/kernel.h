// The lane's copy kernels, compiled by NVRTC at run time for the GPU they run on (copy.cpp
// Lane::device). Grid: x = page pair, y = segment (a region of one receiver rank), z = chunk of
// ``chunk`` bytes of the page's region; 16-byte words where every address and length allows
// (vec16). Two block sizes of one body (Lane::launch picks, bench/sweep_lane_kernel.py measured):
// lane_copy_wide (kWideThreads) for whole pages of at least kWideBytes a block, lane_copy
// (kLaneThreads) for the rest (head slices, small pages). The sweep compiles this same text through
// CuPy, with -DLANE_THREADS=n for a third kernel of other shapes (lane_copy_t).
#pragma once

namespace kvlane {

inline constexpr unsigned kLaneThreads = 256;
inline constexpr unsigned kWideThreads = 512;
inline constexpr unsigned long long kWideBytes = 32768;

inline constexpr const char* KERNEL_SRC = R"(
// One segment: a region of one receiver rank. A page's bytes move as runs of ``run`` bytes,
// ``src_run`` / ``dst_run`` apart (a head slice, token-major pages); run >= nbytes: one run.
struct Region {
  unsigned long long src, dst, src_stride, dst_stride, nbytes, run, src_run, dst_run, pairs;
};
#ifndef LANE_UNROLL  // 16-byte words a thread has in flight
#define LANE_UNROLL 4
#endif
// Segments come grouped by target, ``per_target`` regions each, and target t's pairs start at
// t x ``moved`` (Region::pairs says the same): a block's page pair is read beside its region, not
// after it (one dependent load fewer before the copy's first load).
template <unsigned NT>
__device__ __forceinline__ void lane_copy_body(
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
      for (; j + (LANE_UNROLL - 1) * NT < n4; j += LANE_UNROLL * NT) {
        uint4 v[LANE_UNROLL];
        unsigned long long so[LANE_UNROLL], dof[LANE_UNROLL];
#pragma unroll
        for (int u = 0; u < LANE_UNROLL; ++u) {
          const unsigned i = i0 + j + u * NT, k = i / run4, w = i - k * run4;
          so[u] = k * R.src_run + 16ull * w;
          dof[u] = k * R.dst_run + 16ull * w;
        }
#pragma unroll
        for (int u = 0; u < LANE_UNROLL; ++u) v[u] = *(const uint4*)(s + so[u]);
#pragma unroll
        for (int u = 0; u < LANE_UNROLL; ++u) *(uint4*)(d + dof[u]) = v[u];
      }
      for (; j < n4; j += NT) {
        const unsigned i = i0 + j, k = i / run4, w = i - k * run4;
        *(uint4*)(d + k * R.dst_run + 16ull * w) = *(const uint4*)(s + k * R.src_run + 16ull * w);
      }
    } else {
      for (unsigned long long i = start + threadIdx.x; i < start + n; i += NT) {
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
    for (; i + (LANE_UNROLL - 1) * NT < n4; i += LANE_UNROLL * NT) {
      uint4 v[LANE_UNROLL];
#pragma unroll
      for (int u = 0; u < LANE_UNROLL; ++u) v[u] = s4[i + u * NT];
#pragma unroll
      for (int u = 0; u < LANE_UNROLL; ++u) d4[i + u * NT] = v[u];
    }
    for (; i < n4; i += NT) d4[i] = s4[i];
  } else {
    for (unsigned long long i = threadIdx.x; i < n; i += NT) d[i] = s[i];
  }
}
#define LANE_ARGS const Region* __restrict__ regions, const int* __restrict__ pairs, int vec16, \
    unsigned chunk, unsigned per_target, unsigned moved
extern "C" __global__ void __launch_bounds__(256) lane_copy(LANE_ARGS) {
  lane_copy_body<256>(regions, pairs, vec16, chunk, per_target, moved);
}
extern "C" __global__ void __launch_bounds__(512) lane_copy_wide(LANE_ARGS) {
  lane_copy_body<512>(regions, pairs, vec16, chunk, per_target, moved);
}
#ifdef LANE_THREADS
extern "C" __global__ void __launch_bounds__(LANE_THREADS) lane_copy_t(LANE_ARGS) {
  lane_copy_body<LANE_THREADS>(regions, pairs, vec16, chunk, per_target, moved);
}
#endif
)";

}  // namespace kvlane
