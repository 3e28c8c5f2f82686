// The cross-node route, sending: a SEND_TO checked against the receiver's offer (handle_x),
// packed into staging and written through NIXL in chunks (send_out, stream_out), ended by the
// receiver's ack (finish_sent).

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <numeric>
#include <thread>

#include "lane.h"

namespace kvlane {

// Pages packed page-major: page i's regions back to back (the layout both lanes derive).
Pool Lane::packed(uint64_t base, const Pool& like, int device) {
  Pool p{like.owner, "", device, INT32_MAX, like.sig, like.rank, {}};  // staging: its own life, never guarded
  p.ps = like.ps, p.lsig = like.lsig, p.rows = like.rows;  // (a pack into another page layout: its rows)
  uint64_t page = 0, off = 0;
  for (auto& r : like.regions) page += r.nbytes;
  for (auto& r : like.regions) {
    p.regions.push_back({base + off, page, r.nbytes});
    off += r.nbytes;
  }
  return p;
}

// How sender pool ``sp`` writes offer ``x``: whole pages (equal geometry), or units of g =
// gcd(page sizes) tokens between pools whose pages differ only in size (decision 0027: the
// receiver's unit signature and page size come with its offer); x.ms, x.md: units a sender /
// receiver page. The transfer's pages and the receiver's prefix and delta are counted in units
// from here on, and both sides copy unit views of their pools (Lane::unit_view).
//
// Pools of one page size whose page layouts differ (their row signatures agree: geometry.row_table)
// take x.rows: the sender packs each head's rows into the receiver's page layout (Lane::pack_like,
// from the receiver's layout), and the receiver unpacks whole pages of its own.
std::string Lane::x_units(const Pool& sp, XOut& x) {
  x.ms = x.md = 1;
  x.rows = false;
  if (sp.xsig && sp.xsig == x.xsig) return "";
  if (x.rlike && sp.lsig && sp.lsig == x.rlike->lsig && sp.ps == x.rps && sp.rows.size() == x.rlike->rows.size()) {
    for (size_t i = 0; i < sp.rows.size(); ++i)
      if (sp.rows[i].run != x.rlike->rows[i].run) return "layouts differ";
    x.rows = true;
    return "";
  }
  if (!sp.xusig || sp.xusig != x.xusig || sp.ps <= 0 || x.rps <= 0) return "layouts differ";
  const int g = std::gcd(sp.ps, x.rps), ms = sp.ps / g, md = x.rps / g;
  for (const RegionDesc& r : sp.regions)
    if (r.stride != r.nbytes || r.nbytes % (uint64_t)ms) return "layouts differ";
  if (sp.num_pages * ms > INT32_MAX || (x.prefix + x.ndst) * md > INT32_MAX) return "too many units for the lane";
  x.ms = ms, x.md = md;
  return "";
}

// Pool to pool, whole pages or units (a pack here, an unpack in cross_recv.cpp), waited for.
std::string Lane::copy(const Pool& sp, const Pool& dp, const std::vector<int32_t>& pairs, size_t moved, bool rows) {
  Target t;
  t.dp = dp;
  t.rows = rows;
  std::string err = cu_.copy(sp.device, dp.device, segments(sp, {t}, moved), pairs, moved);
  if (err.empty()) err = lost(sp);  // an engine's pool shrank under the copy (the other is staging)
  if (err.empty()) err = lost(dp);
  return err;
}

// mu_ held: the aux rows a chunk names, read from the sender's pool into a W note's message
// (name_len, n_rows, row_bytes | name | the rows' bytes, per name), or why not.
std::string Lane::aux_note(const Pool& sp, const std::vector<AuxRows>& aux, std::string& out, uint64_t& nbytes) const {
  for (const AuxRows& r : aux) {
    const AuxDesc* mine = nullptr;
    for (const AuxDesc& a : sp.aux)
      if (a.name == r.name) mine = &a;
    if (!mine) return "aux: the sender's buffer set has no aux region named '" + r.name + "'";
    const uint32_t hdr[3] = {(uint32_t)r.name.size(), (uint32_t)r.rows.size(), (uint32_t)mine->row_bytes};
    out.append((const char*)hdr, sizeof hdr).append(r.name);
    for (int64_t row : r.rows) {
      if (row < 0 || row >= mine->rows) return "aux[" + r.name + "]: a row outside the sender's region";
      out.append((const char*)(mine->base + (uint64_t)row * mine->row_bytes), mine->row_bytes);
      nbytes += mine->row_bytes;
    }
    if (out.size() > MAX_AUX_NOTE) return "aux: more than 64 KiB of aux rows in one chunk";
  }
  return "";
}

void Lane::handle_x(int fd, const char* p, size_t n) {
  if (n < sizeof(SendToHdr)) return closed(fd);
  SendToHdr h;
  std::memcpy(&h, p, sizeof h);
  const uint64_t w = h.flags & FLAG_SRC_I64 ? 8 : 4;
  const uint64_t head = (uint64_t)sizeof h + h.tid_len + h.bs_len + h.addr_len + w * h.n_src;
  if (head > n) return closed(fd);
  SendChunk c;
  const bool chunked = h.flags & FLAG_CHUNK;
  if (!chunked ? head != n : !read_chunk(p + head, n - head, c)) return closed(fd);
  const char* q = p + sizeof h;
  std::string tid(q, h.tid_len), bs(q + h.tid_len, h.bs_len), addr(q + h.tid_len + h.bs_len, h.addr_len);
  std::vector<int32_t> src;
  const bool src_ok = read_src(q + h.tid_len + h.bs_len + h.addr_len, h.n_src, w, src);

  std::string session, why;
  Pool sp;
  XOut xo;
  Arena ar;
  std::string xk;  // key(tid, the sender pool's rank): the receiver rank it pairs with
  uint64_t nbytes = 0, page = 0, chunk = 0, parts = 2;  // the delta's bytes, a page's, pages a chunk
  uint64_t scratch = 0;                                 // where it packs
  bool bulk = false;                                    // on the bulk thread (see XSMALL)
  int32_t code = REPLY_FALLBACK;
  bool first_chunk = true, ended = false;
  std::string aux;  // the chunk's aux rows, as its W note carries them
  uint64_t aux_bytes = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto cn = conns_.find(fd);
    if (cn == conns_.end()) return;
    session = cn->second.session;
    auto ps = pools_.find(bs);
    xk = key(tid, ps != pools_.end() ? ps->second.rank : -1);
    auto xi = xout_.find(xk);
    if (xi != xout_.end() && xi->second.streaming && xi->second.session == session && xi->second.bs == bs) {
      // a later chunk of a stream this lane has
      first_chunk = false;
      bool fatal = false;
      why = src_ok ? x_next_chunk(xi->second, xk, c, src, aux, aux_bytes, fatal)
                   : "src_page_indices: a page outside i32";
      code = fatal ? REPLY_REFUSED : REPLY_INVALID;
      if (why.empty()) {
        sp = unit_view(ps->second, xi->second.ms);
        xo = xi->second;
      } else if (fatal) {
        ended = fail_xstream(xk, why);
      }
    } else if (xi == xout_.end() && ps != pools_.end() && lane_peers_.count(addr) && !parked_.count(xk) &&
               !unparking_ && c.offset == 0) {
      // the receiver's offer may still be on its way (ExpectDelta and the prefill raced):
      // wait for it (20 ms at most; arm_out or refuse_out ends the wait), then fall back
      parked_[xk] = Parked{fd, std::string(p, n), now_s() + PARK_S};
      parked_count_ = parked_.size();
      return;
    } else if (!src_ok) {
      why = "source page out of range";
    } else if (ps == pools_.end() || ps->second.owner != session) {
      why = "buffer set not on the lane";
    } else if (xi == xout_.end() || xi->second.state != ARMED) {
      why = "transfer not offered to this node's lane";
    } else if (now_s() > xi->second.deadline) {
      why = "transfer deadline passed";
    } else if (xi->second.address != addr) {
      why = "offered by another receiving service than the one named";
    } else if (!(why = x_units(ps->second, xi->second)).empty()) {
      // (another layout, or page sizes the lane cannot convert: gRPC)
    } else if (c.offset * xi->second.ms > xi->second.prefix * xi->second.md) {
      why = "the first chunk starts past the receiver's prefix";
    } else if (!fits((c.offset + (int64_t)src.size()) * xi->second.ms, (xi->second.prefix + xi->second.ndst) * xi->second.md,
                     xi->second.ms, xi->second.md, c.last)) {
      why = "page count is not prefix + delta";
    } else if (arenas_.find(ps->second.device) == arenas_.end()) {
      why = "no lane staging on the sender's device";
    } else {
      why = pages_ok(ps->second, src);
      XOut& x = xi->second;
      sp = unit_view(ps->second, x.ms);  // whole pages, or units of gcd(page sizes) tokens
      // the delta's units (one a page when the page sizes agree); a one-shot send writes those
      // before its data ends (the tail of the receiver's last page may stay unwritten), an
      // engine's chunks each their own (x_write_chunk)
      const int64_t lo = x.prefix * x.md, room = (x.prefix + x.ndst) * x.md;
      x.units = (uint64_t)((chunked ? room : std::min((c.offset + (int64_t)src.size()) * x.ms, room)) - lo);
      xo = x;
      ar = arenas_[sp.device];
      for (auto& r : pack_like(sp, x).regions) page += r.nbytes;  // a packed page's (or unit's) bytes
      nbytes = page * (uint64_t)(room - lo);
      // A delta that fits the scratch's first part (XSMALL) whole is packed and written on
      // this thread (microseconds to a millisecond on a GPU); one that streams goes to the bulk
      // thread through the rest, so that it does not hold up the sends behind it (head of line)
      // while it takes milliseconds to seconds.
      const uint64_t scr = ar.size - ar.scratch, small = scr / XSMALL / 4096 * 4096;
      bulk = !(nbytes == xo.rbytes && nbytes <= small);  // (the whole delta's bytes: the slot's)
      scratch = ar.base + ar.scratch + (bulk ? small : 0);
      // one WRITE when slot and scratch area hold the delta, else chunks through parts of both
      const uint64_t cap = std::min(xo.rbytes, bulk ? scr - small : small);
      // (parts_ parts, fewer when the staging holds fewer pages; two at least)
      const uint64_t fit = cap / std::max<uint64_t>(page, 1);
      parts = std::max<uint64_t>(2, std::min<uint64_t>(parts_, fit));
      chunk = nbytes == xo.rbytes && nbytes <= cap ? xo.units : fit / parts;
      if (why.empty() && xo.rbytes > nbytes) why = "the offered slot does not match the delta";
      if (why.empty() && chunk == 0) why = "the lane's staging holds less than two pages";
      // an engine's chunks: each written where its pages go in the slot (the delta fits it)
      if (why.empty() && chunked && bulk) why = "a chunked delta larger than the lane's slot goes over gRPC";
      if (why.empty() && chunked) why = aux_note(sp, c.aux, aux, aux_bytes);
      if (why.empty()) {
        x.state = RUNNING;
        if (chunked) {
          x.streaming = true, x.last = c.last, x.fd = fd, x.session = session, x.bs = bs;
          x.next = c.offset + (int64_t)src.size(), x.scratch = scratch, x.page = page, x.first = c.offset;
          xo = x;
        }
      }
    }
  }
  if (ended) {
    signal_done();
    flush_notes();
  }
  if (!why.empty()) return reply(fd, h.seq, code, why);
  reply(fd, h.seq, REPLY_ACCEPTED, "");
  if (!first_chunk) return x_write_chunk(sp, xo, xk, tid, c, src, aux, aux_bytes);

  const size_t moved = (size_t)xo.ndst;
  XPend pend;
  pend.tid = tid;
  pend.fd = fd;
  pend.rank = xo.rank;
  pend.session = session;
  pend.bs = bs;
  pend.remote_agent = xo.remote_agent;
  pend.nbytes = chunked ? nbytes : page * xo.units;
  pend.npages = moved;
  pend.prefix = (uint64_t)(xo.prefix * xo.md / xo.ms);  // the sender's pages skipped (its END)
  pend.flags = h.flags;
  pend.deadline = xo.deadline;
  pend.first = c.offset;
  pend.inflight = 1;  // this chunk (or the whole delta)
  {
    std::lock_guard<std::mutex> g(mu_);
    xpend_[xk] = std::move(pend);  // before the WRITE: its ack may come before we see it done
  }
  xcv_.notify_one();
  if (chunked) return x_write_chunk(sp, xo, xk, tid, c, src, aux, aux_bytes);
  XSend job{std::move(sp), std::move(xo), xk, tid, std::move(src), scratch, page, chunk, parts};
  if (!bulk) return send_out(job);
  to_bulk([this, job]() mutable { send_out(job); });
}

// Pack and write an accepted SEND_TO (its XPend is registered), then book what came of it.
void Lane::send_out(XSend& job) {
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
    it->second.inflight = 0;
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
std::string Lane::stream_out(const Pool& sp, const XOut& xo, const std::string& xk, const std::string& tid,
                             const std::vector<int32_t>& src, uint64_t scratch, uint64_t page, uint64_t chunk,
                             uint64_t parts) {
  const uint64_t n = xo.units, chunks = (n + chunk - 1) / chunk;
  const int64_t lo = xo.prefix * xo.md;  // the delta's first unit in the transfer
  std::vector<Posted> out(parts);  // per part: its WRITE in flight, and the note that follows it
  std::string err;
  std::vector<int32_t> pairs;
  for (uint64_t k = 0; k < chunks && err.empty(); ++k) {
    const uint64_t h = k % parts;
    const uint64_t first = k * chunk, cnt = std::min(chunk, n - first), off = h * chunk * page;
    if (k >= parts) err = await_credits(xk, k - parts + 1, xo.deadline, sp);  // chunk k - P left part h
    if (!err.empty()) break;
    pairs.resize(2 * cnt);
    for (uint64_t i = 0; i < cnt; ++i) {  // transfer unit t: unit t % ms of the sender's page t / ms
      const int64_t t = lo + (int64_t)(first + i);
      pairs[2 * i] = (int32_t)(src[(size_t)(t / xo.ms)] * xo.ms + t % xo.ms);
      pairs[2 * i + 1] = (int32_t)i;
    }
    const double t0 = now_s();
    err = copy(sp, packed(scratch + off, pack_like(sp, xo), sp.device), pairs, cnt, xo.rows);
    stat(S_PACK, t0);
    if (!err.empty()) break;
    out[h].msg = note(XNOTE_WRITTEN, xo.rank, true, cnt * page, cnt, first, off, tid, "", first + cnt == n ? XF_LAST : 0,
                      0, (uint32_t)xo.md);
    if (trace_on_) out[h].tr = ChunkTrace{tid, 0, first, cnt, cnt * page, {t0, now_s(), 0, 0, 0}};
    err = nx_post(scratch + off, cnt * page, sp.device, xo, off, out[h]);
    if (!out[h].tr.tid.empty()) out[h].tr.t[2] = now_s();
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
std::string Lane::await_credits(const std::string& xk, uint64_t need, double deadline, const Pool& sp) {
  std::unique_lock<std::mutex> g(mu_);
  for (;;) {
    auto it = xpend_.find(xk);
    if (it == xpend_.end()) return "the transfer ended meanwhile";
    if (it->second.acked)
      return it->second.ack_ok ? "the receiver acknowledged before the last chunk" : it->second.ack_msg;
    if (it->second.credits >= need) return "";
    if (!running_) return "the lane is stopping";
    if (sp.life->dropped) return "buffer set '" + sp.name + "' was unregistered";
    if (now_s() > deadline) return "the receiver unpacked no chunk before the transfer's deadline";
    credit_cv_.wait_for(g, std::chrono::milliseconds(1));
  }
}

void Lane::kick() {  // mu_ held: wake the lane thread to look at the parked SEND_TOs
  kicked_ = true;
  uint64_t one = 1;
  (void)!write(wake_, &one, 8);
}

// Lane thread: each parked SEND_TO whose offer came is handled now, one past its wait (or
// refused) is answered FALLBACK.
void Lane::unpark() {
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

std::string Lane::note(uint32_t kind, int rank, bool ok, uint64_t nbytes, uint64_t npages, uint64_t first, uint64_t off,
                       const std::string& tid, const std::string& msg, uint32_t flags, uint32_t src_first,
                       uint32_t per_page) {
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
  h.flags = flags;
  h.src_first = src_first;
  h.per_page = per_page;
  return std::string((const char*)&h, sizeof h) + tid + msg;
}

// Post one WRITE of [local, local + n) to ``off`` in the offered slot; ``o.msg`` tells the
// receiver: sent once the WRITE is DONE (nx_finish: the bytes are there), or as the WRITE's own
// notification (note_after off: NIXL's UCX backend flushes the endpoint inside the post then,
// ~0.2 ms on cuda_ipc). A finished WRITE is kept and re-posted for the same bytes and slot.
std::string Lane::nx_post(uint64_t local, uint64_t n, int device, const XOut& xo, uint64_t off, Posted& o) {
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
  o.at = now_s();
  return "";
}

// Until ``o``'s WRITE is done (or the deadline passed: then released, which aborts it), then
// the receiver's note.
std::string Lane::nx_finish(const XOut& xo, Posted& o) {
  std::string err;
  while (!nx_poll(xo, o, err)) std::this_thread::yield();
  return err.empty() ? nx_complete(xo, o, true) : err;
}

bool Lane::nx_poll(const XOut& xo, Posted& o, std::string& err) {
  int r = o.state;
  if (r == xnixl::IN_PROG) {
    if (now_s() > xo.deadline || !running_) {
      release_req(o.req);  // a request released in flight is aborted by NIXL
      o.req = nullptr;
      err = running_ ? "the WRITE outlived the transfer's deadline" : "the lane is stopping";
      return true;
    }
    std::lock_guard<std::mutex> g(nx_mu_);
    r = o.state = nx_.get_xfer_status(agent_, o.req);
  }
  if (r == xnixl::IN_PROG) return false;
  stat(S_WAIT, o.at);
  if (!o.tr.tid.empty()) o.tr.t[3] = now_s();
  if (r != xnixl::OK) {
    release_req(o.req);
    o.req = nullptr;
    err = "the WRITE failed (" + std::to_string(r) + ")";
  }
  return true;
}

std::string Lane::nx_complete(const XOut& xo, Posted& o, bool notify) {
  void* req = o.req;
  o.req = nullptr;
  if (!req_cache_) {
    release_req(req);
  } else {
    std::lock_guard<std::mutex> g(nx_mu_);
    reqs_[o.rkey] = req;  // re-posted by the next WRITE of the same bytes to the same place
  }
  if (o.after && notify) {
    std::lock_guard<std::mutex> g(nx_mu_);
    const int r = nx_.gen_notif(agent_, xo.remote_agent.c_str(), o.msg.data(), o.msg.size(), nullptr);
    if (r != xnixl::OK) return "notifying the receiver failed (" + std::to_string(r) + ")";
  }
  if (!o.tr.tid.empty()) {
    o.tr.t[4] = now_s();
    trace(std::move(o.tr));
    o.tr = ChunkTrace{};
  }
  return "";
}

void Lane::release_req(void* req) {
  std::lock_guard<std::mutex> g(nx_mu_);
  if (nx_.release_xfer_req(agent_, req) == xnixl::OK) nx_.destroy_xfer_req(req);
}

// mu_ held: END to the sending engine and the completion for Python's books.
void Lane::finish_sent(std::unordered_map<std::string, XPend>::iterator it, bool ok, const std::string& err) {
  XPend& p = it->second;
  const std::string tid = p.tid;
  Completion done;
  done.kind = DONE_SENT;
  done.told_send =
      tell(p.fd, p.session, end_msg(1, ok, tid, p.bs, err, p.nbytes, p.npages, p.prefix, p.copy_us, END_CROSS));
  done.tid = tid;
  done.rank = p.rank;
  done.bs = p.bs;
  done.sender_session = p.session;
  done.ok = ok;
  done.error = err;
  done.nbytes = p.nbytes;
  done.copy_us = p.copy_us;
  done.flags = p.flags;
  done.first = p.first;
  done.src.swap(p.src);
  completions_.push_back(std::move(done));
  auto xo = xout_.find(it->first);  // the same key(tid, rank)
  if (xo != xout_.end()) xo->second.state = COMPLETED;
  xpend_.erase(it);
  uint64_t one = 1;
  (void)!write(done_, &one, 8);
}

void Lane::expire_sent() {  // no ack a second past the deadline: the receiver is gone or wedged
  std::lock_guard<std::mutex> g(mu_);
  const double now = now_s();
  for (auto it = xpend_.begin(); it != xpend_.end();) {
    auto next = std::next(it);
    if (now > it->second.deadline + 1.0 && (it->second.written || !it->second.inflight))
      finish_sent(it, false, "the receiving service did not acknowledge before the deadline");
    it = next;
  }
}

}  // namespace kvlane
