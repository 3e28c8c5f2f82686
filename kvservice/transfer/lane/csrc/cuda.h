// The CUDA driver API, opened at run time (dlopen; copy.cpp): a CPU host builds and runs the lane
// without it. Only the entry points the lane calls are declared. The copy kernel is Triton's
// (kvservice/kernels/lane_copy.py: cubins compiled ahead of time by kvservice/kernels/aot.py and
// handed in by Python; docs/decisions/0026).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace kvlane {

// ---- CUDA driver API, loaded at run time (a CPU host needs none) --------------------------------
using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUevent = void*;
using CUmodule = void*;
using CUfunction = void*;
using CUstream = void*;
using CUdeviceptr = unsigned long long;

struct Cuda {
  bool ok = false;
  std::string why;
  CUresult (*cuInit)(unsigned) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuCtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*cuModuleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*cuStreamCreate)(CUstream*, unsigned) = nullptr;
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t) = nullptr;
  CUresult (*cuMemFree)(CUdeviceptr) = nullptr;
  CUresult (*cuMemAllocHost)(void**, size_t) = nullptr;
  CUresult (*cuMemFreeHost)(void*) = nullptr;
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                             void**, void**) = nullptr;
  CUresult (*cuStreamSynchronize)(CUstream) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;
  CUresult (*cuEventCreate)(CUevent*, unsigned) = nullptr;
  CUresult (*cuEventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*cuEventSynchronize)(CUevent) = nullptr;
};

// One compiled variant of the Triton copy kernel (aot.py): for compute capability ``cc`` (major*10+minor),
// 16-byte words or bytes (``vec``), ``threads`` a block; ``params``: the kernel's parameter count
// (its five arguments, then the scratch pointers Triton appends, passed as null).
struct KernelImage {
  int cc = 0, vec = 0;
  unsigned threads = 0, shared = 0;
  int params = 0;
  std::string name, cubin;
};

struct Kernel {  // a copy kernel loaded on one device
  CUfunction fn = nullptr;
  unsigned threads = 0, shared = 0;
  int params = 0;  // its parameters as compiled
};

struct Slot {  // descriptor buffers of one launch in flight (pinned host, device), its event
  char* host = nullptr;
  CUdeviceptr dev = 0;
  size_t cap = 0;
  CUevent ev = nullptr;
  bool busy = false;
};

struct DeviceLane {  // per CUDA device: context, stream, kernels, descriptor buffers
  CUcontext ctx = nullptr;
  CUstream stream = nullptr;
  Kernel kernel[2][3];  // [vec][block]: 16-byte words or bytes; the small, narrow or wide block
  char* host = nullptr;          // pinned
  CUdeviceptr dev = 0;
  size_t cap = 0;
  std::vector<Slot> ring;  // same-node copies launched and not yet seen done (launch_local)
};

}  // namespace kvlane
