// The same-node route, copying: an accepted chunk's aux rows and pages copied into every receiver
// rank it feeds (copy_local: launched on the GPU and ended by the finisher thread, or copied on
// the host), its stream told (end_local); a stream's end sends END to the engines and queues
// the one completion of the stream for Python (end_stream).

#include <unistd.h>

#include <cstring>
#include <exception>
#include <stdexcept>

#include "lane.h"

namespace kvlane {

// An accepted chunk: its aux rows (host memory: copied here), then one copy of its pages into
// every target.
//
//   transfer pages   off ............ off + n          (the chunk)
//   receiver's       0 ..... prefix ................... prefix + dst.size()
//   copied           from lo = max(off, prefix):  src[lo - off + i] -> dst[lo - prefix + i]
//
// Pools of two page sizes (Target::ms, md) exchange units of g = gcd tokens instead: sender unit
// k of page src[i] is the transfer's unit (off + i) * ms + k, which lands in receiver unit
// dst[r / md] * md + r % md, r = its unit past the prefix's prefix * md (units past the delta:
// the rest of the sender's last page, not copied).
void Lane::copy_local(LocalCopy& job) {
  const Pool& sp = job.sp;
  uint64_t aux_bytes = 0;
  for (const AuxCopy& a : job.aux) {
    std::memcpy((void*)a.dst, (const void*)a.src, a.n);
    aux_bytes += a.n;
  }
  std::vector<int32_t> pairs;
  const bool units = !job.tg.empty() && (job.tg[0].ms != 1 || job.tg[0].md != 1);
  const size_t moved = units ? unit_pairs(job, pairs) : page_pairs(job, pairs);
  std::vector<Seg> segs;
  std::string err;
  try {
    segs = segments(sp, job.tg, moved);
  } catch (const std::exception& e) {
    err = e.what();
  }
  uint64_t nbytes = 0;
  for (auto& g : segs) nbytes += g.nbytes * moved;
  nbytes += aux_bytes;
  double t0 = now_s();
  if (sp.device >= 0) {  // a GPU copy's sender hears once it is queued (or how it failed, from its END)
    const int fd = job.fd;
    const uint32_t seq = job.seq;
    if (err.empty()) err = launch_local(job, segs, pairs, moved, nbytes, t0);  // the finisher ends it
    reply(fd, seq, REPLY_ACCEPTED, "");
    if (err.empty()) return;
  } else if (err.empty() && moved) {
    err = cu_.copy(sp.device, job.tg[0].dp.device, segs, pairs, moved);
  }
  if (!job.at_launch) job.at_launch = t0;
  job.at_done = now_s();
  end_local(job, err, (uint64_t)((now_s() - t0) * 1e6), nbytes, moved);
}

size_t Lane::page_pairs(const LocalCopy& job, std::vector<int32_t>& pairs) {
  const int64_t n = (int64_t)job.src.size(), lo = std::max(job.off, job.prefix);
  const size_t moved = (size_t)std::max<int64_t>(0, job.off + n - lo), nt = job.tg.size();
  const size_t s0 = (size_t)(lo - job.off), d0 = (size_t)(lo - job.prefix);
  pairs.resize(2 * moved * nt);
  for (size_t t = 0; t < nt; ++t) {
    const std::vector<int32_t>& dst = job.tg[t].dst;
    int32_t* pr = pairs.data() + 2 * moved * t;
    for (size_t i = 0; i < moved; ++i) {
      pr[2 * i] = job.src[s0 + i];
      pr[2 * i + 1] = dst[d0 + i];
    }
  }
  return moved;
}

// (one target: a page-size conversion is between the sender's rank and the same receiver rank)
size_t Lane::unit_pairs(const LocalCopy& job, std::vector<int32_t>& pairs) {
  const Target& t = job.tg[0];
  const int64_t ms = t.ms, md = t.md, lo = job.prefix * md, room = lo + (int64_t)t.dst.size() * md;
  pairs.clear();
  pairs.reserve(2 * job.src.size() * (size_t)ms);
  for (size_t i = 0; i < job.src.size(); ++i) {
    for (int64_t k = 0; k < ms; ++k) {
      const int64_t pos = (job.off + (int64_t)i) * ms + k;
      if (pos < lo || pos >= room) continue;
      const int64_t r = pos - lo;
      pairs.push_back((int32_t)(job.src[i] * ms + k));
      pairs.push_back((int32_t)(t.dst[(size_t)(r / md)] * md + r % md));
    }
  }
  return pairs.size() / 2;
}

std::string Lane::launch_local(LocalCopy& job, const std::vector<Seg>& segs, const std::vector<int32_t>& pairs,
                               size_t moved, uint64_t nbytes, double t0) {
  const size_t nr = segs.size();
  const int on = launch_device(job.sp, job.tg[0].dp);
  int si = -1;  // nothing to copy (its aux rows only): no launch, ended in turn by the finisher
  if (moved && nr) {
    std::string err = cu_.launch_async(on, segs, pairs, moved, running_, si, job.at_launch);
    if (!err.empty()) return err;
  }
  {
    std::lock_guard<std::mutex> g(fin_mu_);
    fin_q_.push_back(InFlight{std::move(job), on, si, nbytes, moved, t0});
  }
  fin_cv_.notify_all();
  return "";
}

// The finisher thread: each launched copy in launch order, once its event completed.
void Lane::finish_run() {
  for (;;) {
    InFlight f;
    {
      std::unique_lock<std::mutex> g(fin_mu_);
      fin_cv_.wait(g, [&] { return !fin_q_.empty() || !fin_running_; });
      if (fin_q_.empty()) return;
      f = std::move(fin_q_.front());
      fin_q_.pop_front();
    }
    const std::string err = f.slot < 0 ? "" : cu_.finish(f.device, f.slot);
    f.job.at_done = now_s();
    try {
      end_local(f.job, err, (uint64_t)((now_s() - f.t0) * 1e6), f.nbytes, f.moved);
    } catch (const std::exception&) {  // (out of memory) the transfer's deadline ends it
    }
  }
}

// A chunk's copy ended: its stream counts it, and ends with its last copy (or, after a failure,
// once no copy of it is in flight).
void Lane::end_local(LocalCopy& job, std::string err, uint64_t us, uint64_t nbytes, size_t moved) {
  // a pool whose memory its owner shrank during (or before) the copy: the guard repaired the
  // fault, the bytes are not the engine's: the transfer fails
  if (err.empty()) err = lost(job.sp);
  for (size_t i = 0; i < job.tg.size() && err.empty(); ++i) err = lost(job.tg[i].dp);
  bool ended = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = streams_.find(job.skey);
    if (it == streams_.end()) return;  // (cannot be: a stream outlives its copies)
    Stream& s = it->second;
    s.inflight--;
    s.nbytes += nbytes;
    s.us += us;
    s.moved += moved;
    if (!err.empty() && s.error.empty()) s.error = err;
    if (s.inflight == 0 && (s.last || !s.error.empty())) {
      end_stream(it, &job, nbytes, us);
      ended = true;
    } else if (s.error.empty()) {  // a chunk before the last: Python books it now (Poll, watchers)
      Completion c;
      c.kind = DONE_CHUNK;
      fill(c, s, &job, nbytes, us);
      completions_.push_back(std::move(c));
      ended = true;
    }
  }
  if (ended) signal_done();
}

// mu_ held: a completion's fields for stream ``s``: its chunk ``at`` (none: a stream that failed
// between chunks), that chunk's bytes and µs.
void Lane::fill(Completion& c, const Stream& s, const LocalCopy* at, uint64_t nbytes, uint64_t us) {
  c.tid = s.tid;
  c.rank = s.tg.empty() ? s.sp.rank : s.tg[0].rank;
  c.bs = s.bs;
  c.sender_session = s.session;
  c.nbytes = nbytes;
  c.copy_us = us;
  c.flags = s.flags;
  c.first = at ? at->off : s.next;
  c.aux_rows = at ? at->aux.size() : 0;
  if (at) c.src = at->src;
  for (auto& t : s.tg) {
    c.ranks.push_back(t.rank);
    c.told.push_back(0);
  }
}

// mu_ held: stream ``it`` ends (no copy of it in flight): END to each receiver rank that has all
// its senders now (or a failure), then to the sender, then the completion for Python (of its
// last chunk ``at``, whose timeline the END carries: ``nbytes``, ``us``; the chunks before it
// were booked one by one); the stream goes.
void Lane::end_stream(std::unordered_map<std::string, Stream>::iterator it, const LocalCopy* at, uint64_t nbytes,
                      uint64_t us) {
  Stream& s = it->second;
  const std::string& err = s.error;
  const bool ok = err.empty();
  const size_t nt = s.tg.size();
  // (pages: of the receiver, moved; of the sender, wholly in the prefix)
  const int64_t ms = nt ? s.tg[0].ms : 1, md = nt ? s.tg[0].md : 1;
  const uint64_t each = nt ? s.nbytes / nt : 0, moved = nt ? (s.moved + (uint64_t)md - 1) / (uint64_t)md : 0;
  const uint64_t skipped = (uint64_t)std::max<int64_t>(0, s.prefix * md / ms - s.first);
  Completion done;
  fill(done, s, at, nbytes, us);
  done.ranks.clear();
  done.told.clear();
  for (auto& t : s.tg) {
    int told = 0;
    auto ai = armed_.find(t.akey);  // still ours: disarm() answers 2 while a stream is pending
    if (ai != armed_.end()) {
      Armed& a = ai->second;
      a.done += ok;
      a.failed += !ok;
      a.nbytes += each;
      if (!ok && a.error.empty()) a.error = err;
      if (a.failed && a.state == ARMED) a.state = RUNNING;  // a failure: it takes no more senders
      // its END: with its last sender's stream; after a failure, once every stream taken has
      // ended (another sender's kernel may still be writing its pages)
      const bool all = a.done >= a.senders, ended = a.done + a.failed >= __builtin_popcountll(a.ranks);
      // a receiver that ended it itself (CANCELLED: Abort, deadline) has its END from Python
      if (!a.told && a.cancelled && err == CANCELLED) a.told = true;
      if (!a.told && (a.failed ? ended : all)) {
        a.told = true;
        a.state = a.state == GATED ? GATED : COMPLETED;
        std::string why = a.failed ? a.error : "";
        if (why.empty() && !a.aux.empty() && !a.aux_done)
          why = "every sender finished but no sender delivered the declared aux rows";
        const std::string to_recv =
            end_msg(0, why.empty(), s.tid, a.recv_bs, why, a.nbytes, moved, skipped, s.us, 0, at);
        for (auto& kv : conns_) {
          if (kv.second.session == a.recv_session) told |= sendmsg_(kv.first, to_recv);
        }
      }
    }
    done.ranks.push_back(t.rank);
    done.told.push_back(told);
  }
  const std::string to_send = end_msg(1, ok, s.tid, s.bs, err, s.nbytes, moved, skipped, s.us, 0, at);
  done.told_send = tell(s.fd, s.session, to_send);
  done.told_recv = !done.told.empty() && done.told[0];
  done.ok = ok;
  done.error = err;
  completions_.push_back(std::move(done));
  // a later chunk of it is refused with what became of it (a new transfer under the id starts at 0)
  if (ended_.size() >= kEndedMax) ended_.erase(ended_.begin());
  ended_[it->first] = Ended{s.next, s.last, ok ? "DONE" : "FAILED: " + err};
  streams_.erase(it);
}

// One target's segments between two page layouts: the pools' rows paired in order (Pool::rows),
// consecutive rows contiguous on both sides in one segment, a whole page's bytes in one run.
void Lane::row_segments(const Pool& sp, const Pool& dp, const std::vector<uint64_t>* sa,
                        const std::vector<uint64_t>* da, uint64_t pairs, std::vector<Seg>& out) {
  const uint64_t ps = (uint64_t)sp.ps;
  for (size_t i = 0; i < sp.rows.size();) {
    const RowDesc &s = sp.rows[i], &d = dp.rows[i];
    uint64_t run = s.run;
    size_t j = i + 1;
    for (; j < sp.rows.size(); ++j) {  // the next head's rows follow on both sides
      const RowDesc &s2 = sp.rows[j], &d2 = dp.rows[j];
      if (s2.region != s.region || d2.region != d.region || s2.tok != s.tok || d2.tok != d.tok ||
          s2.off != s.off + run || d2.off != d.off + run)
        break;
      run += s2.run;
    }
    const RegionDesc &sr = sp.regions[s.region], &dr = dp.regions[d.region];
    Seg g{(sa ? (*sa)[s.region] : sr.base) + s.off, (da ? (*da)[d.region] : dr.base) + d.off, sr.stride, dr.stride,
          run * ps, run, s.tok, d.tok, pairs};
    if (s.tok == run && d.tok == run) g.run = g.nbytes;  // the tokens' rows back to back on both sides
    out.push_back(g);
    i = j;
  }
}

void Lane::signal_done() {
  uint64_t one = 1;
  (void)!write(done_, &one, 8);
}

// The copy's segments: per target, per region. A head slice of token-major pages is a run of
// nh heads per token; of head-major pages one run of nh heads' tokens:
//
//   NHD page [ps][hn][hb]:  token k's run at hs*hb + k*hn*hb (sender), hd*hb + k*hn'*hb (receiver)
//   HND page [hn][ps][hb]:  one run of nh*ps*hb at hs*ps*hb (sender), hd*ps*hb (receiver)
//
// Pools of two page layouts (Target::rows): a segment per head's K or V rows, a run a token
// (rows next to each other on both sides merge into one segment):
//
//   NHC page [ps][hn][dk|dv] -> NHD K page [ps][hn][dk]:  head h's K of token k at
//       h*(dk+dv) + k*hn*(dk+dv) (sender), h*dk + k*hn*dk (receiver): runs of dk
std::vector<Seg> Lane::segments(const Pool& sp, const std::vector<Target>& tg, size_t moved) const {
  const int on = tg.empty() ? sp.device : launch_device(sp, tg[0].dp);
  const std::vector<uint64_t>* sa = sp.device == on || sp.device < 0 ? nullptr : &sp.alias.at(on);
  std::vector<Seg> out;
  for (size_t t = 0; t < tg.size(); ++t) {
    const Target& x = tg[t];
    const Pool& dp = x.dp;
    const std::vector<uint64_t>* da = dp.device == on || dp.device < 0 ? nullptr : &dp.alias.at(on);
    if (x.rows) {
      row_segments(sp, dp, sa, da, (uint64_t)(t * moved), out);
      continue;
    }
    for (size_t r = 0; r < sp.regions.size(); ++r) {
      const RegionDesc &s = sp.regions[r], &d = dp.regions[r];
      Seg g{sa ? (*sa)[r] : s.base, da ? (*da)[r] : d.base, s.stride, d.stride, s.nbytes, s.nbytes, 0, 0,
            (uint64_t)(t * moved)};
      if (x.ms != 1 || x.md != 1) {  // units of g tokens, pages back to back (Lane::check): one run each
        g.src_stride = s.nbytes / (uint64_t)x.ms, g.dst_stride = d.nbytes / (uint64_t)x.md;
        g.nbytes = g.run = g.src_stride;
      } else if (x.nh) {
        const uint64_t hb = s.nbytes / ((uint64_t)sp.ps * sp.hn), ps = (uint64_t)sp.ps;
        if (sp.hmode == 1) {  // token-major
          g.src += x.hs * hb, g.dst += x.hd * hb;
          g.run = x.nh * hb, g.src_run = sp.hn * hb, g.dst_run = dp.hn * hb;
          g.nbytes = g.run * ps;
          if (g.run == g.src_run && g.run == g.dst_run) g.run = g.nbytes;  // all heads: one run
        } else {                                                           // head-major
          g.src += x.hs * ps * hb, g.dst += x.hd * ps * hb;
          g.nbytes = g.run = x.nh * ps * hb;
        }
      }
      out.push_back(g);
    }
  }
  return out;
}

}  // namespace kvlane
