// What Python arms for the same-node route: engines' connections (after it authenticated them),
// pools (buffer sets) and transfers (a receiver rank's declaration), and their disarming.

#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include <algorithm>
#include <stdexcept>

#include "lane.h"

namespace kvlane {

void Lane::add_conn(int fd, const std::string& session) {
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

// NOTE: only the lane thread closes a connection's fd (closed()): it may hold an epoll event for
// it right now, and a number closed here could be reused by the next connection before it reads.
// Here the connection is shut down (its event says hang-up) and no longer any session's.
// Its streams still taking chunks fail (their copies in flight end first).
void Lane::drop_session(const std::string& session) {
  bool ended;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& kv : conns_) {
      if (kv.second.session == session) {
        kv.second.session.clear();
        shutdown(kv.first, SHUT_RDWR);
      }
    }
    ended = fail_streams_of_session(session);
    ended |= fail_xstreams_of(-1, session, "the sending engine's session ended before its last chunk");
  }
  if (ended) {
    signal_done();
    flush_notes();
  }
}

int Lane::conns() {
  std::lock_guard<std::mutex> g(mu_);
  return (int)conns_.size();
}

int Lane::conns_of(const std::string& session) {
  std::lock_guard<std::mutex> g(mu_);
  int n = 0;
  for (auto& kv : conns_) n += kv.second.session == session;
  return n;
}

void Lane::add_pool(const std::string& bs, const std::string& owner, int device, int64_t num_pages, uint64_t sig,
                    int rank, std::vector<RegionDesc> regions, uint64_t xsig) {
  Pool p{owner, bs, device, num_pages, sig, rank, std::move(regions)};
  p.xsig = xsig;
  std::lock_guard<std::mutex> g(mu_);
  pools_[bs] = std::move(p);
}

// Bases of pool ``bs``'s regions in GPU ``device``'s context: kernels there may write it.
void Lane::set_alias(const std::string& bs, int device, std::vector<uint64_t> bases) {
  std::lock_guard<std::mutex> g(mu_);
  auto p = pools_.find(bs);
  if (p == pools_.end()) return;
  if (bases.size() != p->second.regions.size()) throw std::invalid_argument("bases: one per region");
  p->second.alias[device] = std::move(bases);
}

// No new copy takes pool ``bs`` from now on; returns once no copy holds it (true), or false if
// one still does after ``wait_s`` (a wedged device). A job waiting on a peer sees it dropped and
// gives up, so this waits for at most the copies being made. Called without the GIL.
bool Lane::drop_pool(const std::string& bs, double wait_s) {
  std::weak_ptr<PoolLife> life;
  bool ended = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = pools_.find(bs);
    if (it == pools_.end()) return true;
    it->second.life->dropped = true;
    life = it->second.life;
    pools_.erase(it);
    for (auto& kv : xout_)  // a cross-node stream from it between chunks: its receiver hears now
      if (kv.second.streaming && !kv.second.last && kv.second.bs == bs)
        ended |= fail_xstream(kv.first, "buffer set '" + bs + "' was unregistered before the last chunk");
  }
  if (ended) signal_done();
  flush_notes();
  credit_cv_.notify_all();
  const double until = now_s() + wait_s;
  while (!life.expired()) {
    if (now_s() > until) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return true;
}

// Pool ``bs``'s aux regions (host memory), for the aux rows of a chunk.
void Lane::set_aux(const std::string& bs, std::vector<AuxDesc> aux) {
  std::lock_guard<std::mutex> g(mu_);
  auto p = pools_.find(bs);
  if (p != pools_.end()) p->second.aux = std::move(aux);
}

// Pool ``bs``'s heads, for head slices between TP sizes (see Pool::hmode).
void Lane::set_heads(const std::string& bs, int hmode, uint64_t msig, int hlo, int hn, int ps) {
  std::lock_guard<std::mutex> g(mu_);
  auto p = pools_.find(bs);
  if (p == pools_.end()) return;
  Pool& q = p->second;
  q.hmode = hmode, q.msig = msig, q.hlo = hlo, q.hn = hn, q.ps = ps;
}

// Pool ``bs``'s page-size conversions (see Pool::usig, xusig).
void Lane::set_units(const std::string& bs, uint64_t usig, uint64_t xusig) {
  std::lock_guard<std::mutex> g(mu_);
  auto p = pools_.find(bs);
  if (p != pools_.end()) p->second.usig = usig, p->second.xusig = xusig;
}

// Pool ``bs``'s page-layout conversions (see Pool::lsig): each row inside its region's page.
bool Lane::set_rows(const std::string& bs, uint64_t lsig, std::vector<RowDesc> rows) {
  std::lock_guard<std::mutex> g(mu_);
  auto p = pools_.find(bs);
  if (p == pools_.end()) return false;
  Pool& q = p->second;
  q.lsig = 0, q.rows.clear();
  if (q.ps <= 0) return false;
  for (const RowDesc& r : rows)
    if (r.region >= q.regions.size() || !r.run ||
        r.off + (uint64_t)(q.ps - 1) * r.tok + r.run > q.regions[r.region].nbytes)
      return false;
  q.lsig = lsig, q.rows = std::move(rows);
  return true;
}

void Lane::arm(const std::string& tid, int rank, const std::string& recv_session, const std::string& recv_bs,
               int64_t prefix, std::vector<int32_t> dst, double deadline, int senders, std::vector<AuxRows> aux) {
  Armed a;
  a.aux = std::move(aux);
  a.recv_session = recv_session;
  a.recv_bs = recv_bs;
  a.prefix = prefix;
  a.dst = std::move(dst);
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
// ``cancel`` (the receiver ends): a stream into it still waiting for chunks fails, so that
// completion comes once its copies in flight end; otherwise (another sender takes the rank)
// such a stream goes on to its last chunk.
int Lane::disarm(const std::string& tid, int rank, bool cancel) {
  bool ended = false;
  int out = 2;
  {
    std::lock_guard<std::mutex> g(mu_);
    const std::string k = key(tid, rank);
    auto it = armed_.find(k);
    if (it == armed_.end()) return 0;
    if (it->second.pending == 0) {
      unarm(it, tid, rank);
      return 1;
    }
    if (it->second.state == ARMED) it->second.state = GATED;
    if (cancel) {
      it->second.cancelled = true;
      ended = fail_streams_into(k);
    }
  }
  if (ended) signal_done();
  return out;
}

// Python's finalize of a completion booked a copy into (tid, rank): the copies still pending
// there; the entry goes with its last one unless it still takes senders.
int Lane::forget(const std::string& tid, int rank) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = armed_.find(key(tid, rank));
  if (it == armed_.end()) return 0;
  Armed& a = it->second;
  a.pending = std::max(0, a.pending - 1);
  const int left = a.pending;
  if (left == 0 && a.state != ARMED) unarm(it, tid, rank);
  return left;
}

size_t Lane::armed_count() {
  std::lock_guard<std::mutex> g(mu_);
  return armed_.size();
}

// mu_ held: the entry goes, and its rank from its transfer's list.
void Lane::unarm(std::unordered_map<std::string, Armed>::iterator it, const std::string& tid, int rank) {
  armed_.erase(it);
  auto t = by_tid_.find(tid);
  if (t == by_tid_.end()) return;
  auto& v = t->second;
  v.erase(std::remove(v.begin(), v.end(), rank), v.end());
  if (v.empty()) by_tid_.erase(t);
}

// The fault guard's functions (kvservice/buffers/guard.py): kvg_faults, kvg_range_faulted.
void Lane::set_guard(uint64_t faults_fn, uint64_t range_fn) {
  guard_faults_ = reinterpret_cast<uint64_t (*)()>(faults_fn);
  guard_range_ = reinterpret_cast<int (*)(uint64_t, uint64_t)>(range_fn);
}

// Why pool ``p`` can no longer be trusted (its owner shrank its shared memory: the guard repaired
// a fault in it), or "". A host pool only; one call while nothing ever faulted.
std::string Lane::lost(const Pool& p) const {
  auto faults = guard_faults_.load();
  auto range = guard_range_.load();
  if (!faults || !range || p.device >= 0 || p.name.empty() || !faults()) return "";  // (staging: never guarded)
  bool hit = false;
  for (const RegionDesc& r : p.regions) hit |= range(r.base, r.stride * (uint64_t)p.num_pages) != 0;
  for (const AuxDesc& a : p.aux) hit |= range(a.base, a.row_bytes * (uint64_t)a.rows) != 0;
  if (hit)
    return "buffer set '" + p.name +
           "': its shared memory shrank under the service (the engine truncated or dropped it); its transfers "
           "fail: unregister it and register new memory";
  return "";
}

}  // namespace kvlane
