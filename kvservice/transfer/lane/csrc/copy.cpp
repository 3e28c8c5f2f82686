// The Copier (copier.h): the CUDA driver opened at run time, the copy kernel loaded per device
// (Triton's cubins, compiled ahead of time by kvservice/kernels/aot.py), descriptor buffers, launches
// and the ring of launch slots; host pools copied with memcpy (non-temporal on x86).

#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <system_error>
#include <thread>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "copier.h"

namespace kvlane {

// CUDA: load the driver (path chosen by Python) and keep the Triton kernel images; false + why()
// when unavailable or when no image came (no kernel: GPU pools stay off the lane).
bool Copier::init(const std::string& libcuda, const std::vector<KernelImage>& kernels) {
  std::lock_guard<std::mutex> g(mu_);
  if (cuda_.ok) return true;
  if (kernels.empty()) return fail("no copy kernel images (kvservice/kernels/aot.py compiled none)");
  images_ = kernels;
  void* h = dlopen(libcuda.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (!h) return fail(std::string("dlopen ") + libcuda + ": " + dlerror());
#define SYM(name, sym)                                                 \
  do {                                                                 \
    *(void**)(&cuda_.name) = dlsym(h, sym);                            \
    if (!cuda_.name) return fail(std::string("libcuda lacks ") + sym); \
  } while (0)
  SYM(cuInit, "cuInit");
  SYM(cuDeviceGet, "cuDeviceGet");
  SYM(cuDeviceGetAttribute, "cuDeviceGetAttribute");
  SYM(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  SYM(cuCtxSetCurrent, "cuCtxSetCurrent");
  SYM(cuModuleLoadData, "cuModuleLoadData");
  SYM(cuModuleGetFunction, "cuModuleGetFunction");
  SYM(cuStreamCreate, "cuStreamCreate");
  SYM(cuMemAlloc, "cuMemAlloc_v2");
  SYM(cuMemFree, "cuMemFree_v2");
  SYM(cuMemAllocHost, "cuMemAllocHost_v2");
  SYM(cuMemFreeHost, "cuMemFreeHost");
  SYM(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
  SYM(cuLaunchKernel, "cuLaunchKernel");
  SYM(cuStreamSynchronize, "cuStreamSynchronize");
  SYM(cuGetErrorString, "cuGetErrorString");
  SYM(cuEventCreate, "cuEventCreate");
  SYM(cuEventRecord, "cuEventRecord");
  SYM(cuEventSynchronize, "cuEventSynchronize");
#undef SYM
  if (cuda_.cuInit(0) != 0) return fail("cuInit failed");
  cuda_.ok = true;
  return true;
}

void Copier::prepare(int dev) {
  std::lock_guard<std::mutex> g(mu_);
  device(dev);
}

bool Copier::fail(const std::string& why) {
  cuda_.why = why;
  return false;
}

std::string Copier::cu_err(CUresult r) {
  const char* s = nullptr;
  if (cuda_.cuGetErrorString) cuda_.cuGetErrorString(r, &s);
  return std::string("CUDA error ") + std::to_string(r) + (s ? std::string(": ") + s : "");
}

DeviceLane& Copier::device(int dev) {  // mu_ held
  auto it = devs_.find(dev);
  if (it != devs_.end()) return it->second;
  if (!cuda_.ok) throw std::runtime_error("lane: CUDA not initialised: " + cuda_.why);
  DeviceLane d;
  CUdevice cd;
  CUresult r;
  if ((r = cuda_.cuDeviceGet(&cd, dev)) || (r = cuda_.cuDevicePrimaryCtxRetain(&d.ctx, cd)) ||
      (r = cuda_.cuCtxSetCurrent(d.ctx)))
    throw std::runtime_error("lane: device " + std::to_string(dev) + ": " + cu_err(r));
  int major = 0, minor = 0;
  cuda_.cuDeviceGetAttribute(&major, 75, cd);  // COMPUTE_CAPABILITY_MAJOR
  cuda_.cuDeviceGetAttribute(&minor, 76, cd);
  const int cc = major * 10 + minor;
  load_triton(d, cc, dev);
  if ((r = cuda_.cuStreamCreate(&d.stream, 1 /* CU_STREAM_NON_BLOCKING */)))
    throw std::runtime_error("lane: stream: " + cu_err(r));
  grow(d.host, d.dev, d.cap, 1 << 16);
  return devs_.emplace(dev, d).first->second;
}

// Triton's cubins for capability ``cc``: the six variants (16-byte words or bytes; small, narrow or wide).
void Copier::load_triton(DeviceLane& d, int cc, int dev) {
  CUresult r;
  int found = 0;
  for (const KernelImage& im : images_) {
    if (im.cc != cc) continue;
    const int block = im.threads == WIDE_THREADS     ? 2
                      : im.threads == NARROW_THREADS ? 1
                      : im.threads == SMALL_THREADS  ? 0
                                                     : -1;
    if (block < 0 || (im.vec != 0 && im.vec != 1) || im.shared > 48 * 1024 || im.params < 5 || im.params > 16)
      throw std::runtime_error("lane: kernel image " + im.name + ": unexpected threads, words, shared or params");
    CUmodule mod;
    Kernel& k = d.kernel[im.vec][block];
    if ((r = cuda_.cuModuleLoadData(&mod, im.cubin.data())) ||
        (r = cuda_.cuModuleGetFunction(&k.fn, mod, im.name.c_str())))
      throw std::runtime_error("lane: kernel " + im.name + " for sm_" + std::to_string(cc) + ": " + cu_err(r));
    k.threads = im.threads, k.shared = im.shared, k.params = im.params;
    found++;
  }
  for (auto& row : d.kernel)
    for (auto& k : row)
      if (!k.fn)
        throw std::runtime_error("lane: no copy kernel compiled for sm_" + std::to_string(cc) + " (of device " +
                                 std::to_string(dev) + "; " + std::to_string(found) + " of 6 variants)");
}

// Descriptor buffers (pinned host, device) of at least ``need`` bytes.
void Copier::grow(char*& host, CUdeviceptr& dev, size_t& cap_, size_t need) {
  if (need <= cap_) return;
  size_t cap = cap_ ? cap_ : 1 << 16;
  while (cap < need) cap <<= 1;
  if (host) cuda_.cuMemFreeHost(host);
  if (dev) cuda_.cuMemFree(dev);
  host = nullptr, dev = 0, cap_ = 0;
  CUresult r;
  if ((r = cuda_.cuMemAllocHost((void**)&host, cap)) || (r = cuda_.cuMemAlloc(&dev, cap)))
    throw std::runtime_error("lane: descriptor buffers: " + cu_err(r));
  cap_ = cap;
}

// mu_ held, ``d``'s context current: the segments and pairs up through ``host`` (pinned)
// to ``dev`` (both large enough), then the kernel, on ``d``'s stream.
std::string Copier::launch(DeviceLane& d, char* host, CUdeviceptr dev, const std::vector<Seg>& segs,
                           const std::vector<int32_t>& pairs, size_t moved) {
  const size_t nr = segs.size(), rbytes = nr * sizeof(Seg), need = rbytes + pairs.size() * 4;
  uint64_t maxb = 0;
  int vec = 1;
  bool whole = true;
  std::memcpy(host, segs.data(), rbytes);
  for (auto& x : segs) {
    if ((x.src | x.dst | x.src_stride | x.dst_stride | x.nbytes | x.run | x.src_run | x.dst_run) & 15) vec = 0;
    if (x.nbytes > maxb) maxb = x.nbytes;
    whole &= x.run >= x.nbytes;
  }
  std::memcpy(host + rbytes, pairs.data(), pairs.size() * 4);
  unsigned chunk = chunk_;
  unsigned zc = (unsigned)((maxb + chunk - 1) / chunk);
  if (zc > 65535 || nr > 65535) return "lane: pages or regions too large for one launch";
  // segments() groups the segments by target, ``moved`` pairs each: the kernel finds a block's
  // pairs from the regions a target and ``moved`` (moved > 0 here: the callers return before)
  const size_t targets = segs.back().pairs / moved + 1;
  unsigned per = (unsigned)(nr / targets), mv = (unsigned)moved;
  if (per * targets != nr) return "lane: segments not grouped by target";
  CUresult r;
  if ((r = cuda_.cuMemcpyHtoDAsync(dev, host, need, d.stream))) return cu_err(r);
  CUdeviceptr regs = dev, prs = dev + rbytes;
  // the block by the bytes a block moves (sweep_lane_kernel, docs/decisions/0019: 512 threads for
  // whole pages at 32 KiB 92.7% of a device copy, 256 at 16 KiB 90.8%; 8 KiB head slices lose 16
  // points at 512; the small block for those: docs/decisions/0026)
  const uint64_t per_block = std::min<uint64_t>(chunk, maxb);
  const int block = whole && per_block >= WIDE_BYTES ? 2 : per_block <= SMALL_BYTES ? 0 : 1;
  const Kernel& k = d.kernel[vec][block];
  CUdeviceptr none = 0;  // the scratch pointers Triton appends (none needed by this kernel)
  void* args[16] = {&regs, &prs, &chunk, &per, &mv};
  for (int i = 5; i < k.params; ++i) args[i] = &none;
  if ((r = cuda_.cuLaunchKernel(k.fn, (unsigned)moved, (unsigned)nr, zc, k.threads, 1, 1, k.shared, d.stream, args,
                                nullptr)))
    return cu_err(r);
  return "";
}

std::string Copier::copy(int sdev, int ddev, const std::vector<Seg>& segs, const std::vector<int32_t>& pairs,
                         size_t moved) {
  const size_t nr = segs.size();
  if (moved == 0 || nr == 0) return "";
  if (sdev < 0) {
    host_copy(segs, pairs.data(), moved);
    return "";
  }
  try {
    const double t_lock = now_s();
    std::lock_guard<std::mutex> g(mu_);
    count(lock_us_, t_lock);
    copies_++;
    DeviceLane& d = device(launch_device(sdev, ddev));
    CUresult r;
    if ((r = cuda_.cuCtxSetCurrent(d.ctx))) return cu_err(r);
    grow(d.host, d.dev, d.cap, nr * sizeof(Seg) + pairs.size() * 4);
    std::string err = launch(d, d.host, d.dev, segs, pairs, moved);
    if (!err.empty()) {  // what was queued may still read the buffers: wait it out
      cuda_.cuStreamSynchronize(d.stream);
      return err;
    }
    const double t_sync = now_s();
    if ((r = cuda_.cuStreamSynchronize(d.stream))) return cu_err(r);
    count(sync_us_, t_sync);
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

std::string Copier::launch_async(int on, const std::vector<Seg>& segs, const std::vector<int32_t>& pairs, size_t moved,
                                 const std::atomic<bool>& running, int& slot, double& at_launch) {
  slot = -1;
  int si = -1;
  try {
    std::unique_lock<std::mutex> g(slot_mu_);  // a free slot (finish() frees them)
    slot_cv_.wait(g, [&] {
      if (!running) return true;
      std::lock_guard<std::mutex> c(mu_);
      DeviceLane& d = device(on);
      if (d.ring.size() < RING) d.ring.resize(RING);
      for (size_t i = 0; i < d.ring.size(); ++i)
        if (!d.ring[i].busy) return (si = (int)i) >= 0;
      return false;
    });
    if (si < 0) return "lane: stopping";
    std::lock_guard<std::mutex> c(mu_);
    copies_++;
    DeviceLane& d = device(on);
    Slot& sl = d.ring[(size_t)si];
    CUresult r;
    if ((r = cuda_.cuCtxSetCurrent(d.ctx))) return cu_err(r);
    grow(sl.host, sl.dev, sl.cap, segs.size() * sizeof(Seg) + pairs.size() * 4);
    if (!sl.ev && (r = cuda_.cuEventCreate(&sl.ev, 2 /* CU_EVENT_DISABLE_TIMING */))) return cu_err(r);
    std::string err = launch(d, sl.host, sl.dev, segs, pairs, moved);
    if (err.empty() && (r = cuda_.cuEventRecord(sl.ev, d.stream))) err = cu_err(r);
    at_launch = now_s();
    if (!err.empty()) {  // what was queued may still read the slot or write pages: wait it out
      cuda_.cuStreamSynchronize(d.stream);
      return err;
    }
    sl.busy = true;  // (slot_mu_ held: a waiter sees it taken)
  } catch (const std::exception& e) {
    return e.what();
  }
  slot = si;
  return "";
}

std::string Copier::finish(int on, int slot) {
  std::string err;
  CUevent ev = nullptr;
  try {
    std::lock_guard<std::mutex> c(mu_);
    DeviceLane& d = device(on);
    ev = d.ring[(size_t)slot].ev;
    CUresult r = cuda_.cuCtxSetCurrent(d.ctx);
    if (r) err = cu_err(r);
  } catch (const std::exception& e) {
    err = e.what();
  }
  const double t_sync = now_s();
  if (err.empty()) {
    CUresult r = cuda_.cuEventSynchronize(ev);  // outside mu_: launches go on meanwhile
    if (r) err = cu_err(r);
  }
  count(sync_us_, t_sync);
  {
    std::lock_guard<std::mutex> g(slot_mu_);
    std::lock_guard<std::mutex> c(mu_);
    devs_.at(on).ring[(size_t)slot].busy = false;
  }
  slot_cv_.notify_all();
  return err;
}

void Copier::wake() {
  {
    std::lock_guard<std::mutex> g(slot_mu_);  // no lost wake-up between a waiter's check and its wait
  }
  slot_cv_.notify_all();
}

std::string Copier::alloc(int dev, uint64_t bytes, CUdeviceptr& out) {
  std::lock_guard<std::mutex> g(mu_);
  DeviceLane& d = device(dev);  // (throws: "lane: CUDA not initialised", "lane: device N: ...")
  CUresult r = cuda_.cuCtxSetCurrent(d.ctx);
  if (r) throw std::runtime_error("lane: device " + std::to_string(dev) + ": " + cu_err(r));
  r = cuda_.cuMemAlloc(&out, bytes);
  return r ? cu_err(r) : "";
}

void Copier::free(CUdeviceptr p) {
  std::lock_guard<std::mutex> g(mu_);
  cuda_.cuMemFree(p);
}

void Copier::host_run(char* d, const char* s, uint64_t n) {
#if defined(__x86_64__)
  if ((((uintptr_t)d | (uintptr_t)s | n) & 15) == 0) {
    __m128i* dv = (__m128i*)d;
    const __m128i* sv = (const __m128i*)s;
    for (uint64_t i = 0, m = n / 16; i < m; ++i) _mm_stream_si128(dv + i, _mm_load_si128(sv + i));
    return;
  }
#endif
  std::memcpy(d, s, n);
}

void Copier::host_jobs(const Seg* segs, const int32_t* pairs, size_t moved, size_t lo, size_t hi) {
  for (size_t job = lo; job < hi; ++job) {
    const Seg& g = segs[job / moved];
    const size_t i = job % moved;
    const int32_t* pr = pairs + 2 * (g.pairs + i);
    char* d = (char*)(g.dst + (uint64_t)pr[1] * g.dst_stride);
    const char* s = (const char*)(g.src + (uint64_t)pr[0] * g.src_stride);
    if (g.run >= g.nbytes) {
      host_run(d, s, g.nbytes);
    } else {
      for (uint64_t k = 0, n = g.nbytes / g.run; k < n; ++k) host_run(d + k * g.dst_run, s + k * g.src_run, g.run);
    }
  }
#if defined(__x86_64__)
  _mm_sfence();  // the streamed stores are visible before the END that follows
#endif
}

void Copier::host_copy(const std::vector<Seg>& segs, const int32_t* pairs, size_t moved) {
  const size_t jobs = segs.size() * moved;
  uint64_t bytes = 0;
  for (auto& g : segs) bytes += g.nbytes * (uint64_t)moved;
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const size_t n =
      bytes < HOST_PARALLEL_BYTES
          ? 1
          : std::min<size_t>({(size_t)hw, (size_t)HOST_MAX_THREADS, jobs, (size_t)(bytes / (HOST_PARALLEL_BYTES / 2))});
  std::vector<std::thread> helpers;
  size_t inline_from = jobs;  // a helper that could not start leaves its jobs (and later ones) here
  for (size_t t = 1; t < n; ++t) {
    try {
      helpers.emplace_back(host_jobs, segs.data(), pairs, moved, jobs * t / n, jobs * (t + 1) / n);
    } catch (const std::system_error&) {
      inline_from = jobs * t / n;
      break;
    }
  }
  host_jobs(segs.data(), pairs, moved, 0, jobs / n);
  if (inline_from < jobs) host_jobs(segs.data(), pairs, moved, inline_from, jobs);
  for (auto& h : helpers) h.join();
}

}  // namespace kvlane
