// The cross-node route, an engine's chunks of one transfer (FLAG_CHUNK SEND_TOs of a delta that
// fits the offered slot): each checked in order (x_next_chunk), packed at its place in the scratch
// and its WRITE posted to the same place in the slot (x_write_chunk), then finished in order
// (poll_writes: the WRITE seen done, its W note sent, the chunk booked) while the lane thread
// takes the next chunk: a stream's WRITEs overlap, its notes go in order.
//
//   lane thread:  SEND_TO k ─▶ check ─▶ pack k ─▶ post WRITE k ─▶ (next message) ─▶ poll_writes
//   xwrites_:     [k-2 done? ─▶ note, book] [k-1 in flight] [k in flight]     (front first)

#include <cstring>
#include <thread>

#include "lane.h"

namespace kvlane {

// mu_ held: a later chunk ``c`` of stream ``x``: in order, still offered and in time, inside the
// delta; taken (its aux rows read into ``aux``), or why not: a bad chunk changes nothing
// (``fatal`` false), one of a stream that is over or cannot complete ends it (``fatal``).
std::string Lane::x_next_chunk(XOut& x, const std::string& xk, const SendChunk& c, const std::vector<int32_t>& src,
                               std::string& aux, uint64_t& aux_bytes, bool& fatal) {
  fatal = true;
  auto pe = xpend_.find(xk);
  if (x.last || pe == xpend_.end()) return "transfer_id: the transfer already received its last chunk";
  if (pe->second.acked) return pe->second.ack_ok ? "transfer_id: the receiver has every page" : pe->second.ack_msg;
  if (x.state != RUNNING) return "transfer_id: the transfer was ended by its receiver";
  if (now_s() > x.deadline) return "transfer deadline passed";
  fatal = false;
  if (c.offset != x.next)
    return "chunk_offset: " + std::to_string(c.offset) + ": chunks must be contiguous and in order: expected " +
           std::to_string(x.next);
  // (in units: one a page, or gcd(page sizes) tokens between two page sizes: x.ms, x.md)
  const int64_t end = c.offset + (int64_t)src.size(), want = x.prefix + x.ndst;
  const int64_t end_u = end * x.ms, room = want * x.md;
  if (end_u > room && !fits(end_u, room, x.ms, x.md, c.last))
    return "src_page_indices: the chunk ends at page " + std::to_string(end) + " of a transfer of " +
           std::to_string(want) + (x.ms == x.md ? "" : " receiver") + " pages (prefix + delta)";
  auto ps = pools_.find(x.bs);
  if (ps == pools_.end()) {
    fatal = true;
    return "buffer set '" + x.bs + "' was unregistered";
  }
  std::string why = pages_ok(ps->second, src);
  if (why.empty()) why = aux_note(ps->second, c.aux, aux, aux_bytes);
  if (!why.empty()) return why;
  if (!fits(end_u, room, x.ms, x.md, c.last)) {
    fatal = true;
    return "sender finished with " + std::to_string((room - end_u + x.md - 1) / x.md) + " of " +
           std::to_string(x.ndst) + " delta pages unsent (prefix + delta)";
  }
  x.next = end;
  x.last = c.last;
  pe->second.inflight++;
  return "";
}

// One engine chunk of a stream: its delta pages packed at their place in the scratch and their
// WRITE posted to the same place in the slot; its W note (with its aux rows; XF_LAST on the last)
// goes once that WRITE and every earlier one of the lane's streams are done (poll_writes). A chunk
// of prefix pages only has a note alone when it has aux rows or is the last.
void Lane::x_write_chunk(const Pool& sp, const XOut& xo, const std::string& xk, const std::string& tid,
                         const SendChunk& c, const std::vector<int32_t>& src, const std::string& aux,
                         uint64_t aux_bytes) {
  // in units (xo.ms a sender page, xo.md a receiver page; 1, 1: pages): the chunk's past the
  // prefix and within the delta (a sender's last page may hold more than the receiver's last)
  const int64_t ms = xo.ms, md = xo.md, lo_d = xo.prefix * md, room = (xo.prefix + xo.ndst) * md;
  const int64_t lo = std::max(c.offset * ms, lo_d), end = std::min((c.offset + (int64_t)src.size()) * ms, room);
  const uint64_t d0 = (uint64_t)(lo - lo_d), m = (uint64_t)std::max<int64_t>(0, end - lo);
  const uint32_t flags = (c.last ? XF_LAST : 0) | (c.aux.empty() ? 0 : XF_AUX);
  const uint64_t off = d0 * xo.page;
  XWrite w;
  w.xo = xo;
  w.xk = xk;
  w.tid = tid;
  w.src = src;
  w.last = c.last;
  w.aux_bytes = aux_bytes;
  w.pages = m;
  w.page = xo.page;
  w.offset = c.offset;
  w.t0 = now_s();
  w.o.msg = note(XNOTE_WRITTEN, xo.rank, true, m * xo.page, m, d0, off, tid, aux, flags,
                 (uint32_t)(xo.first * ms / md), (uint32_t)md);
  w.note_only = !m && flags;
  if (m) {
    std::vector<int32_t> pairs(2 * m);
    for (uint64_t i = 0; i < m; ++i) {  // transfer unit t: unit t % ms of the sender's page t / ms
      const int64_t t = lo + (int64_t)i;
      pairs[2 * i] = (int32_t)(src[(size_t)(t / ms - c.offset)] * ms + t % ms);
      pairs[2 * i + 1] = (int32_t)i;
    }
    w.err = copy(sp, packed(xo.scratch + off, pack_like(sp, xo), sp.device), pairs, m, xo.rows);
    stat(S_PACK, w.t0);
    if (trace_on_) w.o.tr = ChunkTrace{tid, 0, d0, m, m * xo.page, {w.t0, now_s(), 0, 0, 0}};
    if (w.err.empty()) w.err = nx_post(xo.scratch + off, m * xo.page, sp.device, xo, off, w.o);
    if (!w.o.tr.tid.empty()) w.o.tr.t[2] = now_s();
  }
  xwrites_.push_back(std::move(w));
  poll_writes();  // a host WRITE is often done already
}

// Lane thread: the posted chunks, front first, while the front's WRITE is done: its note sent
// (unless its stream is failing: the receiver hears the failure instead), the chunk booked.
void Lane::poll_writes() {
  while (!xwrites_.empty()) {
    XWrite& w = xwrites_.front();
    // in flight: the ones behind it wait their turn (no lock taken while it is)
    if (w.o.req && w.err.empty() && !nx_poll(w.xo, w.o, w.err)) return;
    bool notify = w.err.empty();
    if (notify) {
      std::lock_guard<std::mutex> g(mu_);
      auto it = xpend_.find(w.xk);
      notify = it != xpend_.end() && it->second.fail_why.empty();
    }
    if (w.o.req && w.err.empty()) {
      w.err = nx_complete(w.xo, w.o, notify);
    } else if (w.o.req) {
      release_req(w.o.req);
      w.o.req = nullptr;
    } else if (w.note_only && notify) {
      send_note(w.xo.remote_agent, w.o.msg);
    }
    XWrite done = std::move(w);
    xwrites_.pop_front();
    book_chunk(done);
  }
}

// A stream's chunk finished (written, or failed): booked on its XPend. A failure, the chunk's or
// one recorded while chunks were in flight (fail_xstream), ends the stream once none is in flight
// (a WRITE still landing in the receiver's slot could otherwise meet the slot's next owner).
void Lane::book_chunk(XWrite& w) {
  std::string told, why;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = xpend_.find(w.xk);
    if (it == xpend_.end()) return;  // expired meanwhile (told already)
    XPend& pd = it->second;
    if (pd.inflight) pd.inflight--;
    pd.copy_us += (uint64_t)((now_s() - w.t0) * 1e6);
    pd.nbytes += w.aux_bytes;
    pd.src.insert(pd.src.end(), w.src.begin(), w.src.end());
    if (!w.err.empty() && pd.fail_why.empty()) {
      pd.fail_why = "cross-node write failed: " + w.err;
      auto x = xout_.find(w.xk);
      if (x != xout_.end()) x->second.last = true;
    }
    if (!pd.fail_why.empty()) {
      if (pd.inflight) return;
      told = pd.remote_agent;
      why = pd.fail_why;
      finish_sent(it, false, why);
    } else if (w.last) {
      st_[S_SENT]++;
      pd.written = true;
      if (pd.acked) finish_sent(it, pd.ack_ok, pd.ack_msg);
    } else {  // the sender's record follows the stream (Poll, WatchTransfers)
      Completion c;
      c.kind = DONE_XCHUNK;
      c.tid = w.tid;
      c.rank = pd.rank;
      c.bs = pd.bs;
      c.sender_session = pd.session;
      c.nbytes = w.pages * w.page + w.aux_bytes;
      c.copy_us = (uint64_t)((now_s() - w.t0) * 1e6);
      c.src = w.src;
      c.first = w.offset;
      completions_.push_back(std::move(c));
      signal_done();
    }
  }
  if (!told.empty()) send_note(told, note(XNOTE_WRITTEN, w.xo.rank, false, 0, 0, 0, 0, w.tid, why));
}

// mu_ held: stream ``xk`` fails with ``why`` between chunks: END to its engine now, and the
// receiving service hears it (a failure note, sent once mu_ is released: flush_notes). With
// chunks in flight it ends once they are done (book_chunk). True: a completion was queued.
bool Lane::fail_xstream(const std::string& xk, const std::string& why) {
  auto it = xpend_.find(xk);
  auto x = xout_.find(xk);
  if (x != xout_.end()) x->second.last = true;
  if (it == xpend_.end()) return false;
  if (it->second.inflight) {
    if (it->second.fail_why.empty()) it->second.fail_why = why;
    return false;
  }
  pending_notes_.emplace_back(it->second.remote_agent,
                              note(XNOTE_WRITTEN, it->second.rank, false, 0, 0, 0, 0, it->second.tid, why));
  finish_sent(it, false, why);
  return true;
}

bool Lane::fail_xstreams_of(int fd, const std::string& session, const std::string& why) {
  bool ended = false;
  for (auto& kv : xout_) {
    const XOut& x = kv.second;
    if (x.streaming && !x.last && ((fd >= 0 && x.fd == fd) || (!session.empty() && x.session == session)))
      ended |= fail_xstream(kv.first, why);
  }
  return ended;
}

// The failure notes queued under mu_ (fail_xstream), sent now (nx_mu_ is never taken inside mu_).
void Lane::flush_notes() {
  std::vector<std::pair<std::string, std::string>> go;
  {
    std::lock_guard<std::mutex> g(mu_);
    go.swap(pending_notes_);
  }
  for (auto& kv : go) send_note(kv.first, kv.second);
}


}  // namespace kvlane
