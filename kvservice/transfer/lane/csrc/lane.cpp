// The lane's threads and its reader loop: a message from an engine's socket goes to its route
// (same_node.cpp, cross_send.cpp); REPLY and END go back on the same socket; completions queue for
// Python's bookkeeping (drain).

#include "lane.h"

#include <errno.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>

#include <cstring>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>

namespace kvlane {

Lane::Lane() {
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

void Lane::stop() {
  if (!running_.exchange(false)) return;
  uint64_t one = 1;
  (void)!write(wake_, &one, 8);
  cu_.wake();  // a launch waiting for a ring slot gives up
  if (thread_.joinable()) thread_.join();
  poll_writes();  // the chunks it posted fail now ("the lane is stopping") and end their streams
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

void Lane::run() {
  std::vector<char> buf(MAX_MSG);
  epoll_event evs[64];
  double busy = 0;  // when this thread last handled a message
  while (running_) {
    // NOTE: within spin_us_ of the last message the thread polls without sleeping: a sleeping
    // thread's wake-up on an idle core of the GPU host cost tens of µs per hop
    // (bench/probe_lane.py), the whole budget of a small transfer
    const bool spin = spin_us_ && (now_s() - busy) * 1e6 < spin_us_;
    // (chunks' WRITEs in flight: polled between messages, never slept on)
    int n = epoll_wait(epfd_, evs, 64, spin || !xwrites_.empty() ? 0 : parked_count_ ? 1 : -1);
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
    if (!xwrites_.empty()) poll_writes();
  }
}

// A connection ended: its SEND_TOs parked for an offer go, its streams still taking chunks fail.
void Lane::closed(int fd) {
  bool ended = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = parked_.begin(); it != parked_.end();) it = it->second.fd == fd ? parked_.erase(it) : std::next(it);
    parked_count_ = parked_.size();
    if (conns_.erase(fd)) {
      epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr);
      close(fd);
      ended = fail_streams_of_fd(fd);
      ended |= fail_xstreams_of(fd, "", "the sending engine's lane closed before its last chunk");
    }
  }
  if (ended) {
    signal_done();
    flush_notes();
  }
}

// mu_ held: ``m`` to connection ``fd`` if it is still one of ``session``'s (the number of a
// closed connection may belong to another engine's by now: it gets nothing).
bool Lane::tell(int fd, const std::string& session, const std::string& m) {
  auto c = conns_.find(fd);
  return c != conns_.end() && c->second.session == session && sendmsg_(fd, m);
}

bool Lane::sendmsg_(int fd, const std::string& m) {
  return send(fd, m.data(), m.size(), MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)m.size();
}

void Lane::reply(int fd, uint32_t seq, int32_t code, const std::string& msg) {
  ReplyHdr h{MSG_REPLY, seq, code, (uint32_t)msg.size()};
  std::string m((const char*)&h, sizeof h);
  sendmsg_(fd, m + msg);
}

std::string Lane::end_msg(uint32_t role, bool ok, const std::string& tid, const std::string& bs, const std::string& err,
                          uint64_t nbytes, uint64_t npages, uint64_t skipped, uint64_t us, uint32_t flags,
                          const LocalCopy* at) {
  EndHdr h{MSG_END, role, ok ? 0u : 1u, (uint32_t)tid.size(), (uint32_t)bs.size(), (uint32_t)err.size(), nbytes, npages,
           skipped, us};
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
bool Lane::read_src(const char* q, uint32_t n, uint64_t w, std::vector<int32_t>& out) {
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

void Lane::to_bulk(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> g(bulk_mu_);
    bulk_q_.push_back(std::move(job));
  }
  bulk_cv_.notify_one();
}

// The bulk thread: what would hold the lane thread up for milliseconds (larger cross-node
// sends, larger same-node copies), one at a time in arrival order; what is queued when the lane
// stops still runs (a cross-node send then fails at once, a copy completes).
// NOTE: within spin_us_ of its last job or of an offer (heat_bulk) it polls its queue instead of
// sleeping: a cold wake-up cost the first chunk of a streamed send ~50 µs (lane.cpp run()).
void Lane::bulk_run() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> g(bulk_mu_);
      while (bulk_q_.empty() && running_) {
        if (bulk_hot()) {
          g.unlock();
          std::this_thread::yield();
          g.lock();
        } else {
          bulk_cv_.wait(g, [this] { return !bulk_q_.empty() || !running_ || bulk_hot(); });
        }
      }
      if (bulk_q_.empty()) return;
      job = std::move(bulk_q_.front());
      bulk_q_.pop_front();
    }
    job();
    bulk_at_ = now_s();
  }
}

void Lane::heat_bulk() {
  if (!spin_us_) return;
  bulk_at_ = now_s();
  {
    std::lock_guard<std::mutex> g(bulk_mu_);  // no lost wake-up between its check and its wait
  }
  bulk_cv_.notify_one();
}

std::deque<Completion> Lane::drain() {
  uint64_t v;
  (void)!read(done_, &v, 8);  // first: a completion queued after the swap signals again
  std::deque<Completion> got;
  {
    std::lock_guard<std::mutex> g(mu_);
    got.swap(completions_);
  }
  return got;
}

// A CALL: queued for Python with the connection's session (it answers with answer()), or
// FALLBACK while Python takes none or too many wait.
void Lane::handle_call(int fd, const char* p, size_t n) {
  CallHdr h;
  if (n < sizeof h) return closed(fd);
  std::memcpy(&h, p, sizeof h);
  if ((uint64_t)sizeof h + h.rid_len + h.body_len != n || h.rid_len > 64) return closed(fd);
  bool queued = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto cn = conns_.find(fd);
    if (cn == conns_.end()) return;
    if (calls_on_ && calls_.size() < kCallsMax) {
      LaneCall c;
      c.fd = fd, c.session = cn->second.session, c.seq = h.seq, c.kind = h.kind;
      c.rid.assign(p + sizeof h, h.rid_len);
      c.body.assign(p + sizeof h + h.rid_len, h.body_len);
      calls_.push_back(std::move(c));
      queued = true;
    }
  }
  if (queued)
    signal_done();
  else
    reply(fd, h.seq, REPLY_FALLBACK, "");
}

std::deque<LaneCall> Lane::take_calls() {
  std::deque<LaneCall> got;
  std::lock_guard<std::mutex> g(mu_);
  got.swap(calls_);
  return got;
}

bool Lane::answer(int fd, const std::string& session, uint32_t seq, int32_t code, const std::string& msg) {
  ReplyHdr h{MSG_REPLY, seq, code, (uint32_t)msg.size()};
  std::string m((const char*)&h, sizeof h);
  m += msg;
  std::lock_guard<std::mutex> g(mu_);
  return tell(fd, session, m);
}

std::vector<ChunkTrace> Lane::take_trace() {
  std::lock_guard<std::mutex> g(trace_mu_);
  std::vector<ChunkTrace> out;
  out.swap(trace_);
  return out;
}

std::vector<uint64_t> Lane::stats() {
  std::vector<uint64_t> out;
  for (auto& s : st_) out.push_back(s.load());
  out[S_COPIES] = cu_.copies();
  out[S_CULOCK] = cu_.lock_us();
  out[S_CUSYNC] = cu_.sync_us();
  return out;
}

}  // namespace kvlane
