// The same-node route, accepting: a SEND (one chunk of a transfer, or all of it) checked against
// what is armed and against its stream's earlier chunks (handle, first_chunk, next_chunk), then
// handed to the copy (same_copy.cpp: copy_local).
//
//   first chunk of (tid, sender pool) ─▶ targets + check + aux ─▶ a Stream ─▶ copy_local
//   a later chunk                      ─▶ in order, still armed ─▶ the Stream ─▶ copy_local
//   anything the lane cannot take: a first chunk is answered FALLBACK (the engine makes the gRPC
//   call, which has the full validation); a later one (the lane has the transfer: gRPC could not
//   continue it) INVALID when the chunk is bad (nothing changes, the transfer goes on, as over
//   gRPC), REFUSED when the transfer is over or must end (its stream ends FAILED with the reason).

#include <unistd.h>

#include <cstring>
#include <exception>
#include <numeric>
#include <stdexcept>

#include "lane.h"

namespace kvlane {

// A chunked SEND's (or SEND_TO's) trailer and aux rows (wire.h); false: malformed.
bool Lane::read_chunk(const char* q, size_t n, SendChunk& c) {
  ChunkTrailer t;
  if (n < sizeof t) return false;
  std::memcpy(&t, q, sizeof t);
  c.offset = (int64_t)t.offset;
  c.last = t.last != 0;
  if (t.offset > (uint64_t)INT32_MAX || t.n_aux > 64) return false;
  size_t at = sizeof t;
  for (uint32_t i = 0; i < t.n_aux; ++i) {
    AuxHdr a;
    if (n - at < sizeof a) return false;
    std::memcpy(&a, q + at, sizeof a);
    at += sizeof a;
    if (a.name_len > 256 || n - at < a.name_len || (n - at - a.name_len) / 8 < a.n_rows) return false;
    AuxRows r;
    r.name.assign(q + at, a.name_len);
    at += a.name_len;
    r.rows.resize(a.n_rows);
    if (a.n_rows) std::memcpy(r.rows.data(), q + at, 8ull * a.n_rows);
    at += 8ull * a.n_rows;
    c.aux.push_back(std::move(r));
  }
  return at == n;
}

namespace {

const AuxDesc* aux_of(const Pool& p, const std::string& name) {
  for (const AuxDesc& a : p.aux)
    if (a.name == name) return &a;
  return nullptr;
}

const AuxRows* rows_of(const std::vector<AuxRows>& v, const std::string& name) {
  for (const AuxRows& r : v)
    if (r.name == name) return &r;
  return nullptr;
}

}  // namespace

void Lane::handle(int fd, const char* p, size_t n) {
  uint32_t type = 0;
  if (n >= 4) std::memcpy(&type, p, 4);
  if (type == MSG_CALL) return handle_call(fd, p, n);
  if (n < sizeof(SendHdr)) return closed(fd);  // not our protocol: drop the connection
  SendHdr h;
  std::memcpy(&h, p, sizeof h);
  if (h.type == MSG_SEND_TO) return handle_x(fd, p, n);
  const uint64_t w = h.flags & FLAG_SRC_I64 ? 8 : 4;
  const uint64_t head = (uint64_t)sizeof h + h.tid_len + h.bs_len + w * h.n_src;
  if (h.type != MSG_SEND || head > n) return closed(fd);
  SendChunk c;
  if (!(h.flags & FLAG_CHUNK) ? head != n : !read_chunk(p + head, n - head, c)) return closed(fd);
  std::string tid(p + sizeof h, h.tid_len), bs(p + sizeof h + h.tid_len, h.bs_len);
  std::vector<int32_t> src;
  const bool src_ok = read_src(p + sizeof h + h.tid_len + h.bs_len, h.n_src, w, src);

  std::string session, why;
  int32_t code = REPLY_FALLBACK;
  LocalCopy job;
  job.at_recv = at_msg_;
  bool ended = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto cn = conns_.find(fd);
    if (cn == conns_.end()) return;
    session = cn->second.session;
    auto ps = pools_.find(bs);
    if (ps == pools_.end() || ps->second.owner != session) {
      why = "buffer set not on the lane";
    } else {
      job.sp = ps->second;
      job.skey = tid + '\0' + bs;
      auto st = streams_.find(job.skey);
      auto en = ended_.find(job.skey);
      if (st != streams_.end()) {
        bool fatal = false;
        why = src_ok ? next_chunk(st->second, c, src, job, fatal) : "src_page_indices: a page outside i32";
        code = fatal ? REPLY_REFUSED : REPLY_INVALID;
        if (fatal) ended = fail_stream(st, why);
      } else if (en != ended_.end() && c.offset > 0 && (!en->second.got_last || c.offset == en->second.next)) {
        // as over gRPC: a chunk right after a finished transfer's last is a bad chunk_offset (a
        // new transfer under the id starts with its own first chunk); any chunk of a transfer
        // that ended before its last is refused
        const Ended& e = en->second;
        code = e.got_last ? REPLY_INVALID : REPLY_REFUSED;
        why = e.got_last ? "chunk_offset: " + std::to_string(c.offset) + " follows the last chunk of transfer '" + tid +
                               "' (ended " + e.how + "); a new transfer under this id starts with its own first chunk"
                         : "transfer_id: '" + tid + "' already ended " + e.how;
      } else {
        why = src_ok ? first_chunk(tid, session, fd, h.flags, c, src, job) : "source page out of range";
      }
    }
  }
  if (ended) signal_done();
  if (!why.empty()) return reply(fd, h.seq, code, why);
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
  for (auto& r : job.sp.regions) bytes += r.nbytes * job.src.size();
  // (a host chunk behind one on the bulk thread queues there too: a stream's chunks end in order)
  if ((bytes < LOCAL_BULK_BYTES && !job.behind) || job.sp.device >= 0) return copy_local(job);
  to_bulk([this, job]() mutable { copy_local(job); });
}

// mu_ held: the first chunk of (tid, the sender's pool ``job.sp``): its targets checked, its
// stream opened, each target's declaration taken (atomic with the checks: a disarm sees it
// pending), or why not.
std::string Lane::first_chunk(const std::string& tid, const std::string& session, int fd, uint32_t flags,
                              const SendChunk& c, const std::vector<int32_t>& src, LocalCopy& job) {
  std::string why = targets(tid, job.sp, c, src, job.tg, job.prefix);
  if (why.empty()) why = aux_ok(job.sp, job.tg, c.aux, job);
  if (!why.empty()) return why;
  ended_.erase(job.skey);
  mark_aux(job.tg, c.aux);
  const uint64_t bit = 1ull << (job.sp.rank & 63);
  for (auto& t : job.tg) {
    Armed& a = armed_.at(t.akey);
    a.senders = t.senders;
    a.pending++;
    a.ranks |= bit;
    if (__builtin_popcountll(a.ranks) >= a.senders) a.state = RUNNING;
  }
  Stream s;
  s.fd = fd;
  s.flags = flags;
  s.tid = tid;
  s.bs = job.sp.name;
  s.session = session;
  s.sp = job.sp;
  s.tg = job.tg;
  s.prefix = job.prefix;
  s.first = c.offset;
  s.next = c.offset + (int64_t)src.size();
  s.last = c.last;
  s.inflight = 1;
  job.off = c.offset;
  streams_.emplace(job.skey, std::move(s));
  return "";
}

// mu_ held: a later chunk of stream ``s``: in order, its receivers still armed and in time, its
// pages inside the delta; taken into the stream, or why not: a bad chunk changes nothing
// (``fatal`` false), a transfer that is over or cannot complete ends (``fatal``: the caller
// ends the stream).
std::string Lane::next_chunk(Stream& s, const SendChunk& c, const std::vector<int32_t>& src, LocalCopy& job,
                             bool& fatal) {
  fatal = true;
  if (!s.error.empty()) return s.error;
  if (s.last) return "transfer_id: the transfer already received its last chunk";
  const double now = now_s();
  for (const Target& t : s.tg) {
    auto ai = armed_.find(t.akey);
    if (ai == armed_.end() || ai->second.state == GATED) return "transfer_id: the transfer was ended by its receiver";
    if (ai->second.failed) return ai->second.error;
    if (now > ai->second.deadline) return "transfer deadline passed";
  }
  fatal = false;
  if (c.offset != s.next)
    return "chunk_offset: " + std::to_string(c.offset) + ": chunks must be contiguous and in order: expected " +
           std::to_string(s.next);
  const int64_t end = c.offset + (int64_t)src.size(), want = s.prefix + (int64_t)s.tg[0].dst.size();
  const int64_t ms = s.tg[0].ms, md = s.tg[0].md, end_u = end * ms, room = want * md;
  if (end_u > room && !fits(end_u, room, ms, md, c.last))
    return "src_page_indices: the chunk ends at page " + std::to_string(end) + " of a transfer of " +
           std::to_string(want) + (ms == md ? "" : " receiver") + " pages (prefix + delta)";
  std::string why = pages_ok(s.sp, src);
  if (why.empty()) why = aux_ok(s.sp, s.tg, c.aux, job);
  if (!why.empty()) return why;
  if (!fits(end_u, room, ms, md, c.last)) {  // the sender says it is done with pages unsent: the receiver fails
    fatal = true;
    return "sender finished with " + std::to_string((room - end_u + md - 1) / md) + " of " +
           std::to_string(s.tg[0].dst.size()) + " delta pages unsent (prefix + delta)";
  }
  mark_aux(s.tg, c.aux);
  s.next = end;
  s.last = c.last;
  s.inflight++;
  job.behind = s.inflight > 1;
  job.sp = s.sp;
  job.tg = s.tg;
  job.prefix = s.prefix;
  job.off = c.offset;
  return "";
}

// mu_ held: stream ``it`` fails with ``why``; it ends now if no copy of it is in flight (true:
// a completion was queued, signal_done), else with its last copy (end_local).
bool Lane::fail_stream(std::unordered_map<std::string, Stream>::iterator it, const std::string& why) {
  if (it->second.error.empty()) it->second.error = why;
  if (it->second.inflight) return false;
  end_stream(it, nullptr, 0, 0);
  return true;
}

void Lane::abort_stream(const std::string& tid, const std::string& bs, const std::string& why) {
  bool ended = false, xended = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = streams_.find(tid + '\0' + bs);
    if (it != streams_.end() && !it->second.last) ended = fail_stream(it, why);
    const std::string at = tid + '\0';  // key(tid, rank): a cross-node stream of it from bs
    for (auto& kv : xout_)
      if (kv.second.streaming && !kv.second.last && kv.second.bs == bs && kv.first.compare(0, at.size(), at) == 0)
        xended |= fail_xstream(kv.first, why);
  }
  if (ended || xended) signal_done();
  flush_notes();  // the receiving service hears it now
}

std::vector<std::string> Lane::abort_xstreams(const std::string& session, const std::string& tid,
                                              const std::string& why) {
  std::vector<std::string> out;
  {
    std::lock_guard<std::mutex> g(mu_);
    const std::string at = tid + '\0';
    for (auto& kv : xout_) {
      const XOut& x = kv.second;
      if (!x.streaming || x.last || x.session != session || kv.first.compare(0, at.size(), at) != 0) continue;
      if (std::find(out.begin(), out.end(), x.bs) == out.end()) out.push_back(x.bs);
      fail_xstream(kv.first, why);
    }
  }
  signal_done();
  flush_notes();
  return out;
}

// mu_ held: every stream still taking chunks that matches ``pred`` fails with ``why``.
template <class P>
bool Lane::fail_streams(P pred, const std::string& why) {
  bool ended = false;
  for (auto it = streams_.begin(); it != streams_.end();) {
    auto next = std::next(it);
    if (!it->second.last && pred(it->second)) ended |= fail_stream(it, why);
    it = next;
  }
  return ended;
}

bool Lane::fail_streams_of_session(const std::string& session) {
  return fail_streams([&](const Stream& s) { return s.session == session; },
                      "the sending engine's session ended before its last chunk");
}

bool Lane::fail_streams_of_fd(int fd) {
  return fail_streams([&](const Stream& s) { return s.fd == fd; },
                      "the sending engine's lane closed before its last chunk");
}

bool Lane::fail_streams_into(const std::string& akey) {
  return fail_streams(
      [&](const Stream& s) {
        for (const Target& t : s.tg)
          if (t.akey == akey) return true;
        return false;
      },
      CANCELLED);
}

// mu_ held: the receiver ranks of ``tid`` armed here that sender pool ``sp`` copies into, each
// checked (or why not: the engine's SDK then makes the gRPC call). Equal layouts: the rank of
// the sender's rank, whole pages. Mixed TP (Pool::hmode): every armed rank whose heads overlap
// the sender's, and together they must hold all of the sender's heads.
//
//   H = 8, sender TP 4 -> receiver TP 2:   sender 1 holds heads 2-3; receiver 0 holds 0-3
//     head slice: nh = 2 heads, from the sender's local head hs = 0 to the receiver's hd = 2
std::string Lane::targets(const std::string& tid, const Pool& sp, const SendChunk& c, const std::vector<int32_t>& src,
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
    } else if (sp.usig && sp.usig == dp.usig && sp.ps > 0 && dp.ps > 0) {  // page sizes differ
      if (rank != sp.rank) continue;
      const int g = std::gcd(sp.ps, dp.ps);
      t.ms = sp.ps / g, t.md = dp.ps / g;
      if (sp.num_pages * t.ms > INT32_MAX || dp.num_pages * t.md > INT32_MAX) return "too many units for the lane";
      whole = true;
    } else if (sp.lsig && sp.lsig == dp.lsig && sp.rows.size() == dp.rows.size()) {  // page layouts differ
      if (rank != sp.rank) continue;
      t.rows = true;
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
    std::string why = check(sp, dp, a, c, src.size(), t);
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


// One target's geometry against the sender's (t.nh 0: equal layouts, whole pages or, with
// t.ms / t.md, units of both page sizes' gcd), and where the first chunk ``c`` of ``n`` pages
// lies: from the transfer's page 0, or from inside the receiver's prefix (a sender that knows
// it); never past the delta.
std::string Lane::check(const Pool& sp, const Pool& dp, const Armed& a, const SendChunk& c, size_t n,
                        const Target& t) const {
  const int nh = t.nh;
  const bool units = t.ms != 1 || t.md != 1;
  // (page layouts that differ: rows of equal bytes, each inside its page: Lane::set_rows)
  if (!t.rows && sp.regions.size() != dp.regions.size()) return "layouts differ";  // (nh 0: equal signatures)
  // One device (or host memory) on both sides, or two GPUs where the receiver's pool is mapped
  // in the sender GPU's context (set_alias): the kernel runs on the sender's GPU (push).
  if (sp.device != dp.device) {
    if (sp.device < 0 || dp.device < 0) return "pools on different devices";
    const Pool& far = launch_device(sp, dp) == dp.device ? sp : dp;  // the pool the launching GPU maps
    if (far.alias.find(launch_device(sp, dp)) == far.alias.end())
      return "pools on two GPUs, not mapped in the launching GPU's context";
  }
  for (size_t i = 0; t.rows && i < sp.rows.size(); ++i)
    if (sp.rows[i].run != dp.rows[i].run) return "layouts differ";
  for (size_t i = 0; i < sp.regions.size() && !t.rows; ++i) {
    const uint64_t a_ = sp.regions[i].nbytes, b_ = dp.regions[i].nbytes;
    // units: a token's rows of equal length on both sides, pages back to back (a unit's address
    // is then unit * its bytes)
    if (units) {
      if (a_ % (uint64_t)sp.ps || b_ % (uint64_t)dp.ps || a_ / sp.ps != b_ / dp.ps || sp.regions[i].stride != a_ ||
          dp.regions[i].stride != b_)
        return "region geometry differs";
    } else if (nh == 0 ? a_ != b_
                : (a_ % ((uint64_t)sp.ps * sp.hn) || b_ % ((uint64_t)dp.ps * dp.hn) ||
                   a_ / ((uint64_t)sp.ps * sp.hn) != b_ / ((uint64_t)dp.ps * dp.hn)))
      return "region geometry differs";
  }
  const int64_t end = (c.offset + (int64_t)n) * t.ms, room = (a.prefix + (int64_t)a.dst.size()) * t.md;
  if (c.offset * t.ms > a.prefix * t.md) return "the first chunk starts past the receiver's prefix";
  if (!fits(end, room, t.ms, t.md, c.last)) return "page count is not prefix + delta";
  return "";
}

// The aux rows chunk ``c`` names, checked against the sender's aux regions and every target's
// declaration (same names, row counts and row sizes, rows inside both regions) and resolved to
// the row copies ``job.aux`` (or why not).
std::string Lane::aux_ok(const Pool& sp, const std::vector<Target>& tg, const std::vector<AuxRows>& aux,
                         LocalCopy& job) const {
  for (const AuxRows& r : aux) {
    const AuxDesc* mine = aux_of(sp, r.name);
    if (!mine) return "aux: the sender's buffer set has no aux region named '" + r.name + "'";
    for (int64_t row : r.rows)
      if (row < 0 || row >= mine->rows) return "aux[" + r.name + "]: a row outside the sender's region";
    for (const Target& t : tg) {
      const AuxDesc* theirs = aux_of(t.dp, r.name);
      auto ai = armed_.find(t.akey);
      const AuxRows* want = ai == armed_.end() ? nullptr : rows_of(ai->second.aux, r.name);
      if (!theirs || !want) return "aux: receiver has no aux region named '" + r.name + "'";
      if (want->rows.size() != r.rows.size())
        return "aux[" + r.name + "]: sender names " + std::to_string(r.rows.size()) + " rows, receiver declared " +
               std::to_string(want->rows.size());
      if (theirs->row_bytes != mine->row_bytes) return "aux[" + r.name + "]: row sizes differ";
      for (size_t i = 0; i < r.rows.size(); ++i) {
        const int64_t d = want->rows[i];
        if (d < 0 || d >= theirs->rows) return "aux[" + r.name + "]: a row outside the receiver's region";
        job.aux.push_back(AuxCopy{mine->base + (uint64_t)r.rows[i] * mine->row_bytes,
                                  theirs->base + (uint64_t)d * theirs->row_bytes, mine->row_bytes});
      }
    }
  }
  return "";
}

// mu_ held: a chunk with aux rows was taken: its targets' declared aux rows are delivered.
void Lane::mark_aux(const std::vector<Target>& tg, const std::vector<AuxRows>& aux) {
  if (aux.empty()) return;
  for (const Target& t : tg) armed_.at(t.akey).aux_done = true;
}

// Never past the delta, but for the rest of the sender's last page (past the sequence's last
// token); a last chunk leaves at most a tail of the receiver's last page unwritten (as over
// gRPC: plan.map_chunk).
bool Lane::fits(int64_t end, int64_t room, int64_t ms, int64_t md, bool last) {
  if (end > room && !(last && room > end - ms)) return false;
  return !(last && end < room && room - end >= md);
}

Pool Lane::unit_view(const Pool& p, int per) {
  if (per == 1) return p;
  Pool v = p;
  v.num_pages = p.num_pages * per;
  for (RegionDesc& r : v.regions) r.stride /= (uint64_t)per, r.nbytes /= (uint64_t)per;
  return v;
}

std::string Lane::pages_ok(const Pool& sp, const std::vector<int32_t>& src) {
  std::vector<uint64_t> seen((size_t)(sp.num_pages + 63) / 64, 0);
  for (int32_t s : src) {
    if (s < 0 || s >= sp.num_pages) return "src_page_indices: source page out of range";
    uint64_t& w = seen[(size_t)s >> 6];
    const uint64_t bit = 1ull << (s & 63);
    if (w & bit) return "src_page_indices: source pages repeat";
    w |= bit;
  }
  return "";
}

}  // namespace kvlane
