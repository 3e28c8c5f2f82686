// The CUDA driver API and NVRTC, opened at run time (dlopen; copy.cpp): a CPU host builds and
// runs the lane without either. Only the entry points the lane calls are declared.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace kvlane {

// ---- CUDA driver API and NVRTC, loaded at run time (a CPU host needs neither) ------------------
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

struct NvRtc {
  int (*create)(void**, const char*, const char*, int, const char* const*, const char* const*) = nullptr;
  int (*compile)(void*, int, const char* const*) = nullptr;
  int (*ptx_size)(void*, size_t*) = nullptr;
  int (*ptx)(void*, char*) = nullptr;
  int (*log_size)(void*, size_t*) = nullptr;
  int (*log)(void*, char*) = nullptr;
  int (*destroy)(void**) = nullptr;
};

struct Slot {  // descriptor buffers of one launch in flight (pinned host, device), its event
  char* host = nullptr;
  CUdeviceptr dev = 0;
  size_t cap = 0;
  CUevent ev = nullptr;
  bool busy = false;
};

struct DeviceLane {  // per CUDA device: context, stream, kernel, descriptor buffers
  CUcontext ctx = nullptr;
  CUstream stream = nullptr;
  CUfunction fn = nullptr;       // lane_copy (kernel.h)
  CUfunction fn_wide = nullptr;  // lane_copy_wide
  char* host = nullptr;          // pinned
  CUdeviceptr dev = 0;
  size_t cap = 0;
  std::vector<Slot> ring;  // same-node copies launched and not yet seen done (launch_local)
};

}  // namespace kvlane
