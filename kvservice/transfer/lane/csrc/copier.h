// The lane's copies, behind one object (copy.cpp): the CUDA driver opened at run time, per device a
// context, a stream and the copy kernel (Triton's cubins: cuda.h), descriptor buffers, and a ring of
// launch slots for copies that are launched now and waited for later; host pools copied with
// memcpy. The routes (same_node.cpp, cross_send.cpp, cross_recv.cpp) say what to copy as
// segments and page pairs; this object knows how.
//
//   copy(sdev, ddev, segs, pairs, n)           launched and waited for (host pools: memcpy)
//   launch_async(dev, segs, pairs, n, slot)    into a free ring slot, its event recorded
//   finish(dev, slot)                          that event waited for; the slot is free again
//
// One lock (mu_) guards the driver's per-device state; slot_mu_ guards the ring's busy flags and
// nests outside it. No other lock of the lane is taken inside either.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda.h"
#include "state.h"
#include "wire.h"

namespace kvlane {

class Copier {
 public:
  // CUDA: load the driver (path chosen by Python) and keep the Triton kernel images (compiled by
  // Python for the devices present); false + why() when unavailable, or when there are no images
  // (no kernel to copy with: GPU pools stay off the lane).
  bool init(const std::string& libcuda, const std::vector<KernelImage>& kernels);
  std::string why() const { return cuda_.why; }
  // Context, stream and kernels of device ``dev`` (Python calls it before the first arm there).
  void prepare(int dev);
  // Bytes of one page region a CUDA block copies (a multiple of 16).
  void set_chunk(unsigned bytes) { chunk_ = std::max(16u, bytes & ~15u); }
  // Between two GPUs the kernel runs on the receiver's GPU (pull) or the sender's (push, default).
  void set_pull(bool pull) { pull_ = pull; }
  int launch_device(int sdev, int ddev) const { return pull_ ? ddev : sdev; }

  // Every segment's ``moved`` pages (``pairs``: source, destination page per segment's block) in
  // one kernel launch on the launching GPU, or memcpy for host pools; returns once copied.
  std::string copy(int sdev, int ddev, const std::vector<Seg>& segs, const std::vector<int32_t>& pairs, size_t moved);
  // The same on GPU ``dev``, launched and not waited for: into a free slot of the device's ring
  // (waiting for one while ``running``; an error once it is not), its event recorded, and when
  // (``at_launch``; left as it was when it never launched).
  std::string launch_async(int dev, const std::vector<Seg>& segs, const std::vector<int32_t>& pairs, size_t moved,
                           const std::atomic<bool>& running, int& slot, double& at_launch);
  // Until ``slot``'s copy on ``dev`` has run; the slot is free again either way.
  std::string finish(int dev, int slot);
  void wake();  // waiters for a slot look again (the lane stops)

  // Device memory (the cross-node lane's staging): the allocation's error, or throws when the
  // device cannot be used at all.
  std::string alloc(int dev, uint64_t bytes, CUdeviceptr& out);
  void free(CUdeviceptr p);

  // CUDA copies, and their cumulative µs waiting for mu_ and for the device (stats()).
  uint64_t copies() const { return copies_; }
  uint64_t lock_us() const { return lock_us_; }
  uint64_t sync_us() const { return sync_us_; }

  static void host_copy(const std::vector<Seg>& segs, const int32_t* pairs, size_t moved);

 private:
  bool fail(const std::string& why);
  std::string cu_err(CUresult r);
  DeviceLane& device(int dev);  // mu_ held
  void grow(char*& host, CUdeviceptr& dev, size_t& cap_, size_t need);
  std::string launch(DeviceLane& d, char* host, CUdeviceptr dev, const std::vector<Seg>& segs,
                     const std::vector<int32_t>& pairs, size_t moved);
  static void host_run(char* d, const char* s, uint64_t n);
  static void host_jobs(const Seg* segs, const int32_t* pairs, size_t moved, size_t lo, size_t hi);
  static void count(std::atomic<uint64_t>& us, double since) { us += (uint64_t)std::max(0.0, (now_s() - since) * 1e6); }

  // Host pools: from HOST_PARALLEL_BYTES on, the jobs split over a few threads (host_copy).
  static constexpr uint64_t HOST_PARALLEL_BYTES = 4ull << 20;
  static constexpr unsigned HOST_MAX_THREADS = 8;
  // Copies launched and not yet waited for, per device: each holds a slot of descriptor buffers,
  // so a later launch never overwrites the table an earlier kernel still reads.
  static constexpr size_t RING = 8;
  // Block sizes of the three variants Lane::launch picks from (bench/sweep_lane_kernel.py measured):
  // the wide one for whole pages of at least WIDE_BYTES a block, the small one where a block moves
  // at most SMALL_BYTES (a 4 -> 2 head slice's 8 KiB: each thread four words, none masked off), the
  // narrow one for the rest.
  static constexpr unsigned SMALL_THREADS = 128, NARROW_THREADS = 256, WIDE_THREADS = 512;
  static constexpr unsigned long long SMALL_BYTES = 8192, WIDE_BYTES = 32768;
  void load_triton(DeviceLane& d, int cc, int dev);  // mu_ held

  std::mutex mu_;
  Cuda cuda_;
  std::vector<KernelImage> images_;  // Triton's cubins (aot.py), every variant for each capability present
  std::unordered_map<int, DeviceLane> devs_;
  std::atomic<unsigned> chunk_{32768};
  std::atomic<bool> pull_{false};
  std::mutex slot_mu_;
  std::condition_variable slot_cv_;
  std::atomic<uint64_t> copies_{0}, lock_us_{0}, sync_us_{0};
};

}  // namespace kvlane
