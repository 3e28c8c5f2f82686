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
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

// ---- wire format (little endian; documented in kvservice/lane/wire.py) -------------------------
enum : uint32_t { MSG_SEND = 1, MSG_REPLY = 2, MSG_END = 3 };
enum : int32_t { REPLY_ACCEPTED = 0, REPLY_FALLBACK = 1 };
struct SendHdr {
  uint32_t type, seq, n_src, tid_len, bs_len, flags;
};
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

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// ---- CUDA driver API and NVRTC, loaded at run time (a CPU host needs neither) ------------------
using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
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
};

const char* KERNEL_SRC = R"(
struct Region { unsigned long long src, dst, src_stride, dst_stride, nbytes; };
extern "C" __global__ void __launch_bounds__(256) lane_copy(
    const Region* __restrict__ regions, const int* __restrict__ pairs, int vec16, unsigned chunk) {
  const Region R = regions[blockIdx.y];
  const unsigned long long start = (unsigned long long)blockIdx.z * chunk;
  if (start >= R.nbytes) return;
  unsigned long long n = R.nbytes - start;
  if (n > chunk) n = chunk;
  const int sp = pairs[2 * blockIdx.x], dp = pairs[2 * blockIdx.x + 1];
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

struct DeviceLane {  // per CUDA device: context, stream, kernel, descriptor buffers
  CUcontext ctx = nullptr;
  CUstream stream = nullptr;
  CUfunction fn = nullptr;
  char* host = nullptr;  // pinned
  CUdeviceptr dev = 0;
  size_t cap = 0;
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
  // another GPU -> each region's base as mapped in that GPU's context (an imported pool is mapped
  // only in the context that opened it: a kernel on another GPU needs its own opening)
  std::unordered_map<int, std::vector<uint64_t>> alias;
};

enum : int { ARMED = 1, RUNNING = 2, COMPLETED = 3 };

struct Armed {
  int state = ARMED;
  std::string recv_session, recv_bs;
  int64_t prefix = 0;
  std::vector<int32_t> dst;
  double deadline = 0;
};

struct Conn {
  int fd;
  std::string session;
};

struct Completion {
  std::string tid, bs, sender_session, error;
  int rank = 0;
  bool ok = true;
  uint32_t flags = 0;
  uint64_t nbytes = 0, copy_us = 0;
  bool told_recv = false, told_send = false;  // END reached that engine's lane
  std::vector<int32_t> src;
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
  }
  ~Lane() { stop(); }

  void stop() {
    if (!running_.exchange(false)) return;
    uint64_t one = 1;
    (void)!write(wake_, &one, 8);
    if (thread_.joinable()) thread_.join();
    std::lock_guard<std::mutex> g(mu_);
    for (auto& kv : conns_) close(kv.first);
    conns_.clear();
  }

  int completion_fd() const { return done_; }

  // Bytes of one page region a CUDA block copies (config lane_cuda_chunk_kb; a multiple of 16).
  void set_chunk(unsigned bytes) { chunk_ = std::max(16u, bytes & ~15u); }
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
                int rank, py::array_t<uint64_t, py::array::c_style | py::array::forcecast> regions) {
    if (regions.ndim() != 2 || regions.shape(1) != 3) throw std::invalid_argument("regions: want [n, 3]");
    Pool p{owner, device, num_pages, sig, rank, {}};
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

  void arm(const std::string& tid, int rank, const std::string& recv_session, const std::string& recv_bs,
           int64_t prefix, py::array_t<int32_t, py::array::c_style | py::array::forcecast> dst, double deadline) {
    Armed a;
    a.recv_session = recv_session;
    a.recv_bs = recv_bs;
    a.prefix = prefix;
    a.dst.assign(dst.data(), dst.data() + dst.size());
    a.deadline = deadline;
    std::lock_guard<std::mutex> g(mu_);
    armed_[key(tid, rank)] = std::move(a);
  }

  // Disarm: 0 = nothing armed, 1 = was armed and is no more; 2 = the lane is copying or has
  // copied it (Python's finalize is pending): the caller must wait for that completion.
  int disarm(const std::string& tid, int rank) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = armed_.find(key(tid, rank));
    if (it == armed_.end()) return 0;
    if (it->second.state == ARMED) {
      armed_.erase(it);
      return 1;
    }
    return 2;
  }

  // Python's finalize of a completion: the entry goes.
  void forget(const std::string& tid, int rank) {
    std::lock_guard<std::mutex> g(mu_);
    armed_.erase(key(tid, rank));
  }

  size_t armed_count() {
    std::lock_guard<std::mutex> g(mu_);
    return armed_.size();
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
                                c.flags, c.told_recv, c.told_send));
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

  void grow(DeviceLane& d, size_t need) {
    if (need <= d.cap) return;
    size_t cap = d.cap ? d.cap : 1 << 16;
    while (cap < need) cap <<= 1;
    if (d.host) cuda_.cuMemFreeHost(d.host);
    if (d.dev) cuda_.cuMemFree(d.dev);
    CUresult r;
    if ((r = cuda_.cuMemAllocHost((void**)&d.host, cap)) || (r = cuda_.cuMemAlloc(&d.dev, cap)))
      throw std::runtime_error("lane: descriptor buffers: " + cu_err(r));
    d.cap = cap;
  }

  void run() {
    std::vector<char> buf(MAX_MSG);
    epoll_event evs[64];
    while (running_) {
      int n = epoll_wait(epfd_, evs, 64, -1);
      if (n < 0 && errno == EINTR) continue;
      for (int i = 0; i < n && running_; ++i) {
        int fd = evs[i].data.fd;
        if (fd == wake_) {
          uint64_t v;
          (void)!read(wake_, &v, 8);
          continue;
        }
        ssize_t got = recv(fd, buf.data(), buf.size(), MSG_DONTWAIT);
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
    if (conns_.erase(fd)) {
      epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr);
      close(fd);
    }
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
                             uint64_t us) {
    EndHdr h{MSG_END, role, ok ? 0u : 1u, (uint32_t)tid.size(), (uint32_t)bs.size(), (uint32_t)err.size(),
             nbytes, npages, skipped, us};
    return std::string((const char*)&h, sizeof h) + tid + bs + err;
  }

  void handle(int fd, const char* p, size_t n) {
    if (n < sizeof(SendHdr)) return closed(fd);  // not our protocol: drop the connection
    SendHdr h;
    std::memcpy(&h, p, sizeof h);
    if (h.type != MSG_SEND || (uint64_t)sizeof h + h.tid_len + h.bs_len + 4ull * h.n_src != n) return closed(fd);
    std::string tid(p + sizeof h, h.tid_len), bs(p + sizeof h + h.tid_len, h.bs_len);
    std::vector<int32_t> src(h.n_src);
    if (h.n_src) std::memcpy(src.data(), p + sizeof h + h.tid_len + h.bs_len, 4ull * h.n_src);

    std::string session, why;
    Pool sp, dp;
    int64_t prefix = 0;
    std::vector<int32_t> dst;
    std::string akey;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto c = conns_.find(fd);
      if (c == conns_.end()) return;
      session = c->second.session;
      auto ps = pools_.find(bs);
      if (ps == pools_.end() || ps->second.owner != session) {
        why = "buffer set not on the lane";
      } else {
        sp = ps->second;
        akey = key(tid, sp.rank);
        auto ai = armed_.find(akey);
        if (ai == armed_.end() || ai->second.state != ARMED) {
          why = "transfer not armed";
        } else if (now_s() > ai->second.deadline) {
          why = "transfer deadline passed";
        } else {
          Armed& a = ai->second;
          auto pd = pools_.find(a.recv_bs);
          if (pd == pools_.end()) {
            why = "receiver buffer set gone";
          } else {
            dp = pd->second;
            why = check(sp, dp, a, src);
          }
          if (why.empty()) {
            a.state = RUNNING;
            prefix = a.prefix;
            dst = a.dst;
          }
        }
      }
    }
    if (!why.empty()) return reply(fd, h.seq, REPLY_FALLBACK, why);
    reply(fd, h.seq, REPLY_ACCEPTED, "");

    // The copy: src[prefix + i] -> dst[i] for every region.
    const size_t moved = src.size() - (size_t)prefix;
    std::vector<int32_t> pairs(2 * moved);
    for (size_t i = 0; i < moved; ++i) {
      pairs[2 * i] = src[(size_t)prefix + i];
      pairs[2 * i + 1] = dst[i];
    }
    uint64_t nbytes = 0;
    for (auto& r : sp.regions) nbytes += r.nbytes * moved;
    double t0 = now_s();
    std::string err = copy(sp, dp, pairs, moved);
    uint64_t us = (uint64_t)((now_s() - t0) * 1e6);
    bool ok = err.empty();

    Completion done;
    std::string recv_session, recv_bs;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto ai = armed_.find(akey);  // still ours: disarm() answers 2 while RUNNING/COMPLETED
      if (ai != armed_.end()) {
        ai->second.state = COMPLETED;
        recv_session = ai->second.recv_session;
        recv_bs = ai->second.recv_bs;
      }
      // END to the engines first (receiver, then sender); Python's bookkeeping follows.
      std::string to_recv = end_msg(0, ok, tid, recv_bs, err, nbytes, moved, (uint64_t)prefix, us);
      std::string to_send = end_msg(1, ok, tid, bs, err, nbytes, moved, (uint64_t)prefix, us);
      bool told_recv = false;
      for (auto& kv : conns_) {
        if (kv.second.session == recv_session) told_recv |= sendmsg_(kv.first, to_recv);
      }
      done.told_send = sendmsg_(fd, to_send);
      done.told_recv = told_recv;
      done.tid = tid;
      done.rank = sp.rank;
      done.bs = bs;
      done.sender_session = session;
      done.ok = ok;
      done.error = err;
      done.nbytes = nbytes;
      done.copy_us = us;
      done.flags = h.flags;
      done.src.swap(src);
      completions_.push_back(std::move(done));
    }
    uint64_t one = 1;
    (void)!write(done_, &one, 8);
  }

  std::string check(const Pool& sp, const Pool& dp, const Armed& a, const std::vector<int32_t>& src) const {
    if (sp.sig != dp.sig || sp.regions.size() != dp.regions.size()) return "layouts differ";
    // One device (or host memory) on both sides, or two GPUs where the receiver's pool is mapped
    // in the sender GPU's context (set_alias): the kernel runs on the sender's GPU (push).
    if (sp.device != dp.device) {
      if (sp.device < 0 || dp.device < 0) return "pools on different devices";
      const Pool& far = pull_ ? sp : dp;
      if (far.alias.find(launch_device(sp, dp)) == far.alias.end())
        return "pools on two GPUs, not mapped in the launching GPU's context";
    }
    for (size_t i = 0; i < sp.regions.size(); ++i)
      if (sp.regions[i].nbytes != dp.regions[i].nbytes) return "region geometry differs";
    if ((int64_t)src.size() != a.prefix + (int64_t)a.dst.size()) return "page count is not prefix + delta";
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

  std::string copy(const Pool& sp, const Pool& dp, const std::vector<int32_t>& pairs, size_t moved) {
    const size_t nr = sp.regions.size();
    if (moved == 0 || nr == 0) return "";
    if (sp.device < 0) {
      for (size_t i = 0; i < moved; ++i)
        for (size_t r = 0; r < nr; ++r) {
          const RegionDesc &s = sp.regions[r], &d = dp.regions[r];
          std::memcpy((char*)(d.base + (uint64_t)pairs[2 * i + 1] * d.stride),
                      (const char*)(s.base + (uint64_t)pairs[2 * i] * s.stride), s.nbytes);
        }
      return "";
    }
    try {
      std::lock_guard<std::mutex> g(cuda_mu_);
      const int on = launch_device(sp, dp);
      DeviceLane& d = device(on);
      CUresult r;
      if ((r = cuda_.cuCtxSetCurrent(d.ctx))) return cu_err(r);
      const size_t rbytes = nr * 40, need = rbytes + pairs.size() * 4;
      grow(d, need);
      uint64_t maxb = 0;
      int vec = 1;
      uint64_t* reg = (uint64_t*)d.host;
      // two GPUs: the other GPU's pool through its mapping in the launching GPU's context
      const std::vector<uint64_t>* sa = sp.device == on ? nullptr : &sp.alias.at(on);
      const std::vector<uint64_t>* da = dp.device == on ? nullptr : &dp.alias.at(on);
      for (size_t r = 0; r < nr; ++r) {
        const RegionDesc &s = sp.regions[r], &t = dp.regions[r];
        const uint64_t sb = sa ? (*sa)[r] : s.base, tb = da ? (*da)[r] : t.base;
        reg[5 * r] = sb;
        reg[5 * r + 1] = tb;
        reg[5 * r + 2] = s.stride;
        reg[5 * r + 3] = t.stride;
        reg[5 * r + 4] = s.nbytes;
        if ((sb | tb | s.stride | t.stride | s.nbytes) & 15) vec = 0;
        if (s.nbytes > maxb) maxb = s.nbytes;
      }
      std::memcpy(d.host + rbytes, pairs.data(), pairs.size() * 4);
      if ((r = cuda_.cuMemcpyHtoDAsync(d.dev, d.host, need, d.stream))) return cu_err(r);
      CUdeviceptr regs = d.dev, prs = d.dev + rbytes;
      unsigned chunk = chunk_;
      unsigned zc = (unsigned)((maxb + chunk - 1) / chunk);
      if (zc > 65535 || nr > 65535) return "lane: pages or regions too large for one launch";
      void* args[] = {&regs, &prs, &vec, &chunk};
      if ((r = cuda_.cuLaunchKernel(d.fn, (unsigned)moved, (unsigned)nr, zc, 256, 1, 1, 0, d.stream, args, nullptr)))
        return cu_err(r);
      if ((r = cuda_.cuStreamSynchronize(d.stream))) return cu_err(r);
      return "";
    } catch (const std::exception& e) {
      return e.what();
    }
  }

  std::atomic<unsigned> chunk_{16384};
  std::atomic<bool> pull_{false};
  int epfd_, wake_, done_;
  std::atomic<bool> running_{true};
  std::thread thread_;
  std::mutex mu_, cuda_mu_;
  std::unordered_map<int, Conn> conns_;
  std::unordered_map<std::string, Pool> pools_;
  std::unordered_map<std::string, Armed> armed_;
  std::deque<Completion> completions_;
  Cuda cuda_;
  NvRtc nvrtc_;
  std::unordered_map<int, DeviceLane> devs_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvservice native lane: per-transfer path without the GIL (kvservice/lane)";
  py::class_<Lane>(m, "Lane")
      .def(py::init<>())
      .def("stop", &Lane::stop, py::call_guard<py::gil_scoped_release>())
      .def("completion_fd", &Lane::completion_fd)
      .def("set_chunk", &Lane::set_chunk)
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
      .def("arm", &Lane::arm)
      .def("disarm", &Lane::disarm)
      .def("forget", &Lane::forget)
      .def("armed_count", &Lane::armed_count)
      .def("drain", &Lane::drain);
}
