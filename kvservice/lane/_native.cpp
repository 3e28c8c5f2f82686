// The native lane (issue 28, DESIGN.md "Data path v3" item 5; docs/design-notes.md §16).
//
// One thread per service reads engines' lane sockets (SOCK_SEQPACKET, authenticated by Python
// before the fd is handed here), matches a SEND command to an armed transfer, copies the pages
// (one CUDA kernel compiled with NVRTC and launched through the driver API, or memcpy for host
// pools), then writes END to both engines' lanes and queues a completion for Python's
// bookkeeping (records, index, metrics), which runs after the engines have their answer.
//
// Python owns every decision that is not per-transfer: who may connect, which pools exist, which
// transfers are armed (and disarming them on abort/expiry). This thread accepts a command only
// for an armed transfer whose layout signature, region geometry and page count match; anything
// else is answered FALLBACK and the engine repeats the call over gRPC, which gives the full
// validation and its errors. No GIL is taken on this path.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <dlfcn.h>
#include <errno.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <system_error>
#include <string>
#include <thread>
#include <set>
#include <unordered_map>
#include <vector>

#include "_nixl_capi.h"

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace py = pybind11;

namespace {

// ---- wire format (little endian; documented in kvservice/lane/wire.py) -------------------------
enum : uint32_t { MSG_SEND = 1, MSG_REPLY = 2, MSG_END = 3, MSG_SEND_TO = 4 };
enum : int32_t { REPLY_ACCEPTED = 0, REPLY_FALLBACK = 1 };
constexpr uint32_t FLAG_SRC_I64 = 2;  // SEND / SEND_TO flags: the source pages are i64 (lane_wire)
struct SendHdr {
  uint32_t type, seq, n_src, tid_len, bs_len, flags;
};
struct SendToHdr {  // SEND to another node's service: + the receiving service's address
  uint32_t type, seq, n_src, tid_len, bs_len, flags, addr_len;
};
// The cross-node lane's NIXL notifications (W: the sender wrote a chunk of a transfer's pages
// into the receiver's slot; C: the receiver unpacked a chunk that was not the last, its part of
// the slot is free again; A: the receiver unpacked the last chunk, or refused), binary, then tid
// and message. A delta larger than its slot streams through it in chunks (lane_cross_parts parts in turn).
struct XNote {
  char magic[4];
  uint32_t kind, rank, ok;
  uint64_t nbytes, npages;
  uint64_t first, off;  // W: the chunk's first page (of the delta) and its offset in the slot
  double at;  // CLOCK_MONOTONIC s when sent (one clock per host: the lane's timings, stats())
  uint32_t tid_len, msg_len;
};
constexpr char XMAGIC[4] = {'K', 'V', 'X', '2'};
// The scratch's first 1/XSMALL is where the lane thread packs the cross-node sends that fit it
// whole; the rest is the bulk thread's (streamed sends). A slot is at most half the receive
// staging, which is as large as the scratch: with 2, every one-WRITE send stays on the lane
// thread (as measured: no hand-off on the 64 MiB row) and only streamed ones move.
constexpr uint64_t XSMALL = 2;
enum : uint32_t { XNOTE_WRITTEN = 1, XNOTE_ACK = 2, XNOTE_CREDIT = 3 };
// A receiver that ended a transfer while the lane unpacked one of its chunks (Abort, deadline):
// the completion's error, which Python books as its own end (no END from the lane).
constexpr const char* CANCELLED = "cancelled by the receiving service";
struct ReplyHdr {
  uint32_t type, seq;
  int32_t code;
  uint32_t msg_len;
};
struct EndHdr {
  uint32_t type, role, state, tid_len, bs_len, msg_len;
  uint64_t nbytes, npages, skipped, copy_us;
};
constexpr size_t MAX_MSG = 256 * 1024;
constexpr uint32_t END_CROSS = 1;

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

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
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**) = nullptr;
  CUresult (*cuStreamSynchronize)(CUstream) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;
  CUresult (*cuEventCreate)(CUevent*, unsigned) = nullptr;
  CUresult (*cuEventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*cuEventSynchronize)(CUevent) = nullptr;
};

const char* KERNEL_SRC = R"(
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
  CUfunction fn = nullptr;
  char* host = nullptr;  // pinned
  CUdeviceptr dev = 0;
  size_t cap = 0;
  std::vector<Slot> ring;  // same-node copies launched and not yet seen done (launch_local)
};

struct RegionDesc {
  uint64_t base, stride, nbytes;
};

struct Pool {
  std::string owner;  // session id
  int device;         // -1: host memory
  int64_t num_pages;
  uint64_t sig;
  int rank;
  std::vector<RegionDesc> regions;
  uint64_t xsig = 0;  // layout and region geometry (the cross-node lane compares it with the receiver's)
  // heads (set_heads): mixed TP on the lane. hmode 0: no head slices (another page layout,
  // replicated heads); 1: token-major pages (NHD), 2: head-major (HND). msig: the layout but for
  // its TP; global heads [hlo, hlo + hn) of ``ps`` tokens a page.
  int hmode = 0, hlo = 0, hn = 0, ps = 0;
  uint64_t msig = 0;
  // another GPU -> each region's base as mapped in that GPU's context (an imported pool is mapped
  // only in the context that opened it: a kernel on another GPU needs its own opening)
  std::unordered_map<int, std::vector<uint64_t>> alias;
};

// ARMED: takes senders; RUNNING: every sender taken; COMPLETED: all copied (or one failed);
// GATED: disarmed while a copy was pending (takes no sender, goes once booked).
enum : int { ARMED = 1, RUNNING = 2, COMPLETED = 3, GATED = 4 };

struct Armed {  // one receiver rank's declaration
  int state = ARMED;
  std::string recv_session, recv_bs;
  int64_t prefix = 0;
  std::vector<int32_t> dst;
  double deadline = 0;
  int senders = 1;           // sender ranks it expects (mixed TP: several; 0: the first says)
  int pending = 0;           // copies taken and not yet booked by Python (forget)
  int done = 0;              // copies made
  int failed = 0;            // copies that failed
  std::string error;         // the first failure's
  uint64_t ranks = 0;        // sender ranks taken (bit per rank)
  uint64_t nbytes = 0;       // bytes copied into it
  bool told = false;         // its END went out
};

// A segment of a copy: one region of one receiver rank (the kernel's Region, 9 x u64).
struct Seg {
  uint64_t src, dst, src_stride, dst_stride, nbytes, run, src_run, dst_run, pairs;
};

struct Target {  // a receiver rank a same-node SEND copies into: all of it, or a head slice
  std::string akey;
  int rank = 0;
  Pool dp;
  std::vector<int32_t> dst;
  int hs = 0, hd = 0, nh = 0;  // nh 0: the whole page (equal layouts)
  int senders = 1;             // sender ranks this receiver rank has, by the layouts
};

struct Conn {
  int fd;
  std::string session;
};

// ---- cross-node lane (docs/design-notes.md §20) ---------------------------------------------
struct Arena {  // staging registered with this lane's NIXL agent: receive slots, then the scratch
  uint64_t base = 0, size = 0, scratch = 0;  // scratch: offset of the sender's packing area
  int device = -1;
};

struct XOut {  // a transfer the receiving service offered: its slot there
  int state = ARMED;
  int rank = 0;  // the receiver's rank
  std::string address, remote_agent;
  uint64_t raddr = 0, rbytes = 0, xsig = 0;
  int rdev = 0, rmem = 0;
  int64_t prefix = 0, ndst = 0;
  double deadline = 0;
};

struct XIn {  // a transfer this service declared and offered with a slot
  int state = ARMED;
  std::string recv_session, recv_bs, sender_agent;
  int64_t prefix = 0;
  std::vector<int32_t> dst;
  uint64_t slot = 0, bytes = 0;  // the slot: its address and size (a larger delta streams through it)
  uint64_t got = 0, us = 0;       // pages unpacked so far, and the µs it took
  bool cancel = false;            // ended by the receiver while a chunk was being unpacked
  int device = -1;
  double deadline = 0;
};

struct LocalCopy {  // an accepted same-node SEND, to copy (the lane thread, or the bulk thread)
  int fd = -1;
  uint32_t flags = 0;
  std::string tid, bs, session;
  Pool sp;
  std::vector<Target> tg;
  int64_t prefix = 0;
  std::vector<int32_t> src;
  uint32_t seq = 0;  // the SEND's: a GPU copy's REPLY goes once it is launched (copy_local)
  // CLOCK_MONOTONIC s: the SEND read, checked (targets), its copy launched, seen done (the END's trailer)
  double at_recv = 0, at_checked = 0, at_launch = 0, at_done = 0;
};

struct XSend {  // an accepted SEND_TO, to pack and write (the lane thread, or the bulk thread)
  Pool sp;
  XOut xo;
  std::string xk, tid;
  std::vector<int32_t> src;
  uint64_t scratch = 0, page = 0, chunk = 0;  // where it packs, a page's bytes, pages a chunk
  uint64_t parts = 2;                         // chunks in flight (stream_out)
};

struct XPend {  // written (or being written), waiting for the receiver's ack
  int fd = -1, rank = 0;
  std::string tid, session, bs, remote_agent;
  std::vector<int32_t> src;
  uint64_t nbytes = 0, npages = 0, prefix = 0, copy_us = 0;
  uint64_t credits = 0;  // chunks the receiver unpacked (a streamed transfer)
  uint32_t flags = 0;
  double deadline = 0;
  bool written = false, acked = false, ack_ok = false;
  std::string ack_msg;
};

struct Posted {  // a chunk's WRITE in flight (stream_out)
  void* req = nullptr;
  int state = 0;
  bool after = true;
  std::string rkey, msg;
};

enum : int { DONE_SAME_NODE = 0, DONE_SENT = 1, DONE_RECEIVED = 2 };

struct Completion {
  std::string tid, bs, sender_session, error;
  int kind = DONE_SAME_NODE;
  int rank = 0;
  bool ok = true;
  uint32_t flags = 0;
  uint64_t nbytes = 0, copy_us = 0;
  bool told_recv = false, told_send = false;  // END reached that engine's lane
  std::vector<int32_t> src;
  std::vector<int> ranks;   // same node: the receiver ranks copied into
  std::vector<int> told;    // ... and whether each one's END went out now (1) or not (0)
};

class Lane {
 public:
  Lane() {
    epfd_ = epoll_create1(EPOLL_CLOEXEC);
    wake_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    done_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (epfd_ < 0 || wake_ < 0 || done_ < 0) throw std::runtime_error("lane: epoll/eventfd failed");
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = wake_;
    epoll_ctl(epfd_, EPOLL_CTL_ADD, wake_, &ev);
    thread_ = std::thread([this] { run(); });
    bthread_ = std::thread([this] { bulk_run(); });
    fthread_ = std::thread([this] { finish_run(); });
  }
  ~Lane() { stop(); }

  void stop() {
    if (!running_.exchange(false)) return;
    uint64_t one = 1;
    (void)!write(wake_, &one, 8);
    if (thread_.joinable()) thread_.join();
    xcv_.notify_all();
    if (xthread_.joinable()) xthread_.join();
    {
      std::lock_guard<std::mutex> g(bulk_mu_);  // no lost wake-up between its check and its wait
    }
    bulk_cv_.notify_all();
    if (bthread_.joinable()) bthread_.join();
    {
      std::lock_guard<std::mutex> g(fin_mu_);  // what is in flight still ends (its END goes out)
      fin_running_ = false;
    }
    fin_cv_.notify_all();
    if (fthread_.joinable()) fthread_.join();
    close_nixl();
    std::lock_guard<std::mutex> g(mu_);
    for (auto& kv : conns_) close(kv.first);
    conns_.clear();
  }

  int completion_fd() const { return done_; }

  // Bytes of one page region a CUDA block copies (config lane_cuda_chunk_kb; a multiple of 16).
  void set_chunk(unsigned bytes) { chunk_ = std::max(16u, bytes & ~15u); }
  // µs the lane thread polls without sleeping after a message (config lane_spin_us; 0: never).
  void set_spin_us(unsigned us) { spin_us_ = us; }
  // Between two GPUs the kernel runs on the receiver's GPU (pull) or the sender's (push, default).
  void set_pull(bool pull) { pull_ = pull; }
  int launch_device(const Pool& sp, const Pool& dp) const { return pull_ ? dp.device : sp.device; }

  // CUDA: load the driver and NVRTC (paths chosen by Python); false + why() when unavailable.
  bool init_cuda(const std::string& libcuda, const std::string& libnvrtc) {
    std::lock_guard<std::mutex> g(cuda_mu_);
    if (cuda_.ok) return true;
    void* h = dlopen(libcuda.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (!h) return fail(std::string("dlopen ") + libcuda + ": " + dlerror());
#define SYM(name, sym)                                                       \
  *(void**)(&cuda_.name) = dlsym(h, sym);                                    \
  if (!cuda_.name) return fail(std::string("libcuda lacks ") + sym);
    SYM(cuInit, "cuInit") SYM(cuDeviceGet, "cuDeviceGet") SYM(cuDeviceGetAttribute, "cuDeviceGetAttribute")
    SYM(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain") SYM(cuCtxSetCurrent, "cuCtxSetCurrent")
    SYM(cuModuleLoadData, "cuModuleLoadData") SYM(cuModuleGetFunction, "cuModuleGetFunction")
    SYM(cuStreamCreate, "cuStreamCreate") SYM(cuMemAlloc, "cuMemAlloc_v2") SYM(cuMemFree, "cuMemFree_v2")
    SYM(cuMemAllocHost, "cuMemAllocHost_v2") SYM(cuMemFreeHost, "cuMemFreeHost")
    SYM(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2") SYM(cuLaunchKernel, "cuLaunchKernel")
    SYM(cuStreamSynchronize, "cuStreamSynchronize") SYM(cuGetErrorString, "cuGetErrorString")
    SYM(cuEventCreate, "cuEventCreate") SYM(cuEventRecord, "cuEventRecord")
    SYM(cuEventSynchronize, "cuEventSynchronize")
#undef SYM
    void* n = dlopen(libnvrtc.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!n) return fail(std::string("dlopen ") + libnvrtc + ": " + dlerror());
#define NSYM(name, sym)                                   \
  *(void**)(&nvrtc_.name) = dlsym(n, sym);                \
  if (!nvrtc_.name) return fail(std::string("libnvrtc lacks ") + sym);
    NSYM(create, "nvrtcCreateProgram") NSYM(compile, "nvrtcCompileProgram") NSYM(ptx_size, "nvrtcGetPTXSize")
    NSYM(ptx, "nvrtcGetPTX") NSYM(log_size, "nvrtcGetProgramLogSize") NSYM(log, "nvrtcGetProgramLog")
    NSYM(destroy, "nvrtcDestroyProgram")
#undef NSYM
    if (cuda_.cuInit(0) != 0) return fail("cuInit failed");
    cuda_.ok = true;
    return true;
  }
  std::string cuda_why() const { return cuda_.why; }

  // Prepare device ``dev`` (context, stream, kernel); called by Python before the first arm there.
  void prepare_device(int dev) {
    std::lock_guard<std::mutex> g(cuda_mu_);
    device(dev);
  }

  void add_conn(int fd, const std::string& session) {
    std::lock_guard<std::mutex> g(mu_);
    conns_[fd] = Conn{fd, session};
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.fd = fd;
    if (epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
      conns_.erase(fd);
      throw std::runtime_error("lane: epoll_ctl failed");
    }
  }

  void drop_session(const std::string& session) {
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = conns_.begin(); it != conns_.end();) {
      if (it->second.session == session) {
        epoll_ctl(epfd_, EPOLL_CTL_DEL, it->first, nullptr);
        close(it->first);
        it = conns_.erase(it);
      } else {
        ++it;
      }
    }
  }

  int conns() {
    std::lock_guard<std::mutex> g(mu_);
    return (int)conns_.size();
  }

  void add_pool(const std::string& bs, const std::string& owner, int device, int64_t num_pages, uint64_t sig,
                int rank, py::array_t<uint64_t, py::array::c_style | py::array::forcecast> regions,
                uint64_t xsig) {
    if (regions.ndim() != 2 || regions.shape(1) != 3) throw std::invalid_argument("regions: want [n, 3]");
    Pool p{owner, device, num_pages, sig, rank, {}};
    p.xsig = xsig;
    auto r = regions.unchecked<2>();
    for (py::ssize_t i = 0; i < r.shape(0); ++i) p.regions.push_back({r(i, 0), r(i, 1), r(i, 2)});
    std::lock_guard<std::mutex> g(mu_);
    pools_[bs] = std::move(p);
  }

  // Bases of pool ``bs``'s regions in GPU ``device``'s context: kernels there may write it.
  void set_alias(const std::string& bs, int device,
                 py::array_t<uint64_t, py::array::c_style | py::array::forcecast> bases) {
    std::lock_guard<std::mutex> g(mu_);
    auto p = pools_.find(bs);
    if (p == pools_.end()) return;
    if ((size_t)bases.size() != p->second.regions.size()) throw std::invalid_argument("bases: one per region");
    p->second.alias[device].assign(bases.data(), bases.data() + bases.size());
  }

  void drop_pool(const std::string& bs) {
    std::lock_guard<std::mutex> g(mu_);
    pools_.erase(bs);
  }

  // Pool ``bs``'s heads, for head slices between TP sizes (see Pool::hmode).
  void set_heads(const std::string& bs, int hmode, uint64_t msig, int hlo, int hn, int ps) {
    std::lock_guard<std::mutex> g(mu_);
    auto p = pools_.find(bs);
    if (p == pools_.end()) return;
    Pool& q = p->second;
    q.hmode = hmode, q.msig = msig, q.hlo = hlo, q.hn = hn, q.ps = ps;
  }

  void arm(const std::string& tid, int rank, const std::string& recv_session, const std::string& recv_bs,
           int64_t prefix, py::array_t<int32_t, py::array::c_style | py::array::forcecast> dst, double deadline,
           int senders) {
    Armed a;
    a.recv_session = recv_session;
    a.recv_bs = recv_bs;
    a.prefix = prefix;
    a.dst.assign(dst.data(), dst.data() + dst.size());
    a.deadline = deadline;
    a.senders = std::max(0, senders);
    std::lock_guard<std::mutex> g(mu_);
    const std::string k = key(tid, rank);
    if (!armed_.count(k)) by_tid_[tid].push_back(rank);
    armed_[k] = std::move(a);
  }

  // Disarm: 0 = nothing armed, 1 = was armed and is no more (no copy of it is pending: one
  // booked before stays booked); 2 = the lane is copying or has copied into it and Python's
  // finalize is pending: the caller must wait for that completion (it takes no sender now).
  int disarm(const std::string& tid, int rank) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = armed_.find(key(tid, rank));
    if (it == armed_.end()) return 0;
    if (it->second.pending == 0) {
      unarm(it, tid, rank);
      return 1;
    }
    if (it->second.state == ARMED) it->second.state = GATED;
    return 2;
  }

  // Python's finalize of a completion booked a copy into (tid, rank): the copies still pending
  // there; the entry goes with its last one unless it still takes senders.
  int forget(const std::string& tid, int rank) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = armed_.find(key(tid, rank));
    if (it == armed_.end()) return 0;
    Armed& a = it->second;
    a.pending = std::max(0, a.pending - 1);
    const int left = a.pending;
    if (left == 0 && a.state != ARMED) unarm(it, tid, rank);
    return left;
  }

  size_t armed_count() {
    std::lock_guard<std::mutex> g(mu_);
    return armed_.size();
  }

  // mu_ held: the entry goes, and its rank from its transfer's list.
  void unarm(std::unordered_map<std::string, Armed>::iterator it, const std::string& tid, int rank) {
    armed_.erase(it);
    auto t = by_tid_.find(tid);
    if (t == by_tid_.end()) return;
    auto& v = t->second;
    v.erase(std::remove(v.begin(), v.end(), rank), v.end());
    if (v.empty()) by_tid_.erase(t);
  }


  // ---- cross-node lane: set-up (Python) -------------------------------------------------------
  // NIXL's C API from ``capi`` and one agent ``name`` with a UCX backend; false + nixl_why().
  bool init_nixl(const std::string& capi, const std::string& name) {
    std::lock_guard<std::mutex> g(nx_mu_);
    if (agent_) return true;
    if (!nx_.ok && !nx_.load(capi)) return false;
    xnixl::AgentConfig cfg;  // no progress thread: this lane's threads poll (they hold the work)
    if (nx_.create_configured_agent(name.c_str(), &cfg, &agent_) != xnixl::OK)
      return nx_.fail("creating the NIXL agent failed");
    void *mems = nullptr, *params = nullptr;
    int r = nx_.get_plugin_params(agent_, "UCX", &mems, &params);
    if (r == xnixl::OK) r = nx_.create_backend(agent_, "UCX", params, &backend_);
    if (mems) nx_.destroy_mem_list(mems);
    if (params) nx_.destroy_params(params);
    if (r != xnixl::OK) {
      nx_.destroy_agent(agent_);
      agent_ = nullptr;
      return nx_.fail("NIXL's UCX backend failed (" + std::to_string(r) + ")");
    }
    xthread_ = std::thread([this] { xrun(); });
    return true;
  }
  std::string nixl_why() const { return nx_.why; }

  // Staging on ``device`` (-1: host memory) registered with the agent: ``in_bytes`` of receive
  // slots (Python allocates them), then ``scratch_bytes`` where this lane packs what it sends.
  uint64_t add_arena(int device, uint64_t in_bytes, uint64_t scratch_bytes) {
    if (!agent_) throw std::runtime_error("lane: no NIXL agent");
    Arena a;
    a.device = device;
    a.size = in_bytes + scratch_bytes;
    a.scratch = in_bytes;
    if (device >= 0) {
      std::lock_guard<std::mutex> g(cuda_mu_);
      device_ctx(device);
      CUdeviceptr p = 0;
      CUresult r = cuda_.cuMemAlloc(&p, a.size);
      if (r) throw std::runtime_error("lane: staging: " + cu_err(r));
      a.base = p;
    } else {
      void* p = nullptr;
      // mapped, not touched: a page costs memory only once a transfer writes it
      p = mmap(nullptr, a.size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) throw std::runtime_error("lane: staging: out of memory");
      a.base = (uint64_t)p;
    }
    std::string err = nx_register(a, true);
    if (!err.empty()) {
      free_arena(a);
      throw std::runtime_error("lane: registering staging with NIXL: " + err);
    }
    std::lock_guard<std::mutex> g(mu_);
    arenas_[device] = a;
    return a.base;
  }

  py::bytes local_md() {
    void* data = nullptr;
    size_t len = 0;
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> g(nx_mu_);
      if (!agent_ || nx_.get_local_md(agent_, &data, &len) != xnixl::OK) throw std::runtime_error("lane: no NIXL metadata");
    }
    py::bytes out((const char*)data, len);
    free(data);
    return out;
  }

  // A peer lane's metadata: its agent name (this lane writes to it and notifies it).
  std::string load_md(const std::string& md) {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> g(nx_mu_);
    char* name = nullptr;
    int r = agent_ ? nx_.load_remote_md(agent_, md.data(), md.size(), &name) : -1;
    if (r != xnixl::OK || !name) throw std::runtime_error("lane: loading a peer's NIXL metadata failed (" + std::to_string(r) + ")");
    std::string out(name);
    free(name);
    return out;
  }

  // The receiving service offered ``tid`` with a slot: an engine here may now SEND_TO it.
  // Python's answer for an offer without a lane slot: a SEND_TO parked for it goes to gRPC now.
  void refuse_out(const std::string& tid, int rank) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = parked_.find(key(tid, rank));
    if (it == parked_.end()) return;
    it->second.until = 0;  // the lane thread answers FALLBACK
    kick();
  }

  void arm_out(const std::string& tid, int rank, const std::string& address, const std::string& remote_agent,
               uint64_t raddr, uint64_t rbytes, int rdev, int rmem, uint64_t xsig, int64_t prefix, int64_t ndst,
               double deadline) {
    XOut x;
    x.rank = rank;
    x.address = address;
    x.remote_agent = remote_agent;
    x.raddr = raddr;
    x.rbytes = rbytes;
    x.rdev = rdev;
    x.rmem = rmem;
    x.xsig = xsig;
    x.prefix = prefix;
    x.ndst = ndst;
    x.deadline = deadline;
    std::lock_guard<std::mutex> g(mu_);
    lane_peers_.insert(address);
    const std::string k = key(tid, rank);  // the sender's rank is the receiver's (one layout)
    xout_[k] = std::move(x);
    if (parked_.count(k)) kick();  // its SEND_TO came first: the lane thread takes it now
  }
  int disarm_out(const std::string& tid, int rank) { return disarm_of(xout_, key(tid, rank)); }
  void forget_out(const std::string& tid, int rank) {
    std::lock_guard<std::mutex> g(mu_);
    xout_.erase(key(tid, rank));
  }

  // This service declared ``tid`` and offered slot ``slot`` (``bytes``) to ``sender_agent``.
  void arm_in(const std::string& tid, int rank, const std::string& recv_session, const std::string& recv_bs,
              const std::string& sender_agent, int64_t prefix,
              py::array_t<int32_t, py::array::c_style | py::array::forcecast> dst, uint64_t slot, uint64_t bytes,
              int device, double deadline) {
    XIn x;
    x.recv_session = recv_session;
    x.recv_bs = recv_bs;
    x.sender_agent = sender_agent;
    x.prefix = prefix;
    x.dst.assign(dst.data(), dst.data() + dst.size());
    x.slot = slot;
    x.bytes = bytes;
    x.device = device;
    x.deadline = deadline;
    {
      std::lock_guard<std::mutex> g(mu_);
      xin_[key(tid, rank)] = std::move(x);
    }
    xcv_.notify_one();
  }
  // 1 (gone): no chunk is unpacked after this returns; 2: a chunk is being unpacked, or all
  // were: ``cancel`` ends a streamed one after that chunk (a completion with CANCELLED), else it
  // goes on (a gRPC sender is refused meanwhile).
  int disarm_in(const std::string& tid, int rank, bool cancel) {
    return disarm_of(xin_, key(tid, rank), [cancel](XIn& x) { x.cancel |= cancel && x.state == RUNNING; });
  }
  void forget_in(const std::string& tid, int rank) {
    std::lock_guard<std::mutex> g(mu_);
    xin_.erase(key(tid, rank));
  }
  // sent, pack µs, post µs, wait µs, W-note µs, ack µs, received, unpack µs, re-posts, CUDA copies,
  // their µs waiting for the device lock, and in cuStreamSynchronize (cumulative)
  std::vector<uint64_t> stats() {
    std::vector<uint64_t> out;
    for (auto& s : st_) out.push_back(s.load());
    return out;
  }
  void set_req_cache(bool on) { req_cache_ = on; }
  void set_note_after(bool on) { note_after_ = on; }
  // Chunks of a streamed cross-node send in flight (config lane_cross_parts): the slot and the
  // scratch split in this many parts.
  void set_parts(unsigned parts) { parts_ = std::min(16u, std::max(2u, parts)); }
  // Fault injection for tests: each cross-node unpack starts ``us`` late (a slow receiver).
  void set_slow_unpack(unsigned us) { slow_unpack_us_ = us; }

  size_t cross_count() {
    std::lock_guard<std::mutex> g(mu_);
    return xout_.size() + xin_.size() + xpend_.size();
  }

  py::list drain() {
    uint64_t v;
    (void)!read(done_, &v, 8);  // first: a completion queued after the swap signals again
    std::deque<Completion> got;
    {
      std::lock_guard<std::mutex> g(mu_);
      got.swap(completions_);
    }
    py::list out;
    for (auto& c : got) {
      py::array_t<int32_t> src(c.src.size());
      if (!c.src.empty()) std::memcpy(src.mutable_data(), c.src.data(), c.src.size() * 4);
      out.append(py::make_tuple(c.tid, c.rank, c.bs, c.sender_session, src, c.ok, c.error, c.nbytes, c.copy_us,
                                c.flags, c.told_recv, c.told_send, py::cast(c.ranks), py::cast(c.told), c.kind));
    }
    return out;
  }

 private:
  static std::string key(const std::string& tid, int rank) { return tid + '\0' + std::to_string(rank); }

  bool fail(const std::string& why) {
    cuda_.why = why;
    return false;
  }

  std::string cu_err(CUresult r) {
    const char* s = nullptr;
    if (cuda_.cuGetErrorString) cuda_.cuGetErrorString(r, &s);
    return std::string("CUDA error ") + std::to_string(r) + (s ? std::string(": ") + s : "");
  }

  DeviceLane& device(int dev) {  // cuda_mu_ held
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
    std::string arch = "--gpu-architecture=compute_" + std::to_string(major * 10 + minor);
    const char* opts[] = {arch.c_str(), "-default-device"};
    void* prog = nullptr;
    if (nvrtc_.create(&prog, KERNEL_SRC, "lane_copy.cu", 0, nullptr, nullptr) != 0)
      throw std::runtime_error("lane: nvrtcCreateProgram failed");
    if (nvrtc_.compile(prog, 2, opts) != 0) {
      size_t n = 0;
      nvrtc_.log_size(prog, &n);
      std::string log(n, '\0');
      nvrtc_.log(prog, &log[0]);
      nvrtc_.destroy(&prog);
      throw std::runtime_error("lane: NVRTC: " + log);
    }
    size_t n = 0;
    nvrtc_.ptx_size(prog, &n);
    std::string ptx(n, '\0');
    nvrtc_.ptx(prog, &ptx[0]);
    nvrtc_.destroy(&prog);
    CUmodule mod;
    if ((r = cuda_.cuModuleLoadData(&mod, ptx.c_str())) || (r = cuda_.cuModuleGetFunction(&d.fn, mod, "lane_copy")) ||
        (r = cuda_.cuStreamCreate(&d.stream, 1 /* CU_STREAM_NON_BLOCKING */)))
      throw std::runtime_error("lane: kernel load: " + cu_err(r));
    grow(d, 1 << 16);
    return devs_.emplace(dev, d).first->second;
  }

  void grow(DeviceLane& d, size_t need) { grow(d.host, d.dev, d.cap, need); }

  // Descriptor buffers (pinned host, device) of at least ``need`` bytes.
  void grow(char*& host, CUdeviceptr& dev, size_t& cap_, size_t need) {
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

  void run() {
    std::vector<char> buf(MAX_MSG);
    epoll_event evs[64];
    double busy = 0;  // when this thread last handled a message
    while (running_) {
      // NOTE: within spin_us_ of the last message the thread polls without sleeping: a sleeping
      // thread's wake-up on an idle core of the GPU host cost tens of µs per hop
      // (bench/probe_lane.py), the whole budget of a small transfer
      const bool spin = spin_us_ && (now_s() - busy) * 1e6 < spin_us_;
      int n = epoll_wait(epfd_, evs, 64, spin ? 0 : parked_count_ ? 1 : -1);
      if (n < 0 && errno == EINTR) continue;
      if (n > 0 && spin_us_) busy = now_s();
      if (parked_count_) unpark();
      for (int i = 0; i < n && running_; ++i) {
        int fd = evs[i].data.fd;
        if (fd == wake_) {
          uint64_t v;
          (void)!read(wake_, &v, 8);
          continue;
        }
        ssize_t got = recv(fd, buf.data(), buf.size(), MSG_DONTWAIT);
        at_msg_ = now_s();
        if (got < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (got <= 0 || (evs[i].events & (EPOLLHUP | EPOLLERR))) {
          closed(fd);
          continue;
        }
        handle(fd, buf.data(), (size_t)got);
      }
    }
  }

  void closed(int fd) {
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = parked_.begin(); it != parked_.end();) it = it->second.fd == fd ? parked_.erase(it) : std::next(it);
    parked_count_ = parked_.size();
    if (conns_.erase(fd)) {
      epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr);
      close(fd);
    }
  }

  // mu_ held: ``m`` to connection ``fd`` if it is still one of ``session``'s (the number of a
  // closed connection may belong to another engine's by now: it gets nothing).
  bool tell(int fd, const std::string& session, const std::string& m) {
    auto c = conns_.find(fd);
    return c != conns_.end() && c->second.session == session && sendmsg_(fd, m);
  }

  static bool sendmsg_(int fd, const std::string& m) {
    return send(fd, m.data(), m.size(), MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)m.size();
  }

  static void reply(int fd, uint32_t seq, int32_t code, const std::string& msg) {
    ReplyHdr h{MSG_REPLY, seq, code, (uint32_t)msg.size()};
    std::string m((const char*)&h, sizeof h);
    sendmsg_(fd, m + msg);
  }

  static std::string end_msg(uint32_t role, bool ok, const std::string& tid, const std::string& bs,
                             const std::string& err, uint64_t nbytes, uint64_t npages, uint64_t skipped,
                             uint64_t us, uint32_t flags = 0, const LocalCopy* at = nullptr) {
    EndHdr h{MSG_END, role, ok ? 0u : 1u, (uint32_t)tid.size(), (uint32_t)bs.size(), (uint32_t)err.size(),
             nbytes, npages, skipped, us};
    // trailing u32 flags (END_CROSS: the cross-node lane moved it); older readers stop at msg.
    // A same-node copy's END then carries its timeline (f64 CLOCK_MONOTONIC s: SEND read, SEND
    // checked, copy launched, copy seen done, END sent), for bench/probe_lane.py; readers ignore it.
    std::string m = std::string((const char*)&h, sizeof h) + tid + bs + err + std::string((const char*)&flags, 4);
    if (at) {
      const double t[5] = {at->at_recv, at->at_checked, at->at_launch, at->at_done, now_s()};
      m.append((const char*)t, sizeof t);
    }
    return m;
  }

  // A SEND's source pages, i32 or (FLAG_SRC_I64) i64 on the wire; false: one is outside i32 (the
  // SDK sends i64 unchecked: its numpy range check cost ~20 µs a call, the service checks anyway)
  static bool read_src(const char* q, uint32_t n, uint64_t w, std::vector<int32_t>& out) {
    out.resize(n);
    if (w == 4) {
      if (n) std::memcpy(out.data(), q, 4ull * n);
      return true;
    }
    bool ok = true;
    for (uint32_t i = 0; i < n; ++i) {
      int64_t v;
      std::memcpy(&v, q + 8ull * i, 8);
      ok &= v >= INT32_MIN && v <= INT32_MAX;
      out[i] = (int32_t)v;
    }
    return ok;
  }

  void handle(int fd, const char* p, size_t n) {
    if (n < sizeof(SendHdr)) return closed(fd);  // not our protocol: drop the connection
    SendHdr h;
    std::memcpy(&h, p, sizeof h);
    if (h.type == MSG_SEND_TO) return handle_x(fd, p, n);
    const uint64_t w = h.flags & FLAG_SRC_I64 ? 8 : 4;
    if (h.type != MSG_SEND || (uint64_t)sizeof h + h.tid_len + h.bs_len + w * h.n_src != n) return closed(fd);
    std::string tid(p + sizeof h, h.tid_len), bs(p + sizeof h + h.tid_len, h.bs_len);
    std::vector<int32_t> src;
    if (!read_src(p + sizeof h + h.tid_len + h.bs_len, h.n_src, w, src))
      return reply(fd, h.seq, REPLY_FALLBACK, "source page out of range");

    std::string session, why;
    LocalCopy job;
    job.at_recv = at_msg_;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto c = conns_.find(fd);
      if (c == conns_.end()) return;
      session = c->second.session;
      auto ps = pools_.find(bs);
      if (ps == pools_.end() || ps->second.owner != session) {
        why = "buffer set not on the lane";
      } else {
        job.sp = ps->second;
        why = targets(tid, job.sp, src, job.tg, job.prefix);
      }
      if (why.empty()) {
        const uint64_t bit = 1ull << (job.sp.rank & 63);
        for (auto& t : job.tg) {  // taken: atomic with the checks (a disarm sees it pending)
          Armed& a = armed_.at(t.akey);
          a.senders = t.senders;
          a.pending++;
          a.ranks |= bit;
          if (__builtin_popcountll(a.ranks) >= a.senders) a.state = RUNNING;
        }
      }
    }
    if (!why.empty()) return reply(fd, h.seq, REPLY_FALLBACK, why);
    job.at_checked = now_s();
    job.seq = h.seq;
    if (job.sp.device < 0) reply(fd, h.seq, REPLY_ACCEPTED, "");  // a host copy may take ms: heard first
    job.fd = fd;
    job.flags = h.flags;
    job.tid = tid;
    job.bs = bs;
    job.session = session;
    job.src = std::move(src);
    uint64_t bytes = 0;
    for (auto& r : job.sp.regions) bytes += r.nbytes * (job.src.size() - (size_t)job.prefix);
    if (bytes < LOCAL_BULK_BYTES || job.sp.device >= 0) return copy_local(job);
    to_bulk([this, job]() mutable { copy_local(job); });
  }

  // mu_ held: the receiver ranks of ``tid`` armed here that sender pool ``sp`` copies into, each
  // checked (or why not: the engine's SDK then makes the gRPC call). Equal layouts: the rank of
  // the sender's rank, whole pages. Mixed TP (Pool::hmode): every armed rank whose heads overlap
  // the sender's, and together they must hold all of the sender's heads.
  //
  //   H = 8, sender TP 4 -> receiver TP 2:   sender 1 holds heads 2-3; receiver 0 holds 0-3
  //     head slice: nh = 2 heads, from the sender's local head hs = 0 to the receiver's hd = 2
  std::string targets(const std::string& tid, const Pool& sp, const std::vector<int32_t>& src,
                      std::vector<Target>& tg, int64_t& prefix) {
    auto ranks = by_tid_.find(tid);
    if (ranks == by_tid_.end()) return "transfer not armed";
    int covered = 0;
    bool whole = false, other = false;
    const double now = now_s();
    for (int rank : ranks->second) {
      auto ai = armed_.find(key(tid, rank));
      if (ai == armed_.end()) continue;
      Armed& a = ai->second;
      auto pd = pools_.find(a.recv_bs);
      if (pd == pools_.end()) return "receiver buffer set gone";
      const Pool& dp = pd->second;
      Target t;
      if (dp.sig == sp.sig) {
        if (rank != sp.rank) continue;
        whole = true;
      } else if (sp.hmode && sp.hmode == dp.hmode && sp.msig == dp.msig) {
        const int lo = std::max(sp.hlo, dp.hlo), hi = std::min(sp.hlo + sp.hn, dp.hlo + dp.hn);
        if (lo >= hi) continue;
        if (sp.hn % dp.hn && dp.hn % sp.hn) return "the two TP sizes' heads per rank do not nest";
        t.hs = lo - sp.hlo, t.hd = lo - dp.hlo, t.nh = hi - lo;
        t.senders = std::max(1, dp.hn / sp.hn);  // nested: every sender rank's heads in one receiver
        covered += t.nh;
      } else {
        other = true;
        continue;
      }
      if (a.state != ARMED) return "transfer not armed";
      if (now > a.deadline) return "transfer deadline passed";
      if (a.ranks & (1ull << (sp.rank & 63))) return "this sender rank sent it already";
      if (a.senders && a.senders != t.senders) return "expected_senders differs from the layouts";
      std::string why = check(sp, dp, a, src, t.nh);
      if (!why.empty()) return why;
      if (!tg.empty() && (a.prefix != prefix || dp.device != tg[0].dp.device))
        return "receiver ranks differ in prefix or device";
      prefix = a.prefix;
      t.akey = key(tid, rank);
      t.rank = rank;
      t.dp = dp;
      t.dst = a.dst;
      tg.push_back(std::move(t));
    }
    if (tg.empty()) return other ? "layouts differ" : "transfer not armed";
    if (!whole && covered != sp.hn) return "not every receiver rank of its heads is armed here";
    return pages_ok(sp, src);
  }

  // A larger same-node copy of host pools goes to the bulk thread: the lane thread keeps
  // answering (a 256 MiB host copy takes ~25 ms). GPU copies stay here (2 GiB is ~1.4 ms on one
  // GPU, and the hand-off would land on the same-node 2 GiB row, a goal still missed).
  static constexpr uint64_t LOCAL_BULK_BYTES = 16ull << 20;

  // An accepted same-node SEND: one copy into every target, then END to the sender and to each
  // receiver rank that has all its senders now, and the completion for Python.
  void copy_local(LocalCopy& job) {
    const Pool& sp = job.sp;
    const int64_t prefix = job.prefix;
    const std::vector<int32_t>& src = job.src;
    // The copy: src[prefix + i] -> target's dst[i] for every region of every target.
    const size_t moved = src.size() - (size_t)prefix, nt = job.tg.size();
    std::vector<int32_t> pairs(2 * moved * nt);
    for (size_t t = 0; t < nt; ++t) {
      const std::vector<int32_t>& dst = job.tg[t].dst;
      int32_t* pr = pairs.data() + 2 * moved * t;
      for (size_t i = 0; i < moved; ++i) {
        pr[2 * i] = src[(size_t)prefix + i];
        pr[2 * i + 1] = dst[i];
      }
    }
    std::vector<Seg> segs;
    std::string err;
    try {
      segs = segments(sp, job.tg, moved);
    } catch (const std::exception& e) {
      err = e.what();
    }
    uint64_t nbytes = 0;
    for (auto& g : segs) nbytes += g.nbytes * moved;
    double t0 = now_s();
    if (sp.device >= 0) {  // a GPU copy's sender hears once it is queued (or how it failed, from its END)
      const int fd = job.fd;
      const uint32_t seq = job.seq;
      if (err.empty()) err = launch_local(job, segs, pairs, moved, nbytes, t0);  // the finisher ends it
      reply(fd, seq, REPLY_ACCEPTED, "");
      if (err.empty()) return;
    } else if (err.empty()) {
      err = copy_segs(sp.device, job.tg[0].dp.device, segs, pairs, moved);
    }
    if (!job.at_launch) job.at_launch = t0;
    job.at_done = now_s();
    end_local(job, err, (uint64_t)((now_s() - t0) * 1e6), nbytes, moved);
  }

  // A GPU copy launched, not waited for: the lane thread takes the next SEND while it runs (a
  // TP 4 -> 2 transfer's four SENDs queue four kernels back to back); the finisher thread waits
  // for its event and ends it (end_local). Each launch in flight holds a slot of descriptor
  // buffers, so a later launch never overwrites the table an earlier one still reads.
  struct InFlight {
    LocalCopy job;
    int device = 0, slot = 0;
    uint64_t nbytes = 0;
    size_t moved = 0;
    double t0 = 0;
  };
  static constexpr size_t RING = 8;

  std::string launch_local(LocalCopy& job, const std::vector<Seg>& segs, const std::vector<int32_t>& pairs,
                           size_t moved, uint64_t nbytes, double t0) {
    const size_t nr = segs.size();
    if (moved == 0 || nr == 0) {  // nothing to copy: ends at once
      end_local(job, "", 0, 0, moved);
      return "";
    }
    const int on = launch_device(job.sp, job.tg[0].dp);
    int si = -1;
    try {
      std::unique_lock<std::mutex> g(fin_mu_);  // a free slot (the finisher frees them)
      fin_cv_.wait(g, [&] {
        if (!running_) return true;
        std::lock_guard<std::mutex> c(cuda_mu_);
        DeviceLane& d = device(on);
        if (d.ring.size() < RING) d.ring.resize(RING);
        for (size_t i = 0; i < d.ring.size(); ++i)
          if (!d.ring[i].busy) return (si = (int)i) >= 0;
        return false;
      });
    } catch (const std::exception& e) {
      return e.what();
    }
    if (si < 0) return "lane: stopping";
    try {
      std::lock_guard<std::mutex> g(cuda_mu_);
      st_[S_COPIES]++;
      DeviceLane& d = device(on);
      Slot& sl = d.ring[(size_t)si];
      CUresult r;
      if ((r = cuda_.cuCtxSetCurrent(d.ctx))) return cu_err(r);
      grow(sl.host, sl.dev, sl.cap, nr * sizeof(Seg) + pairs.size() * 4);
      if (!sl.ev && (r = cuda_.cuEventCreate(&sl.ev, 2 /* CU_EVENT_DISABLE_TIMING */))) return cu_err(r);
      std::string err = launch(d, sl.host, sl.dev, segs, pairs, moved);
      if (err.empty() && (r = cuda_.cuEventRecord(sl.ev, d.stream))) err = cu_err(r);
      job.at_launch = now_s();
      if (!err.empty()) {  // what was queued may still read the slot or write pages: wait it out
        cuda_.cuStreamSynchronize(d.stream);
        return err;
      }
      sl.busy = true;
    } catch (const std::exception& e) {
      return e.what();
    }
    {
      std::lock_guard<std::mutex> g(fin_mu_);
      fin_q_.push_back(InFlight{std::move(job), on, si, nbytes, moved, t0});
    }
    fin_cv_.notify_all();
    return "";
  }

  // cuda_mu_ held, ``d``'s context current: the segments and pairs up through ``host`` (pinned)
  // to ``dev`` (both large enough), then the kernel, on ``d``'s stream.
  std::string launch(DeviceLane& d, char* host, CUdeviceptr dev, const std::vector<Seg>& segs,
                     const std::vector<int32_t>& pairs, size_t moved) {
    const size_t nr = segs.size(), rbytes = nr * sizeof(Seg), need = rbytes + pairs.size() * 4;
    uint64_t maxb = 0;
    int vec = 1;
    std::memcpy(host, segs.data(), rbytes);
    for (auto& x : segs) {
      if ((x.src | x.dst | x.src_stride | x.dst_stride | x.nbytes | x.run | x.src_run | x.dst_run) & 15) vec = 0;
      if (x.nbytes > maxb) maxb = x.nbytes;
    }
    std::memcpy(host + rbytes, pairs.data(), pairs.size() * 4);
    unsigned chunk = chunk_;
    unsigned zc = (unsigned)((maxb + chunk - 1) / chunk);
    if (zc > 65535 || nr > 65535) return "lane: pages or regions too large for one launch";
    CUresult r;
    if ((r = cuda_.cuMemcpyHtoDAsync(dev, host, need, d.stream))) return cu_err(r);
    CUdeviceptr regs = dev, prs = dev + rbytes;
    void* args[] = {&regs, &prs, &vec, &chunk};
    if ((r = cuda_.cuLaunchKernel(d.fn, (unsigned)moved, (unsigned)nr, zc, 256, 1, 1, 0, d.stream, args, nullptr)))
      return cu_err(r);
    return "";
  }

  // The finisher thread: each launched copy in launch order, once its event completed.
  void finish_run() {
    for (;;) {
      InFlight f;
      {
        std::unique_lock<std::mutex> g(fin_mu_);
        fin_cv_.wait(g, [&] { return !fin_q_.empty() || !fin_running_; });
        if (fin_q_.empty()) return;
        f = std::move(fin_q_.front());
        fin_q_.pop_front();
      }
      std::string err;
      CUevent ev = nullptr;
      {
        std::lock_guard<std::mutex> c(cuda_mu_);
        DeviceLane& d = device(f.device);
        ev = d.ring[(size_t)f.slot].ev;
        CUresult r = cuda_.cuCtxSetCurrent(d.ctx);
        if (r) err = cu_err(r);
      }
      const double t_sync = now_s();
      if (err.empty()) {
        CUresult r = cuda_.cuEventSynchronize(ev);  // outside cuda_mu_: launches go on meanwhile
        if (r) err = cu_err(r);
      }
      stat(S_CUSYNC, t_sync);
      f.job.at_done = now_s();
      {
        std::lock_guard<std::mutex> c(cuda_mu_);
        device(f.device).ring[(size_t)f.slot].busy = false;
      }
      {
        std::lock_guard<std::mutex> g(fin_mu_);  // a launch waiting for a slot
      }
      fin_cv_.notify_all();
      try {
        end_local(f.job, err, (uint64_t)((now_s() - f.t0) * 1e6), f.nbytes, f.moved);
      } catch (const std::exception&) {  // (out of memory) the transfer's deadline ends it
      }
    }
  }

  // END to the sender and to each receiver rank that has all its senders now (or a failure),
  // then the completion for Python.
  void end_local(LocalCopy& job, const std::string& err, uint64_t us, uint64_t nbytes, size_t moved) {
    const int fd = job.fd;
    const std::string &tid = job.tid, &bs = job.bs, &session = job.session;
    const Pool& sp = job.sp;
    const int64_t prefix = job.prefix;
    const size_t nt = job.tg.size();
    const bool ok = err.empty();
    const uint64_t each = nt ? nbytes / nt : 0;

    Completion done;
    {
      std::lock_guard<std::mutex> g(mu_);
      // END to the engines first (receivers, then sender); Python's bookkeeping follows.
      for (auto& t : job.tg) {
        int told = 0;
        auto ai = armed_.find(t.akey);  // still ours: disarm() answers 2 while a copy is pending
        if (ai != armed_.end()) {
          Armed& a = ai->second;
          a.done += ok;
          a.failed += !ok;
          a.nbytes += each;
          if (!ok && a.error.empty()) a.error = err;
          if (a.failed && a.state == ARMED) a.state = RUNNING;  // a failure: it takes no more senders
          // its END: with its last sender's copy; after a failure, once every copy taken has ended
          // (a sender's kernel may still be writing its pages)
          const bool all = a.done >= a.senders, ended = a.done + a.failed >= __builtin_popcountll(a.ranks);
          if (!a.told && (a.failed ? ended : all)) {
            a.told = true;
            a.state = a.state == GATED ? GATED : COMPLETED;
            const bool rok = a.failed == 0;
            std::string to_recv =
                end_msg(0, rok, tid, a.recv_bs, rok ? "" : a.error, a.nbytes, moved, (uint64_t)prefix, us, 0, &job);
            for (auto& kv : conns_) {
              if (kv.second.session == a.recv_session) told |= sendmsg_(kv.first, to_recv);
            }
          }
        }
        done.ranks.push_back(t.rank);
        done.told.push_back(told);
      }
      std::string to_send = end_msg(1, ok, tid, bs, err, nbytes, moved, (uint64_t)prefix, us, 0, &job);
      done.told_send = tell(fd, session, to_send);
      done.told_recv = !done.told.empty() && done.told[0];
      done.tid = tid;
      done.rank = job.tg.empty() ? sp.rank : job.tg[0].rank;
      done.bs = bs;
      done.sender_session = session;
      done.ok = ok;
      done.error = err;
      done.nbytes = nbytes;
      done.copy_us = us;
      done.flags = job.flags;
      done.src.swap(job.src);
      completions_.push_back(std::move(done));
    }
    uint64_t one = 1;
    (void)!write(done_, &one, 8);
  }

  // One target's geometry against the sender's (nh 0: equal layouts, whole pages).
  std::string check(const Pool& sp, const Pool& dp, const Armed& a, const std::vector<int32_t>& src, int nh) const {
    if (sp.regions.size() != dp.regions.size()) return "layouts differ";  // (nh 0: targets() saw equal signatures)
    // One device (or host memory) on both sides, or two GPUs where the receiver's pool is mapped
    // in the sender GPU's context (set_alias): the kernel runs on the sender's GPU (push).
    if (sp.device != dp.device) {
      if (sp.device < 0 || dp.device < 0) return "pools on different devices";
      const Pool& far = pull_ ? sp : dp;
      if (far.alias.find(launch_device(sp, dp)) == far.alias.end())
        return "pools on two GPUs, not mapped in the launching GPU's context";
    }
    for (size_t i = 0; i < sp.regions.size(); ++i) {
      const uint64_t a_ = sp.regions[i].nbytes, b_ = dp.regions[i].nbytes;
      if (nh == 0 ? a_ != b_
                  : (a_ % ((uint64_t)sp.ps * sp.hn) || b_ % ((uint64_t)dp.ps * dp.hn) ||
                     a_ / ((uint64_t)sp.ps * sp.hn) != b_ / ((uint64_t)dp.ps * dp.hn)))
        return "region geometry differs";
    }
    if ((int64_t)src.size() != a.prefix + (int64_t)a.dst.size()) return "page count is not prefix + delta";
    return "";
  }

  // The copy's segments: per target, per region. A head slice of token-major pages is a run of
  // nh heads per token; of head-major pages one run of nh heads' tokens:
  //
  //   NHD page [ps][hn][hb]:  token k's run at hs*hb + k*hn*hb (sender), hd*hb + k*hn'*hb (receiver)
  //   HND page [hn][ps][hb]:  one run of nh*ps*hb at hs*ps*hb (sender), hd*ps*hb (receiver)
  std::vector<Seg> segments(const Pool& sp, const std::vector<Target>& tg, size_t moved) const {
    const int on = tg.empty() ? sp.device : launch_device(sp, tg[0].dp);
    const std::vector<uint64_t>* sa = sp.device == on || sp.device < 0 ? nullptr : &sp.alias.at(on);
    std::vector<Seg> out;
    for (size_t t = 0; t < tg.size(); ++t) {
      const Target& x = tg[t];
      const Pool& dp = x.dp;
      const std::vector<uint64_t>* da = dp.device == on || dp.device < 0 ? nullptr : &dp.alias.at(on);
      for (size_t r = 0; r < sp.regions.size(); ++r) {
        const RegionDesc &s = sp.regions[r], &d = dp.regions[r];
        Seg g{sa ? (*sa)[r] : s.base, da ? (*da)[r] : d.base, s.stride, d.stride, s.nbytes, s.nbytes, 0, 0,
              (uint64_t)(t * moved)};
        if (x.nh) {
          const uint64_t hb = s.nbytes / ((uint64_t)sp.ps * sp.hn), ps = (uint64_t)sp.ps;
          if (sp.hmode == 1) {  // token-major
            g.src += x.hs * hb, g.dst += x.hd * hb;
            g.run = x.nh * hb, g.src_run = sp.hn * hb, g.dst_run = dp.hn * hb;
            g.nbytes = g.run * ps;
            if (g.run == g.src_run && g.run == g.dst_run) g.run = g.nbytes;  // all heads: one run
          } else {  // head-major
            g.src += x.hs * ps * hb, g.dst += x.hd * ps * hb;
            g.nbytes = g.run = x.nh * ps * hb;
          }
        }
        out.push_back(g);
      }
    }
    return out;
  }

  static std::string pages_ok(const Pool& sp, const std::vector<int32_t>& src) {
    std::vector<uint64_t> seen((size_t)(sp.num_pages + 63) / 64, 0);
    for (int32_t s : src) {
      if (s < 0 || s >= sp.num_pages) return "source page out of range";
      uint64_t& w = seen[(size_t)s >> 6];
      const uint64_t bit = 1ull << (s & 63);
      if (w & bit) return "source pages repeat";
      w |= bit;
    }
    return "";
  }

  // Host pools: (region, page) jobs region-major, as the service's compiled CPU copy
  // (kernels/_fused_cpu.py) does: 16-byte aligned runs with non-temporal stores on x86 (no
  // read-for-ownership of the destination lines; the engine reads the pages later), then one
  // sfence; from HOST_PARALLEL_BYTES on, the jobs split over a few threads. Measured on the 2-core
  // VM, 256 MiB of scattered 4 KiB pages: 64 ms page-major memcpy on this thread (the gRPC route's
  // copy 26 ms); bench/results/NOTES.md has the figures after.
  static constexpr uint64_t HOST_PARALLEL_BYTES = 4ull << 20;
  static constexpr unsigned HOST_MAX_THREADS = 8;

  static inline void host_run(char* d, const char* s, uint64_t n) {
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

  static void host_jobs(const Seg* segs, const int32_t* pairs, size_t moved, size_t lo, size_t hi) {
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

  static void host_copy(const std::vector<Seg>& segs, const int32_t* pairs, size_t moved) {
    const size_t jobs = segs.size() * moved;
    uint64_t bytes = 0;
    for (auto& g : segs) bytes += g.nbytes * (uint64_t)moved;
    const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
    const size_t n = bytes < HOST_PARALLEL_BYTES
                         ? 1
                         : std::min<size_t>({(size_t)hw, (size_t)HOST_MAX_THREADS, jobs,
                                             (size_t)(bytes / (HOST_PARALLEL_BYTES / 2))});
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

  // Pool to pool, whole pages (the cross-node lane's pack and unpack).
  std::string copy(const Pool& sp, const Pool& dp, const std::vector<int32_t>& pairs, size_t moved) {
    Target t;
    t.dp = dp;
    return copy_segs(sp.device, dp.device, segments(sp, {t}, moved), pairs, moved);
  }

  // Every segment's ``moved`` pages (``pairs``: source, destination page per segment's block)
  // in one kernel launch on the launching GPU, or memcpy for host pools; returns once copied.
  std::string copy_segs(int sdev, int ddev, const std::vector<Seg>& segs, const std::vector<int32_t>& pairs,
                        size_t moved) {
    const size_t nr = segs.size();
    if (moved == 0 || nr == 0) return "";
    if (sdev < 0) {
      host_copy(segs, pairs.data(), moved);
      return "";
    }
    try {
      const double t_lock = now_s();
      std::lock_guard<std::mutex> g(cuda_mu_);
      stat(S_CULOCK, t_lock);
      st_[S_COPIES]++;
      const int on = pull_ ? ddev : sdev;
      DeviceLane& d = device(on);
      CUresult r;
      if ((r = cuda_.cuCtxSetCurrent(d.ctx))) return cu_err(r);
      grow(d, nr * sizeof(Seg) + pairs.size() * 4);
      std::string err = launch(d, d.host, d.dev, segs, pairs, moved);
      if (!err.empty()) {  // what was queued may still read the buffers: wait it out
        cuda_.cuStreamSynchronize(d.stream);
        return err;
      }
      const double t_sync = now_s();
      if ((r = cuda_.cuStreamSynchronize(d.stream))) return cu_err(r);
      stat(S_CUSYNC, t_sync);
      return "";
    } catch (const std::exception& e) {
      return e.what();
    }
  }


  // ---- cross-node lane: the per-transfer path (no GIL) ----------------------------------------
  // 0 none, 1 was armed (now gone), 2 moving/moved (``moving`` sees it, under the lock)
  template <class M, class F = void (*)(typename M::mapped_type&)>
  int disarm_of(M& m, const std::string& k, F moving = [](typename M::mapped_type&) {}) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = m.find(k);
    if (it == m.end()) return 0;
    if (it->second.state == ARMED) {
      m.erase(it);
      return 1;
    }
    moving(it->second);
    return 2;
  }

  // Pages packed page-major: page i's regions back to back (the layout both lanes derive).
  static Pool packed(uint64_t base, const Pool& like, int device) {
    Pool p{like.owner, device, INT32_MAX, like.sig, like.rank, {}};
    uint64_t page = 0, off = 0;
    for (auto& r : like.regions) page += r.nbytes;
    for (auto& r : like.regions) {
      p.regions.push_back({base + off, page, r.nbytes});
      off += r.nbytes;
    }
    return p;
  }

  void handle_x(int fd, const char* p, size_t n) {
    if (n < sizeof(SendToHdr)) return closed(fd);
    SendToHdr h;
    std::memcpy(&h, p, sizeof h);
    const uint64_t w = h.flags & FLAG_SRC_I64 ? 8 : 4;
    if ((uint64_t)sizeof h + h.tid_len + h.bs_len + h.addr_len + w * h.n_src != n) return closed(fd);
    const char* q = p + sizeof h;
    std::string tid(q, h.tid_len), bs(q + h.tid_len, h.bs_len), addr(q + h.tid_len + h.bs_len, h.addr_len);
    std::vector<int32_t> src;
    if (!read_src(q + h.tid_len + h.bs_len + h.addr_len, h.n_src, w, src))
      return reply(fd, h.seq, REPLY_FALLBACK, "source page out of range");

    std::string session, why;
    Pool sp;
    XOut xo;
    Arena ar;
    std::string xk;  // key(tid, the sender pool's rank): the receiver rank it pairs with
    uint64_t nbytes = 0, page = 0, chunk = 0, parts = 2;  // the delta's bytes, a page's, pages a chunk
    uint64_t scratch = 0;  // where it packs
    bool bulk = false;     // on the bulk thread (see XSMALL)
    {
      std::lock_guard<std::mutex> g(mu_);
      auto c = conns_.find(fd);
      if (c == conns_.end()) return;
      session = c->second.session;
      auto ps = pools_.find(bs);
      xk = key(tid, ps != pools_.end() ? ps->second.rank : -1);
      auto xi = xout_.find(xk);
      if (xi == xout_.end() && ps != pools_.end() && lane_peers_.count(addr) && !parked_.count(xk) &&
          !unparking_) {
        // the receiver's offer may still be on its way (ExpectDelta and the prefill raced):
        // wait for it (20 ms at most; arm_out or refuse_out ends the wait), then fall back
        parked_[xk] = Parked{fd, std::string(p, n), now_s() + PARK_S};
        parked_count_ = parked_.size();
        return;
      }
      if (ps == pools_.end() || ps->second.owner != session) {
        why = "buffer set not on the lane";
      } else if (xi == xout_.end() || xi->second.state != ARMED) {
        why = "transfer not offered to this node's lane";
      } else if (now_s() > xi->second.deadline) {
        why = "transfer deadline passed";
      } else if (xi->second.address != addr) {
        why = "offered by another receiving service than the one named";
      } else if (!ps->second.xsig || ps->second.xsig != xi->second.xsig) {
        why = "layouts differ";
      } else if ((int64_t)src.size() != xi->second.prefix + xi->second.ndst) {
        why = "page count is not prefix + delta";
      } else if (arenas_.find(ps->second.device) == arenas_.end()) {
        why = "no lane staging on the sender's device";
      } else {
        sp = ps->second;
        xo = xi->second;
        ar = arenas_[sp.device];
        for (auto& r : sp.regions) page += r.nbytes;
        nbytes = page * (uint64_t)xo.ndst;
        why = pages_ok(sp, src);
        // A delta that fits the scratch's first part (XSMALL) whole is packed and written on
        // this thread (microseconds to a millisecond on a GPU); one that streams goes to the bulk
        // thread through the rest, so that it does not hold up the sends behind it (head of line)
        // while it takes milliseconds to seconds.
        const uint64_t scr = ar.size - ar.scratch, small = scr / XSMALL / 4096 * 4096;
        bulk = !(nbytes == xo.rbytes && nbytes <= small);
        scratch = ar.base + ar.scratch + (bulk ? small : 0);
        // one WRITE when slot and scratch area hold the delta, else chunks through parts of both
        const uint64_t cap = std::min(xo.rbytes, bulk ? scr - small : small);
        // (parts_ parts, fewer when the staging holds fewer pages; two at least)
        const uint64_t fit = cap / std::max<uint64_t>(page, 1);
        parts = std::max<uint64_t>(2, std::min<uint64_t>(parts_, fit));
        chunk = nbytes == xo.rbytes && nbytes <= cap ? (uint64_t)xo.ndst : fit / parts;
        if (why.empty() && xo.rbytes > nbytes) why = "the offered slot does not match the delta";
        if (why.empty() && chunk == 0) why = "the lane's staging holds less than two pages";
        if (why.empty()) xi->second.state = RUNNING;
      }
    }
    if (!why.empty()) return reply(fd, h.seq, REPLY_FALLBACK, why);
    reply(fd, h.seq, REPLY_ACCEPTED, "");

    const size_t moved = (size_t)xo.ndst;
    XPend pend;
    pend.tid = tid;
    pend.fd = fd;
    pend.rank = xo.rank;
    pend.session = session;
    pend.bs = bs;
    pend.remote_agent = xo.remote_agent;
    pend.nbytes = nbytes;
    pend.npages = moved;
    pend.prefix = (uint64_t)xo.prefix;
    pend.flags = h.flags;
    pend.deadline = xo.deadline;
    {
      std::lock_guard<std::mutex> g(mu_);
      xpend_[xk] = std::move(pend);  // before the WRITE: its ack may come before we see it done
    }
    xcv_.notify_one();
    XSend job{std::move(sp), std::move(xo), xk, tid, std::move(src), scratch, page, chunk, parts};
    if (!bulk) return send_out(job);
    to_bulk([this, job]() mutable { send_out(job); });
  }

  void to_bulk(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> g(bulk_mu_);
      bulk_q_.push_back(std::move(job));
    }
    bulk_cv_.notify_one();
  }

  // The bulk thread: what would hold the lane thread up for milliseconds (larger cross-node
  // sends, larger same-node copies), one at a time in arrival order; what is queued when the lane
  // stops still runs (a cross-node send then fails at once, a copy completes).
  void bulk_run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> g(bulk_mu_);
        bulk_cv_.wait(g, [this] { return !bulk_q_.empty() || !running_; });
        if (bulk_q_.empty()) return;
        job = std::move(bulk_q_.front());
        bulk_q_.pop_front();
      }
      job();
    }
  }

  // Pack and write an accepted SEND_TO (its XPend is registered), then book what came of it.
  void send_out(XSend& job) {
    const XOut& xo = job.xo;
    const std::string &xk = job.xk, &tid = job.tid;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!xpend_.count(xk)) return;  // expired while it queued (told already)
    }
    const double t0 = now_s();
    std::string err = running_ ? stream_out(job.sp, xo, xk, tid, job.src, job.scratch, job.page, job.chunk, job.parts)
                               : std::string("the lane is stopping");
    st_[S_SENT]++;
    std::string told;  // the receiver's agent, when the WRITE failed: it fails its side at once
    const std::string failed = "cross-node write failed: " + err;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = xpend_.find(xk);
      if (it == xpend_.end()) return;  // expired meanwhile (told already)
      it->second.copy_us = (uint64_t)((now_s() - t0) * 1e6);
      it->second.src.swap(job.src);
      if (!err.empty()) {
        told = it->second.remote_agent;
        finish_sent(it, false, failed);
      } else {
        it->second.written = true;
        if (it->second.acked) finish_sent(it, it->second.ack_ok, it->second.ack_msg);
      }
    }
    if (!told.empty()) send_note(told, note(XNOTE_WRITTEN, xo.rank, false, 0, 0, 0, 0, tid, failed));
  }

  // The delta's pages, ``chunk`` at a time through P = ``parts`` parts of scratch and slot: pack
  // chunk k into part k % P of the scratch, WRITE it to the same part of the receiver's slot, and
  // notify once the WRITE is done; chunk k + 1 is packed while chunk k is on the wire, and chunk
  // k + P waits until the receiver has unpacked chunk k (its credit), so P - 1 notification
  // round trips overlap the WRITEs. One chunk (the delta fits): one WRITE into the whole slot.
  std::string stream_out(const Pool& sp, const XOut& xo, const std::string& xk, const std::string& tid,
                         const std::vector<int32_t>& src, uint64_t scratch, uint64_t page, uint64_t chunk,
                         uint64_t parts) {
    const uint64_t n = (uint64_t)xo.ndst, chunks = (n + chunk - 1) / chunk;
    std::vector<Posted> out(parts);  // per part: its WRITE in flight, and the note that follows it
    std::string err;
    std::vector<int32_t> pairs;
    for (uint64_t k = 0; k < chunks && err.empty(); ++k) {
      const uint64_t h = k % parts;
      const uint64_t first = k * chunk, cnt = std::min(chunk, n - first), off = h * chunk * page;
      if (k >= parts) err = await_credits(xk, k - parts + 1, xo.deadline);  // chunk k - P left part h
      if (!err.empty()) break;
      pairs.resize(2 * cnt);
      for (uint64_t i = 0; i < cnt; ++i) {
        pairs[2 * i] = src[(size_t)(xo.prefix + first + i)];
        pairs[2 * i + 1] = (int32_t)i;
      }
      const double t0 = now_s();
      err = copy(sp, packed(scratch + off, sp, sp.device), pairs, cnt);
      stat(S_PACK, t0);
      if (!err.empty()) break;
      out[h].msg = note(XNOTE_WRITTEN, xo.rank, true, cnt * page, cnt, first, off, tid, "");
      err = nx_post(scratch + off, cnt * page, sp.device, xo, off, out[h]);
      if (err.empty() && k >= 1) err = nx_finish(xo, out[(k - 1) % parts]);  // chunk k - 1: done, noted
    }
    for (auto& o : out) {  // the last chunk's WRITE (after a failure: any, released unnoted)
      if (!o.req) continue;
      if (err.empty()) {
        err = nx_finish(xo, o);
      } else {
        release_req(o.req);
        o.req = nullptr;
      }
    }
    return err;
  }

  // mu_ not held: until the receiver has unpacked ``need`` chunks of ``xk``.
  std::string await_credits(const std::string& xk, uint64_t need, double deadline) {
    std::unique_lock<std::mutex> g(mu_);
    for (;;) {
      auto it = xpend_.find(xk);
      if (it == xpend_.end()) return "the transfer ended meanwhile";
      if (it->second.acked) return it->second.ack_ok ? "the receiver acknowledged before the last chunk" : it->second.ack_msg;
      if (it->second.credits >= need) return "";
      if (!running_) return "the lane is stopping";
      if (now_s() > deadline) return "the receiver unpacked no chunk before the transfer's deadline";
      credit_cv_.wait_for(g, std::chrono::milliseconds(1));
    }
  }

  void kick() {  // mu_ held: wake the lane thread to look at the parked SEND_TOs
    kicked_ = true;
    uint64_t one = 1;
    (void)!write(wake_, &one, 8);
  }

  // Lane thread: each parked SEND_TO whose offer came is handled now, one past its wait (or
  // refused) is answered FALLBACK.
  void unpark() {
    std::vector<std::pair<std::string, Parked>> go;
    {
      std::lock_guard<std::mutex> g(mu_);
      const double now = now_s();
      for (auto it = parked_.begin(); it != parked_.end();) {
        if (xout_.count(it->first) || now >= it->second.until) {
          go.emplace_back(it->first, std::move(it->second));
          it = parked_.erase(it);
        } else {
          ++it;
        }
      }
      parked_count_ = parked_.size();
      kicked_ = false;
    }
    for (auto& kv : go) {
      unparking_ = true;  // handled once more, never parked again
      handle(kv.second.fd, kv.second.msg.data(), kv.second.msg.size());
      unparking_ = false;
    }
  }

  static std::string note(uint32_t kind, int rank, bool ok, uint64_t nbytes, uint64_t npages, uint64_t first,
                          uint64_t off, const std::string& tid, const std::string& msg) {
    XNote h{};
    std::memcpy(h.magic, XMAGIC, 4);
    h.kind = kind;
    h.rank = (uint32_t)rank;
    h.ok = ok ? 1u : 0u;
    h.nbytes = nbytes;
    h.npages = npages;
    h.first = first;
    h.off = off;
    h.at = now_s();
    h.tid_len = (uint32_t)tid.size();
    h.msg_len = (uint32_t)msg.size();
    return std::string((const char*)&h, sizeof h) + tid + msg;
  }

  // Post one WRITE of [local, local + n) to ``off`` in the offered slot; ``o.msg`` tells the
  // receiver: sent once the WRITE is DONE (nx_finish: the bytes are there), or as the WRITE's own
  // notification (note_after off: NIXL's UCX backend flushes the endpoint inside the post then,
  // ~0.2 ms on cuda_ipc). A finished WRITE is kept and re-posted for the same bytes and slot.
  std::string nx_post(uint64_t local, uint64_t n, int device, const XOut& xo, uint64_t off, Posted& o) {
    void *ld = nullptr, *rd = nullptr, *oa = nullptr, *req = nullptr;
    int r;
    const double t_post = now_s();
    const bool after = note_after_;
    o.after = after;
    o.rkey = xo.remote_agent + '/' + std::to_string(local) + '/' + std::to_string(xo.raddr + off) + '/' +
             std::to_string(n) + (after ? "/a" : "/n");
    {
      std::lock_guard<std::mutex> g(nx_mu_);
      if (!after) {
        nx_.create_opt_args(&oa);
        nx_.opt_args_set_notif_msg(oa, o.msg.data(), o.msg.size());
        nx_.opt_args_set_has_notif(oa, true);
      }
      auto hit = req_cache_ ? reqs_.find(o.rkey) : reqs_.end();
      if (hit != reqs_.end()) {  // the same WRITE as before (a slot reused): post it again
        req = hit->second;
        reqs_.erase(hit);
        r = nx_.post_xfer_req(agent_, req, oa);
        st_[S_REPOST]++;
      } else {
        nx_.create_xfer_dlist(device >= 0 ? xnixl::VRAM : xnixl::DRAM, &ld, false);
        nx_.xfer_dlist_add_desc(ld, (uintptr_t)local, n, device >= 0 ? (uint64_t)device : 0);
        nx_.create_xfer_dlist(xo.rmem, &rd, false);
        nx_.xfer_dlist_add_desc(rd, (uintptr_t)(xo.raddr + off), n, (uint64_t)xo.rdev);
        r = nx_.create_xfer_req(agent_, xnixl::WRITE, ld, rd, xo.remote_agent.c_str(), &req, oa);
        if (r == xnixl::OK) r = nx_.post_xfer_req(agent_, req, oa);
        nx_.destroy_xfer_dlist(ld);
        nx_.destroy_xfer_dlist(rd);
      }
      if (oa) nx_.destroy_opt_args(oa);
    }
    if (r < 0) {
      if (req) release_req(req);
      return "NIXL refused the WRITE (" + std::to_string(r) + ")";
    }
    stat(S_POST, t_post);
    o.req = req;
    o.state = r;
    return "";
  }

  // Until ``o``'s WRITE is done (or the deadline passed: then released, which aborts it), then
  // the receiver's note.
  std::string nx_finish(const XOut& xo, Posted& o) {
    void* req = o.req;
    o.req = nullptr;
    int r = o.state;
    const double t_wait = now_s();
    while (r == xnixl::IN_PROG) {
      if (now_s() > xo.deadline || !running_) {
        release_req(req);  // a request released in flight is aborted by NIXL
        return running_ ? "the WRITE outlived the transfer's deadline" : "the lane is stopping";
      }
      {
        std::lock_guard<std::mutex> g(nx_mu_);
        r = nx_.get_xfer_status(agent_, req);
      }
      if (r == xnixl::IN_PROG) std::this_thread::yield();
    }
    stat(S_WAIT, t_wait);
    if (r != xnixl::OK || !req_cache_) {
      release_req(req);
    } else {
      std::lock_guard<std::mutex> g(nx_mu_);
      reqs_[o.rkey] = req;  // re-posted by the next WRITE of the same bytes to the same place
    }
    if (r != xnixl::OK) return "the WRITE failed (" + std::to_string(r) + ")";
    if (o.after) {
      std::lock_guard<std::mutex> g(nx_mu_);
      r = nx_.gen_notif(agent_, xo.remote_agent.c_str(), o.msg.data(), o.msg.size(), nullptr);
      if (r != xnixl::OK) return "notifying the receiver failed (" + std::to_string(r) + ")";
    }
    return "";
  }

  void release_req(void* req) {
    std::lock_guard<std::mutex> g(nx_mu_);
    if (nx_.release_xfer_req(agent_, req) == xnixl::OK) nx_.destroy_xfer_req(req);
  }

  void send_note(const std::string& agent, const std::string& msg) {
    std::lock_guard<std::mutex> g(nx_mu_);
    nx_.gen_notif(agent_, agent.c_str(), msg.data(), msg.size(), nullptr);
  }

  // The notification thread: busy (10 µs naps) while a cross-node transfer is armed or waits
  // for its ack, else a 50 ms nap (arming one wakes it; an idle service costs ~nothing, and a
  // stray note, e.g. a late WRITE's, is still answered); what arrives is handled here.
  void xrun() {
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);  // its 10 µs naps: not the default 50 µs of slack
    void* map = nullptr;
    nx_.create_notif_map(&map);
    std::vector<std::pair<std::string, std::string>> got;
    while (running_) {
      {
        std::unique_lock<std::mutex> g(mu_);
        if (xin_.empty() && xpend_.empty()) xcv_.wait_for(g, std::chrono::milliseconds(50));
      }
      if (!running_) break;
      got.clear();
      {
        std::lock_guard<std::mutex> g(nx_mu_);
        if (nx_.get_notifs(agent_, map, nullptr) == xnixl::OK) {
          size_t na = 0;
          nx_.notif_map_size(map, &na);
          for (size_t i = 0; i < na; ++i) {
            const char* an = nullptr;
            size_t nn = 0;
            if (nx_.notif_map_get_agent_at(map, i, &an) != xnixl::OK || !an) continue;
            nx_.notif_map_get_notifs_size(map, an, &nn);
            for (size_t j = 0; j < nn; ++j) {
              const void* d = nullptr;
              size_t len = 0;
              if (nx_.notif_map_get_notif(map, an, j, &d, &len) == xnixl::OK && d)
                got.emplace_back(an, std::string((const char*)d, len));
            }
          }
          nx_.notif_map_clear(map);
        }
      }
      for (auto& g : got) on_note(g.first, g.second);
      expire_sent();
      if (got.empty()) {
        timespec ts{0, 10000};
        nanosleep(&ts, nullptr);
      }
    }
    nx_.destroy_notif_map(map);
  }

  void on_note(const std::string& agent, const std::string& m) {
    XNote h;
    if (m.size() < sizeof h) return;
    std::memcpy(&h, m.data(), sizeof h);
    if (std::memcmp(h.magic, XMAGIC, 4) != 0 || sizeof h + (uint64_t)h.tid_len + h.msg_len != m.size()) return;
    std::string tid = m.substr(sizeof h, h.tid_len), msg = m.substr(sizeof h + h.tid_len, h.msg_len);
    stat(h.kind == XNOTE_WRITTEN ? S_NOTE : S_ACK, h.at);
    if (h.kind == XNOTE_WRITTEN && !h.ok) return on_failed(agent, tid, (int)h.rank, msg);
    if (h.kind == XNOTE_WRITTEN) return on_written(agent, tid, (int)h.rank, h.nbytes, h.npages, h.first, h.off);
    if (h.kind == XNOTE_ACK || h.kind == XNOTE_CREDIT) {
      {
        std::lock_guard<std::mutex> g(mu_);
        auto it = xpend_.find(key(tid, (int)h.rank));
        if (it == xpend_.end() || it->second.remote_agent != agent) return;
        if (h.kind == XNOTE_CREDIT) {
          it->second.credits++;
        } else {
          it->second.acked = true;
          it->second.ack_ok = h.ok != 0;
          it->second.ack_msg = msg;
          if (it->second.written) finish_sent(it, h.ok != 0, msg);
        }
      }
      credit_cv_.notify_all();  // a streaming sender waits for either
    }
  }

  // The sender could not write: the declaration fails now (its slot is never read).
  void on_failed(const std::string& agent, const std::string& tid, int rank, const std::string& why) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = xin_.find(key(tid, rank));
    if (it == xin_.end() || it->second.state != ARMED || it->second.sender_agent != agent) return;
    it->second.state = COMPLETED;
    finish_received(it->second, tid, rank, why, 0, 0, 0, 0, true);
  }

  // mu_ held: END to the receiving engine and the completion for Python's books.
  // ``tell`` false (CANCELLED): Python books the end and the engine hears it from the service.
  void finish_received(const XIn& xi, const std::string& tid, int rank, const std::string& err, uint64_t nbytes,
                       uint64_t npages, uint64_t prefix, uint64_t us, bool tell) {
    const bool ok = err.empty();
    std::string to_recv = end_msg(0, ok, tid, xi.recv_bs, err, nbytes, npages, prefix, us, END_CROSS);
    bool told = false;
    if (tell)
      for (auto& kv : conns_)
        if (kv.second.session == xi.recv_session) told |= sendmsg_(kv.first, to_recv);
    Completion done;
    done.kind = DONE_RECEIVED;
    done.tid = tid;
    done.rank = rank;
    done.bs = xi.recv_bs;
    done.ok = ok;
    done.error = err;
    done.nbytes = nbytes;
    done.copy_us = us;
    done.told_recv = told;
    completions_.push_back(std::move(done));
    uint64_t one = 1;
    (void)!write(done_, &one, 8);
  }

  // A chunk of the sender's pages is in our slot: unpack it into the declared pages; after the
  // last, END to the receiving engine, then ack to the sender (it reports DONE only after that);
  // after another, a credit (its half of the slot is free).
  void on_written(const std::string& agent, const std::string& tid, int rank, uint64_t nbytes, uint64_t npages,
                  uint64_t first, uint64_t off) {
    const std::string k = key(tid, rank);
    std::string why;
    XIn xi;  // the declaration's fields but its pages
    Pool dp;
    std::vector<int32_t> pairs;
    uint64_t page = 0, total = 0;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = xin_.find(k);
      auto pd = it == xin_.end() ? pools_.end() : pools_.find(it->second.recv_bs);
      if (pd != pools_.end())
        for (auto& r : pd->second.regions) page += r.nbytes;
      if (it == xin_.end() || it->second.state != ARMED) {
        why = "transfer not armed on the receiving service's lane";
      } else if (it->second.sender_agent != agent) {
        why = "written by another service than the one offered";
      } else if (now_s() > it->second.deadline) {
        why = "transfer deadline passed";
      } else if (pd == pools_.end()) {
        why = "receiver buffer set gone";
      } else if (first != it->second.got) {
        why = "chunk out of order";
      } else if (npages == 0 || first + npages > it->second.dst.size() || nbytes != npages * page ||
                 off + nbytes > it->second.bytes) {
        why = "chunk outside the offer";
      } else {
        dp = pd->second;
        it->second.state = RUNNING;
        XIn& x = it->second;
        xi.recv_session = x.recv_session;
        xi.recv_bs = x.recv_bs;
        xi.prefix = x.prefix;
        xi.slot = x.slot;
        xi.device = x.device;
        total = x.dst.size();
        pairs.resize(2 * npages);
        for (uint64_t i = 0; i < npages; ++i) {
          pairs[2 * i] = (int32_t)i;
          pairs[2 * i + 1] = x.dst[first + i];
        }
      }
    }
    if (!why.empty()) return send_note(agent, note(XNOTE_ACK, rank, false, 0, 0, 0, 0, tid, why));
    if (const unsigned slow = slow_unpack_us_) std::this_thread::sleep_for(std::chrono::microseconds(slow));
    const double t0 = now_s();
    std::string err = dp.device == xi.device ? copy(packed(xi.slot + off, dp, xi.device), dp, pairs, npages)
                                             : "the lane's staging is on another device than the receiver's pool";
    const uint64_t us = (uint64_t)((now_s() - t0) * 1e6);
    st_[S_UNPACK] += us;
    bool last = false, cancelled = false;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = xin_.find(k);
      if (it == xin_.end()) return;  // forgotten meanwhile (the service is closing)
      XIn& x = it->second;
      x.got += npages;
      x.us += us;
      last = x.got == total;
      cancelled = x.cancel && !last && err.empty();
      if (!last && err.empty() && !cancelled) {
        x.state = ARMED;  // the next chunk's
      } else {
        x.state = COMPLETED;
        st_[S_RECEIVED]++;
        if (cancelled) err = CANCELLED;
        finish_received(xi, tid, rank, err, total * page, total, (uint64_t)xi.prefix, x.us, !cancelled);
      }
    }
    if (!last && err.empty()) return send_note(agent, note(XNOTE_CREDIT, rank, true, nbytes, npages, first, off, tid, ""));
    send_note(agent, note(XNOTE_ACK, rank, err.empty(), total * page, total, 0, 0, tid, err));
  }

  // mu_ held: END to the sending engine and the completion for Python's books.
  void finish_sent(std::unordered_map<std::string, XPend>::iterator it, bool ok, const std::string& err) {
    XPend& p = it->second;
    const std::string tid = p.tid;
    Completion done;
    done.kind = DONE_SENT;
    done.told_send = tell(p.fd, p.session, end_msg(1, ok, tid, p.bs, err, p.nbytes, p.npages, p.prefix, p.copy_us, END_CROSS));
    done.tid = tid;
    done.rank = p.rank;
    done.bs = p.bs;
    done.sender_session = p.session;
    done.ok = ok;
    done.error = err;
    done.nbytes = p.nbytes;
    done.copy_us = p.copy_us;
    done.flags = p.flags;
    done.src.swap(p.src);
    completions_.push_back(std::move(done));
    auto xo = xout_.find(it->first);  // the same key(tid, rank)
    if (xo != xout_.end()) xo->second.state = COMPLETED;
    xpend_.erase(it);
    uint64_t one = 1;
    (void)!write(done_, &one, 8);
  }

  void expire_sent() {  // no ack a second past the deadline: the receiver is gone or wedged
    std::lock_guard<std::mutex> g(mu_);
    const double now = now_s();
    for (auto it = xpend_.begin(); it != xpend_.end();) {
      auto next = std::next(it);
      if (now > it->second.deadline + 1.0 && it->second.written)
        finish_sent(it, false, "the receiving service did not acknowledge before the deadline");
      it = next;
    }
  }

  std::string nx_register(const Arena& a, bool on) {
    void* dl = nullptr;
    std::lock_guard<std::mutex> g(nx_mu_);
    nx_.create_reg_dlist(a.device >= 0 ? xnixl::VRAM : xnixl::DRAM, &dl, false);
    nx_.reg_dlist_add_desc(dl, (uintptr_t)a.base, a.size, a.device >= 0 ? (uint64_t)a.device : 0, nullptr, 0);
    int r = on ? nx_.register_mem(agent_, dl, nullptr) : nx_.deregister_mem(agent_, dl, nullptr);
    nx_.destroy_reg_dlist(dl);
    return r == xnixl::OK ? "" : "status " + std::to_string(r);
  }

  void free_arena(const Arena& a) {
    if (a.device >= 0) {
      std::lock_guard<std::mutex> g(cuda_mu_);
      cuda_.cuMemFree(a.base);
    } else {
      munmap((void*)a.base, a.size);
    }
  }

  void close_nixl() {  // threads joined
    if (!agent_) return;
    for (auto& kv : reqs_)
      if (nx_.release_xfer_req(agent_, kv.second) == xnixl::OK) nx_.destroy_xfer_req(kv.second);
    reqs_.clear();
    for (auto& kv : arenas_) {
      nx_register(kv.second, false);
      free_arena(kv.second);
    }
    arenas_.clear();
    nx_.destroy_agent(agent_);
    agent_ = nullptr;
  }

  void device_ctx(int dev) {  // cuda_mu_ held: the device's context current on this thread
    DeviceLane& d = device(dev);
    CUresult r = cuda_.cuCtxSetCurrent(d.ctx);
    if (r) throw std::runtime_error("lane: device " + std::to_string(dev) + ": " + cu_err(r));
  }

  std::atomic<unsigned> chunk_{16384};
  std::atomic<unsigned> spin_us_{0};
  double at_msg_ = 0;  // when the lane thread read the message it handles (LocalCopy::at_recv)
  std::atomic<unsigned> parts_{4};  // a streamed cross-node send's chunks in flight
  std::atomic<bool> pull_{false};
  int epfd_, wake_, done_;
  std::atomic<bool> running_{true};
  std::thread thread_;
  std::mutex mu_, cuda_mu_;
  std::unordered_map<int, Conn> conns_;
  std::unordered_map<std::string, Pool> pools_;
  std::unordered_map<std::string, Armed> armed_;
  std::unordered_map<std::string, std::vector<int>> by_tid_;  // transfer id -> its armed ranks
  std::deque<Completion> completions_;
  Cuda cuda_;
  NvRtc nvrtc_;
  std::unordered_map<int, DeviceLane> devs_;
  // cross-node lane
  xnixl::Api nx_;
  xnixl::Agent agent_ = nullptr;
  void* backend_ = nullptr;
  std::mutex nx_mu_;  // one NIXL call at a time (never taken inside mu_)
  std::unordered_map<int, Arena> arenas_;        // device (-1: host) -> staging
  std::unordered_map<std::string, XOut> xout_;   // key(tid, rank) -> an offer an engine here may SEND_TO
  std::unordered_map<std::string, XIn> xin_;     // key(tid, rank) -> a declaration with a slot
  std::unordered_map<std::string, XPend> xpend_; // key(tid, rank) -> written, waiting for the ack
  struct Parked {
    int fd;
    std::string msg;
    double until;
  };
  std::condition_variable credit_cv_;  // a streamed transfer's credit (or ack) came
  static constexpr double PARK_S = 0.02;
  // cumulative µs (and counts) of the cross-node path's steps, for benchmarks (stats())
  enum { S_SENT, S_PACK, S_POST, S_WAIT, S_NOTE, S_ACK, S_RECEIVED, S_UNPACK, S_REPOST, S_COPIES, S_CULOCK, S_CUSYNC, S_N };
  std::atomic<uint64_t> st_[S_N] = {};
  void stat(int i, double since) { st_[i] += (uint64_t)std::max(0.0, (now_s() - since) * 1e6); }
  std::unordered_map<std::string, void*> reqs_;  // finished WRITEs kept for re-posting (nx_mu_)
  std::atomic<bool> req_cache_{true};
  std::atomic<bool> note_after_{true};
  std::atomic<unsigned> slow_unpack_us_{0};
  std::unordered_map<std::string, Parked> parked_;  // key(tid, rank) -> a SEND_TO waiting for its offer
  std::atomic<size_t> parked_count_{0};
  bool kicked_ = false;
  bool unparking_ = false;  // lane thread only
  std::set<std::string> lane_peers_;  // addresses whose lanes have offered slots
  std::condition_variable xcv_;
  std::thread xthread_;
  std::thread bthread_;  // larger cross-node sends (bulk_run)
  std::mutex bulk_mu_;
  std::condition_variable bulk_cv_;
  std::deque<std::function<void()>> bulk_q_;
  std::thread fthread_;  // same-node GPU copies in flight (finish_run)
  std::mutex fin_mu_;
  std::condition_variable fin_cv_;
  std::deque<InFlight> fin_q_;
  std::atomic<bool> fin_running_{true};
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvservice native lane: per-transfer path without the GIL (kvservice/lane)";
  py::class_<Lane>(m, "Lane")
      .def(py::init<>())
      .def("stop", &Lane::stop, py::call_guard<py::gil_scoped_release>())
      .def("completion_fd", &Lane::completion_fd)
      .def("set_chunk", &Lane::set_chunk)
      .def("set_spin_us", &Lane::set_spin_us)
      .def("set_pull", &Lane::set_pull)
      .def("init_cuda", &Lane::init_cuda, py::call_guard<py::gil_scoped_release>())
      .def("cuda_why", &Lane::cuda_why)
      .def("prepare_device", &Lane::prepare_device, py::call_guard<py::gil_scoped_release>())
      .def("add_conn", &Lane::add_conn)
      .def("drop_session", &Lane::drop_session)
      .def("conns", &Lane::conns)
      .def("add_pool", &Lane::add_pool)
      .def("set_alias", &Lane::set_alias)
      .def("drop_pool", &Lane::drop_pool)
      .def("set_heads", &Lane::set_heads)
      .def("arm", &Lane::arm, py::arg("tid"), py::arg("rank"), py::arg("recv_session"), py::arg("recv_bs"),
           py::arg("prefix"), py::arg("dst"), py::arg("deadline"), py::arg("senders") = 1)
      .def("disarm", &Lane::disarm)
      .def("forget", &Lane::forget)
      .def("armed_count", &Lane::armed_count)
      .def("drain", &Lane::drain)
      .def("init_nixl", &Lane::init_nixl, py::call_guard<py::gil_scoped_release>())
      .def("nixl_why", &Lane::nixl_why)
      .def("add_arena", &Lane::add_arena, py::call_guard<py::gil_scoped_release>())
      .def("local_md", &Lane::local_md)
      .def("load_md", &Lane::load_md)
      .def("arm_out", &Lane::arm_out)
      .def("refuse_out", &Lane::refuse_out)
      .def("disarm_out", &Lane::disarm_out)
      .def("forget_out", &Lane::forget_out)
      .def("arm_in", &Lane::arm_in)
      .def("disarm_in", &Lane::disarm_in, py::arg("tid"), py::arg("rank"), py::arg("cancel") = false)
      .def("forget_in", &Lane::forget_in)
      .def("cross_count", &Lane::cross_count)
      .def("stats", &Lane::stats)
      .def("set_req_cache", &Lane::set_req_cache)
      .def("set_note_after", &Lane::set_note_after)
      .def("set_parts", &Lane::set_parts)
      .def("set_slow_unpack", &Lane::set_slow_unpack);
}
