// The cross-node lane's set-up (docs/decisions/0018): NIXL's C API and one agent, staging
// registered with it, peers' metadata, and what Python offers (arm_out) and declares (arm_in).

#include <sys/mman.h>

#include <cstdlib>
#include <stdexcept>

#include "lane.h"

namespace kvlane {

// NIXL's C API from ``capi`` and one agent ``name`` with a UCX backend; false + nixl_why().
bool Lane::init_nixl(const std::string& capi, const std::string& name) {
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

// Staging on ``device`` (-1: host memory) registered with the agent: ``in_bytes`` of receive
// slots (Python allocates them), then ``scratch_bytes`` where this lane packs what it sends.
uint64_t Lane::add_arena(int device, uint64_t in_bytes, uint64_t scratch_bytes) {
  if (!agent_) throw std::runtime_error("lane: no NIXL agent");
  Arena a;
  a.device = device;
  a.size = in_bytes + scratch_bytes;
  a.scratch = in_bytes;
  if (device >= 0) {
    CUdeviceptr p = 0;
    const std::string err = cu_.alloc(device, a.size, p);
    if (!err.empty()) throw std::runtime_error("lane: staging: " + err);
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

// This lane's NIXL metadata, for a peer lane's load_md.
std::string Lane::local_md() {
  void* data = nullptr;
  size_t len = 0;
  {
    std::lock_guard<std::mutex> g(nx_mu_);
    if (!agent_ || nx_.get_local_md(agent_, &data, &len) != xnixl::OK)
      throw std::runtime_error("lane: no NIXL metadata");
  }
  std::string out((const char*)data, len);
  free(data);
  return out;
}

// A peer lane's metadata: its agent name (this lane writes to it and notifies it).
std::string Lane::load_md(const std::string& md) {
  std::lock_guard<std::mutex> g(nx_mu_);
  char* name = nullptr;
  int r = agent_ ? nx_.load_remote_md(agent_, md.data(), md.size(), &name) : -1;
  if (r != xnixl::OK || !name)
    throw std::runtime_error("lane: loading a peer's NIXL metadata failed (" + std::to_string(r) + ")");
  std::string out(name);
  free(name);
  return out;
}

// The receiving service offered ``tid`` with a slot: an engine here may now SEND_TO it.
// Python's answer for an offer without a lane slot: a SEND_TO parked for it goes to gRPC now.
void Lane::refuse_out(const std::string& tid, int rank) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = parked_.find(key(tid, rank));
  if (it == parked_.end()) return;
  it->second.until = 0;  // the lane thread answers FALLBACK
  kick();
}

void Lane::arm_out(const std::string& tid, int rank, const std::string& address, const std::string& remote_agent,
                   uint64_t raddr, uint64_t rbytes, int rdev, int rmem, uint64_t xsig, int64_t prefix, int64_t ndst,
                   double deadline, uint64_t xusig, int rps, uint64_t rlsig, std::vector<RowDesc> rrows,
                   std::vector<uint64_t> rpages) {
  XOut x;
  x.xusig = xusig;
  x.rps = rps;
  std::shared_ptr<Pool> like;  // the receiver's page geometry (page-layout conversions), when sent
  if (rlsig && !rrows.empty() && !rpages.empty()) {
    like = std::make_shared<Pool>();
    like->lsig = rlsig, like->ps = rps, like->rows = std::move(rrows);
    for (uint64_t b : rpages) like->regions.push_back({0, b, b});
  }
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
  {
    std::lock_guard<std::mutex> g(mu_);
    if (like) {
      rlikes_[xsig] = like;
      x.rlike = std::move(like);
    } else if (rlsig) {  // sent with an earlier offer of that receiver geometry
      auto it = rlikes_.find(xsig);
      if (it != rlikes_.end()) x.rlike = it->second;
    }
    lane_peers_.insert(address);
    const std::string k = key(tid, rank);  // the sender's rank is the receiver's (one layout)
    xout_[k] = std::move(x);
    if (parked_.count(k)) kick();  // its SEND_TO came first: the lane thread takes it now
  }
  heat_bulk();  // an offer: its SEND_TO follows, maybe a streamed one for the bulk thread
}

void Lane::forget_out(const std::string& tid, int rank) {
  std::lock_guard<std::mutex> g(mu_);
  xout_.erase(key(tid, rank));
}

// This service declared ``tid`` and offered slot ``slot`` (``bytes``) to ``sender_agent``.
void Lane::arm_in(const std::string& tid, int rank, const std::string& recv_session, const std::string& recv_bs,
                  const std::string& sender_agent, int64_t prefix, std::vector<int32_t> dst, uint64_t slot,
                  uint64_t bytes, int device, double deadline, std::vector<AuxRows> aux) {
  XIn x;
  x.aux = std::move(aux);
  x.recv_session = recv_session;
  x.recv_bs = recv_bs;
  x.sender_agent = sender_agent;
  x.prefix = prefix;
  x.dst = std::move(dst);
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

int Lane::disarm_out(const std::string& tid, int rank) {
  const std::string k = key(tid, rank);
  bool ended = false;  // an engine's stream of it, waiting for chunks, ends now
  const int out = disarm_of(xout_, k, [&](XOut& x) {
    if (x.streaming && !x.last)
      ended = fail_xstream(k, "transfer_id: the transfer was ended by its receiver before its last chunk");
  });
  if (ended) {
    signal_done();
    flush_notes();
  }
  return out;
}

// 1 (gone): no chunk is unpacked after this returns; 2: a chunk is being unpacked, or all
// were: ``cancel`` ends a streamed one after that chunk (a completion with CANCELLED), else it
// goes on (a gRPC sender is refused meanwhile).
int Lane::disarm_in(const std::string& tid, int rank, bool cancel) {
  return disarm_of(xin_, key(tid, rank), [cancel](XIn& x) { x.cancel |= cancel && x.state == RUNNING; });
}

void Lane::forget_in(const std::string& tid, int rank) {
  std::lock_guard<std::mutex> g(mu_);
  xin_.erase(key(tid, rank));
}

size_t Lane::cross_count() {
  std::lock_guard<std::mutex> g(mu_);
  return xout_.size() + xin_.size() + xpend_.size();
}

std::string Lane::nx_register(const Arena& a, bool on) {
  void* dl = nullptr;
  std::lock_guard<std::mutex> g(nx_mu_);
  nx_.create_reg_dlist(a.device >= 0 ? xnixl::VRAM : xnixl::DRAM, &dl, false);
  nx_.reg_dlist_add_desc(dl, (uintptr_t)a.base, a.size, a.device >= 0 ? (uint64_t)a.device : 0, nullptr, 0);
  int r = on ? nx_.register_mem(agent_, dl, nullptr) : nx_.deregister_mem(agent_, dl, nullptr);
  nx_.destroy_reg_dlist(dl);
  return r == xnixl::OK ? "" : "status " + std::to_string(r);
}

void Lane::free_arena(const Arena& a) {
  if (a.device >= 0) {
    cu_.free(a.base);
  } else {
    munmap((void*)a.base, a.size);
  }
}

void Lane::close_nixl() {  // threads joined
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

}  // namespace kvlane
