// What Python arms for the same-node route: engines' connections (after it authenticated them),
// pools (buffer sets) and transfers (a receiver rank's declaration), and their disarming.

#include <sys/epoll.h>
#include <unistd.h>

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

void Lane::drop_session(const std::string& session) {
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

int Lane::conns() {
  std::lock_guard<std::mutex> g(mu_);
  return (int)conns_.size();
}

void Lane::add_pool(const std::string& bs, const std::string& owner, int device, int64_t num_pages, uint64_t sig,
                    int rank, std::vector<RegionDesc> regions, uint64_t xsig) {
  Pool p{owner, device, num_pages, sig, rank, std::move(regions)};
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

void Lane::drop_pool(const std::string& bs) {
  std::lock_guard<std::mutex> g(mu_);
  pools_.erase(bs);
}

// Pool ``bs``'s heads, for head slices between TP sizes (see Pool::hmode).
void Lane::set_heads(const std::string& bs, int hmode, uint64_t msig, int hlo, int hn, int ps) {
  std::lock_guard<std::mutex> g(mu_);
  auto p = pools_.find(bs);
  if (p == pools_.end()) return;
  Pool& q = p->second;
  q.hmode = hmode, q.msig = msig, q.hlo = hlo, q.hn = hn, q.ps = ps;
}

void Lane::arm(const std::string& tid, int rank, const std::string& recv_session, const std::string& recv_bs,
               int64_t prefix, std::vector<int32_t> dst, double deadline, int senders) {
  Armed a;
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
int Lane::disarm(const std::string& tid, int rank) {
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

}  // namespace kvlane
