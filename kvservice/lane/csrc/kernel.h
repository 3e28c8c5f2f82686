// The lane's copy kernel, compiled by NVRTC at run time for the GPU it runs on (copy.cpp
// Lane::device). Grid: x = page pair, y = segment (a region of one receiver rank), z = chunk of
// ``chunk`` bytes of the page's region; 256 threads a block, 16-byte words where every address
// and length allows (vec16). bench/sweep_lane_kernel.py compiles this same text through CuPy.
#pragma once

namespace kvlane {

inline constexpr const char* KERNEL_SRC = R"(
// One segment: a region of one receiver rank. A page's bytes move as runs of ``run`` bytes,
// ``src_run`` / ``dst_run`` apart (a head slice, token-major pages); run >= nbytes: one run.
struct Region {
  unsigned long long src, dst, src_stride, dst_stride, nbytes, run, src_run, dst_run, pairs;
};
extern "C" __global__ void __launch_bounds__(256) lane_copy(
    const Region* __restrict__ regions, const int* __restrict__ pairs, int vec16, unsigned chunk) {
  const Region R = regions[blockIdx.y];
  const unsigned long long start = (unsigned long long)blockIdx.z * chunk;
  if (start >= R.nbytes) return;
  unsigned long long n = R.nbytes - start;
  if (n > chunk) n = chunk;
  const int* pr = pairs + 2 * (R.pairs + blockIdx.x);
  const int sp = pr[0], dp = pr[1];
  if (R.run < R.nbytes) {  // runs: thread j moves 16-byte word i0 + j of the page's runs, end to end
    const char* s = (const char*)(R.src + (unsigned long long)sp * R.src_stride);
    char* d = (char*)(R.dst + (unsigned long long)dp * R.dst_stride);
    if (vec16) {
      const unsigned run4 = (unsigned)(R.run >> 4), i0 = (unsigned)(start >> 4), n4 = (unsigned)(n >> 4);
      unsigned j = threadIdx.x;
      for (; j + 3 * 256 < n4; j += 4 * 256) {
        uint4 v[4];
        unsigned long long so[4], dof[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const unsigned i = i0 + j + u * 256, k = i / run4, w = i - k * run4;
          so[u] = k * R.src_run + 16ull * w;
          dof[u] = k * R.dst_run + 16ull * w;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = *(const uint4*)(s + so[u]);
#pragma unroll
        for (int u = 0; u < 4; ++u) *(uint4*)(d + dof[u]) = v[u];
      }
      for (; j < n4; j += 256) {
        const unsigned i = i0 + j, k = i / run4, w = i - k * run4;
        *(uint4*)(d + k * R.dst_run + 16ull * w) = *(const uint4*)(s + k * R.src_run + 16ull * w);
      }
    } else {
      for (unsigned long long i = start + threadIdx.x; i < start + n; i += 256) {
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
    for (; i + 3 * 256 < n4; i += 4 * 256) {
      uint4 a = s4[i], b = s4[i + 256], c = s4[i + 512], e = s4[i + 768];
      d4[i] = a; d4[i + 256] = b; d4[i + 512] = c; d4[i + 768] = e;
    }
    for (; i < n4; i += 256) d4[i] = s4[i];
  } else {
    for (unsigned long long i = threadIdx.x; i < n; i += 256) d[i] = s[i];
  }
}
)";

}  // namespace kvlane
