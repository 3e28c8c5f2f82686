// The cross-node route, receiving: the notification thread (xrun) reads NIXL's notes; a chunk
// written into a slot here is unpacked into the declared pages (on_written), then acked or
// credited; a sender's failure fails the declaration (on_failed).

#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "lane.h"

namespace kvlane {

void Lane::send_note(const std::string& agent, const std::string& msg) {
  std::lock_guard<std::mutex> g(nx_mu_);
  nx_.gen_notif(agent_, agent.c_str(), msg.data(), msg.size(), nullptr);
}

// The notification thread: busy (10 µs naps) while a cross-node transfer is armed or waits
// for its ack, else a 50 ms nap (arming one wakes it; an idle service costs ~nothing, and a
// stray note, e.g. a late WRITE's, is still answered); what arrives is handled here.
void Lane::xrun() {
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

void Lane::on_note(const std::string& agent, const std::string& m) {
  XNote h;
  if (m.size() < sizeof h) return;
  std::memcpy(&h, m.data(), sizeof h);
  if (std::memcmp(h.magic, XMAGIC, 4) != 0 || sizeof h + (uint64_t)h.tid_len + h.msg_len != m.size()) return;
  std::string tid = m.substr(sizeof h, h.tid_len), msg = m.substr(sizeof h + h.tid_len, h.msg_len);
  stat(h.kind == XNOTE_WRITTEN ? S_NOTE : S_ACK, h.at);
  if (h.kind == XNOTE_WRITTEN && !h.ok) return on_failed(agent, tid, (int)h.rank, msg);
  if (h.kind == XNOTE_WRITTEN)
    return on_written(agent, tid, (int)h.rank, h.nbytes, h.npages, h.first, h.off, h.flags, msg, h.src_first,
                      h.per_page);
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
void Lane::on_failed(const std::string& agent, const std::string& tid, int rank, const std::string& why) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = xin_.find(key(tid, rank));
  if (it == xin_.end() || it->second.state != ARMED || it->second.sender_agent != agent) return;
  it->second.state = COMPLETED;
  finish_received(it->second, tid, rank, why, 0, 0, 0, 0, true);
}

// mu_ held: END to the receiving engine and the completion for Python's books.
// ``tell`` false (CANCELLED): Python books the end and the engine hears it from the service.
void Lane::finish_received(const XIn& xi, const std::string& tid, int rank, const std::string& err, uint64_t nbytes,
                           uint64_t npages, uint64_t prefix, uint64_t us, bool tell, int64_t src_first) {
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
  done.first = src_first;
  completions_.push_back(std::move(done));
  uint64_t one = 1;
  (void)!write(done_, &one, 8);
}

// A chunk of the sender's pages is in our slot: unpack it into the declared pages; after the
// last, END to the receiving engine, then ack to the sender (it reports DONE only after that);
// after another, a credit (its half of the slot is free). A page-size conversion's notes count
// units (``per_page`` a receiver page, of gcd(page sizes) tokens): unit r of the delta lands in
// unit r % per_page of declared page r / per_page, and a last chunk may leave a tail of the
// last page unwritten (the sequence ends there).
void Lane::on_written(const std::string& agent, const std::string& tid, int rank, uint64_t nbytes, uint64_t npages,
                      uint64_t first, uint64_t off, uint32_t flags, const std::string& aux, uint32_t src_first,
                      uint32_t per_page) {
  const std::string k = key(tid, rank);
  const double t_note = now_s();
  std::string why;
  XIn xi;  // the declaration's fields but its pages
  Pool dp;
  std::vector<int32_t> pairs;
  const uint64_t per = std::max<uint32_t>(per_page, 1);
  uint64_t page = 0, total = 0, ndst = 0;  // a unit's bytes; the delta's units, pages
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = xin_.find(k);
    auto pd = it == xin_.end() ? pools_.end() : pools_.find(it->second.recv_bs);
    bool units_ok = true;  // (units: pools whose pages are their tokens' rows, pages back to back)
    if (pd != pools_.end()) {
      const Pool& q = pd->second;
      if (per > 1) units_ok = q.xusig && q.ps > 0 && q.ps % per == 0 && q.num_pages * (int64_t)per <= INT32_MAX;
      for (auto& r : q.regions) units_ok &= per == 1 || (r.stride == r.nbytes && r.nbytes % per == 0);
      for (auto& r : q.regions) page += r.nbytes / per;
    }
    if (it != xin_.end()) ndst = it->second.dst.size(), total = ndst * per;
    if (it == xin_.end() || it->second.state != ARMED) {
      why = "transfer not armed on the receiving service's lane";
    } else if (it->second.sender_agent != agent) {
      why = "written by another service than the one offered";
    } else if (now_s() > it->second.deadline) {
      why = "transfer deadline passed";
    } else if (pd == pools_.end()) {
      why = "receiver buffer set gone";
    } else if (!units_ok || (it->second.md && it->second.md != per)) {
      why = "the sender's units do not divide the receiver's pages";
    } else if (first != it->second.got) {
      why = "chunk out of order";
    } else if ((npages == 0 && !flags) || first + npages > total || nbytes != npages * page ||
               off + nbytes > it->second.bytes) {
      why = "chunk outside the offer";
    } else {
      dp = unit_view(pd->second, (int)per);
      it->second.md = (uint32_t)per;
      xi.aux = it->second.aux;
      it->second.state = RUNNING;
      XIn& x = it->second;
      xi.recv_session = x.recv_session;
      xi.recv_bs = x.recv_bs;
      xi.prefix = x.prefix;
      xi.slot = x.slot;
      xi.device = x.device;
      pairs.resize(2 * npages);
      for (uint64_t i = 0; i < npages; ++i) {
        const uint64_t r = first + i;
        pairs[2 * i] = (int32_t)i;
        pairs[2 * i + 1] = (int32_t)(x.dst[r / per] * (int64_t)per + (int64_t)(r % per));
      }
    }
  }
  if (!why.empty()) return send_note(agent, note(XNOTE_ACK, rank, false, 0, 0, 0, 0, tid, why));
  if (const unsigned slow = slow_unpack_us_) std::this_thread::sleep_for(std::chrono::microseconds(slow));
  const double t0 = now_s();
  std::string err = dp.device != xi.device ? "the lane's staging is on another device than the receiver's pool"
                    : npages                ? copy(packed(xi.slot + off, dp, xi.device), dp, pairs, npages)
                                            : "";
  uint64_t aux_bytes = 0;
  if (err.empty() && (flags & XF_AUX)) err = land_aux(xi, dp, aux, aux_bytes);
  const double t_unpacked = now_s();
  const uint64_t us = (uint64_t)((t_unpacked - t0) * 1e6);
  st_[S_UNPACK] += us;
  bool last = false, cancelled = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = xin_.find(k);
    if (it == xin_.end()) return;  // forgotten meanwhile (the service is closing)
    XIn& x = it->second;
    x.got += npages;
    x.us += us;
    x.aux_done |= (flags & XF_AUX) != 0;
    x.aux_bytes += aux_bytes;
    x.src_first = src_first;
    // the sender's last note ends it (a one-shot's last part says so too), all of the delta
    // written but for a tail of its last page (units: where the sequence ends)
    last = (flags & XF_LAST) && total - x.got < per;
    if (err.empty() && (flags & XF_LAST) && !last)
      err = "sender finished with " + std::to_string((total - x.got + per - 1) / per) + " of " + std::to_string(ndst) +
            " delta pages unsent";
    if (err.empty() && last && !x.aux.empty() && !x.aux_done)
      err = "every sender finished but no sender delivered the declared aux rows";
    cancelled = x.cancel && !last && err.empty();
    if (!last && err.empty() && !cancelled) {
      x.state = ARMED;  // the next chunk's
    } else {
      x.state = COMPLETED;
      st_[S_RECEIVED]++;
      if (cancelled) err = CANCELLED;
      const uint64_t skipped = (uint64_t)std::max<int64_t>(0, xi.prefix - x.src_first);
      finish_received(xi, tid, rank, err, x.got * page + x.aux_bytes, ndst, skipped, x.us, !cancelled, x.src_first);
    }
  }
  if (!last && err.empty())
    send_note(agent, note(XNOTE_CREDIT, rank, true, nbytes, npages, first, off, tid, ""));
  else
    send_note(agent, note(XNOTE_ACK, rank, err.empty(), total * page, ndst, 0, 0, tid, err));
  if (trace_on_) trace(ChunkTrace{tid, 1, first, npages, nbytes, {t_note, t0, t_unpacked, now_s(), 0}});
}

// The aux rows a W note carries (aux_note's format) written into the receiver's declared rows
// (host memory), each name checked against the declaration and the region; or why not.
std::string Lane::land_aux(const XIn& x, const Pool& dp, const std::string& aux, uint64_t& nbytes) const {
  size_t at = 0;
  while (at < aux.size()) {
    uint32_t hdr[3];
    if (aux.size() - at < sizeof hdr) return "aux rows: a malformed note";
    std::memcpy(hdr, aux.data() + at, sizeof hdr);
    at += sizeof hdr;
    if (aux.size() - at < hdr[0]) return "aux rows: a malformed note";
    const std::string name = aux.substr(at, hdr[0]);
    at += hdr[0];
    const uint64_t rb = hdr[2], n = hdr[1];
    if (rb && (aux.size() - at) / rb < n) return "aux rows: a malformed note";
    const AuxDesc* theirs = nullptr;
    for (const AuxDesc& a : dp.aux)
      if (a.name == name) theirs = &a;
    const AuxRows* want = nullptr;
    for (const AuxRows& r : x.aux)
      if (r.name == name) want = &r;
    if (!theirs || !want) return "aux: receiver has no aux region named '" + name + "'";
    if (want->rows.size() != n)
      return "aux[" + name + "]: sender names " + std::to_string(n) + " rows, receiver declared " +
             std::to_string(want->rows.size());
    if (theirs->row_bytes != rb) return "aux[" + name + "]: row sizes differ";
    for (uint64_t i = 0; i < n; ++i) {
      const int64_t d = want->rows[i];
      if (d < 0 || d >= theirs->rows) return "aux[" + name + "]: a row outside the receiver's region";
      std::memcpy((void*)(theirs->base + (uint64_t)d * rb), aux.data() + at + i * rb, rb);
      nbytes += rb;
    }
    at += n * rb;
  }
  return lost(dp);
}

}  // namespace kvlane
