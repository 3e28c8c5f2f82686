// The same-node route: a SEND checked against what is armed (handle, targets, check), its pages
// copied into every receiver rank it feeds (copy_local: launched on the GPU and ended by the
// finisher thread, or copied on the host), then END to the engines and the completion (end_local).

#include <unistd.h>

#include <cstring>
#include <exception>
#include <stdexcept>

#include "lane.h"

namespace kvlane {

void Lane::handle(int fd, const char* p, size_t n) {
  if (n < sizeof(SendHdr)) return closed(fd);  // not our protocol: drop the connection
  SendHdr h;
  std::memcpy(&h, p, sizeof h);
  if (h.type == MSG_SEND_TO) return handle_x(fd, p, n);
  const uint64_t w = h.flags & FLAG_SRC_I64 ? 8 : 4;
  if (h.type != MSG_SEND || (uint64_t)sizeof h + h.tid_len + h.bs_len + w * h.n_src != n) return closed(fd);
  std::string tid(p + sizeof h, h.tid_len), bs(p + sizeof h + h.tid_len, h.bs_len);
  std::vector<int32_t> src;
  if (!read_src(p + sizeof h + h.tid_len + h.bs_len, h.n_src, w, src))
    return reply(fd, h.seq, REPLY_FALLBACK, "source page out of range");

  std::string session, why;
  LocalCopy job;
  job.at_recv = at_msg_;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto c = conns_.find(fd);
    if (c == conns_.end()) return;
    session = c->second.session;
    auto ps = pools_.find(bs);
    if (ps == pools_.end() || ps->second.owner != session) {
      why = "buffer set not on the lane";
    } else {
      job.sp = ps->second;
      why = targets(tid, job.sp, src, job.tg, job.prefix);
    }
    if (why.empty()) {
      const uint64_t bit = 1ull << (job.sp.rank & 63);
      for (auto& t : job.tg) {  // taken: atomic with the checks (a disarm sees it pending)
        Armed& a = armed_.at(t.akey);
        a.senders = t.senders;
        a.pending++;
        a.ranks |= bit;
        if (__builtin_popcountll(a.ranks) >= a.senders) a.state = RUNNING;
      }
    }
  }
  if (!why.empty()) return reply(fd, h.seq, REPLY_FALLBACK, why);
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
  for (auto& r : job.sp.regions) bytes += r.nbytes * (job.src.size() - (size_t)job.prefix);
  if (bytes < LOCAL_BULK_BYTES || job.sp.device >= 0) return copy_local(job);
  to_bulk([this, job]() mutable { copy_local(job); });
}

// mu_ held: the receiver ranks of ``tid`` armed here that sender pool ``sp`` copies into, each
// checked (or why not: the engine's SDK then makes the gRPC call). Equal layouts: the rank of
// the sender's rank, whole pages. Mixed TP (Pool::hmode): every armed rank whose heads overlap
// the sender's, and together they must hold all of the sender's heads.
//
//   H = 8, sender TP 4 -> receiver TP 2:   sender 1 holds heads 2-3; receiver 0 holds 0-3
//     head slice: nh = 2 heads, from the sender's local head hs = 0 to the receiver's hd = 2
std::string Lane::targets(const std::string& tid, const Pool& sp, const std::vector<int32_t>& src,
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
    std::string why = check(sp, dp, a, src, t.nh);
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

// An accepted same-node SEND: one copy into every target, then END to the sender and to each
// receiver rank that has all its senders now, and the completion for Python.
void Lane::copy_local(LocalCopy& job) {
  const Pool& sp = job.sp;
  const int64_t prefix = job.prefix;
  const std::vector<int32_t>& src = job.src;
  // The copy: src[prefix + i] -> target's dst[i] for every region of every target.
  const size_t moved = src.size() - (size_t)prefix, nt = job.tg.size();
  std::vector<int32_t> pairs(2 * moved * nt);
  for (size_t t = 0; t < nt; ++t) {
    const std::vector<int32_t>& dst = job.tg[t].dst;
    int32_t* pr = pairs.data() + 2 * moved * t;
    for (size_t i = 0; i < moved; ++i) {
      pr[2 * i] = src[(size_t)prefix + i];
      pr[2 * i + 1] = dst[i];
    }
  }
  std::vector<Seg> segs;
  std::string err;
  try {
    segs = segments(sp, job.tg, moved);
  } catch (const std::exception& e) {
    err = e.what();
  }
  uint64_t nbytes = 0;
  for (auto& g : segs) nbytes += g.nbytes * moved;
  double t0 = now_s();
  if (sp.device >= 0) {  // a GPU copy's sender hears once it is queued (or how it failed, from its END)
    const int fd = job.fd;
    const uint32_t seq = job.seq;
    if (err.empty()) err = launch_local(job, segs, pairs, moved, nbytes, t0);  // the finisher ends it
    reply(fd, seq, REPLY_ACCEPTED, "");
    if (err.empty()) return;
  } else if (err.empty()) {
    err = cu_.copy(sp.device, job.tg[0].dp.device, segs, pairs, moved);
  }
  if (!job.at_launch) job.at_launch = t0;
  job.at_done = now_s();
  end_local(job, err, (uint64_t)((now_s() - t0) * 1e6), nbytes, moved);
}

std::string Lane::launch_local(LocalCopy& job, const std::vector<Seg>& segs, const std::vector<int32_t>& pairs,
                               size_t moved, uint64_t nbytes, double t0) {
  const size_t nr = segs.size();
  if (moved == 0 || nr == 0) {  // nothing to copy: ends at once
    end_local(job, "", 0, 0, moved);
    return "";
  }
  const int on = launch_device(job.sp, job.tg[0].dp);
  int si = -1;
  std::string err = cu_.launch_async(on, segs, pairs, moved, running_, si, job.at_launch);
  if (!err.empty()) return err;
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
    const std::string err = cu_.finish(f.device, f.slot);
    f.job.at_done = now_s();
    try {
      end_local(f.job, err, (uint64_t)((now_s() - f.t0) * 1e6), f.nbytes, f.moved);
    } catch (const std::exception&) {  // (out of memory) the transfer's deadline ends it
    }
  }
}

// END to the sender and to each receiver rank that has all its senders now (or a failure),
// then the completion for Python.
void Lane::end_local(LocalCopy& job, std::string err, uint64_t us, uint64_t nbytes, size_t moved) {
  // a pool whose memory its owner shrank during (or before) the copy: the guard repaired the
  // fault, the bytes are not the engine's: the transfer fails
  if (err.empty()) err = lost(job.sp);
  for (size_t i = 0; i < job.tg.size() && err.empty(); ++i) err = lost(job.tg[i].dp);
  const int fd = job.fd;
  const std::string &tid = job.tid, &bs = job.bs, &session = job.session;
  const Pool& sp = job.sp;
  const int64_t prefix = job.prefix;
  const size_t nt = job.tg.size();
  const bool ok = err.empty();
  const uint64_t each = nt ? nbytes / nt : 0;

  Completion done;
  {
    std::lock_guard<std::mutex> g(mu_);
    // END to the engines first (receivers, then sender); Python's bookkeeping follows.
    for (auto& t : job.tg) {
      int told = 0;
      auto ai = armed_.find(t.akey);  // still ours: disarm() answers 2 while a copy is pending
      if (ai != armed_.end()) {
        Armed& a = ai->second;
        a.done += ok;
        a.failed += !ok;
        a.nbytes += each;
        if (!ok && a.error.empty()) a.error = err;
        if (a.failed && a.state == ARMED) a.state = RUNNING;  // a failure: it takes no more senders
        // its END: with its last sender's copy; after a failure, once every copy taken has ended
        // (a sender's kernel may still be writing its pages)
        const bool all = a.done >= a.senders, ended = a.done + a.failed >= __builtin_popcountll(a.ranks);
        if (!a.told && (a.failed ? ended : all)) {
          a.told = true;
          a.state = a.state == GATED ? GATED : COMPLETED;
          const bool rok = a.failed == 0;
          std::string to_recv =
              end_msg(0, rok, tid, a.recv_bs, rok ? "" : a.error, a.nbytes, moved, (uint64_t)prefix, us, 0, &job);
          for (auto& kv : conns_) {
            if (kv.second.session == a.recv_session) told |= sendmsg_(kv.first, to_recv);
          }
        }
      }
      done.ranks.push_back(t.rank);
      done.told.push_back(told);
    }
    std::string to_send = end_msg(1, ok, tid, bs, err, nbytes, moved, (uint64_t)prefix, us, 0, &job);
    done.told_send = tell(fd, session, to_send);
    done.told_recv = !done.told.empty() && done.told[0];
    done.tid = tid;
    done.rank = job.tg.empty() ? sp.rank : job.tg[0].rank;
    done.bs = bs;
    done.sender_session = session;
    done.ok = ok;
    done.error = err;
    done.nbytes = nbytes;
    done.copy_us = us;
    done.flags = job.flags;
    done.src.swap(job.src);
    completions_.push_back(std::move(done));
  }
  uint64_t one = 1;
  (void)!write(done_, &one, 8);
}

// One target's geometry against the sender's (nh 0: equal layouts, whole pages).
std::string Lane::check(const Pool& sp, const Pool& dp, const Armed& a, const std::vector<int32_t>& src, int nh) const {
  if (sp.regions.size() != dp.regions.size()) return "layouts differ";  // (nh 0: targets() saw equal signatures)
  // One device (or host memory) on both sides, or two GPUs where the receiver's pool is mapped
  // in the sender GPU's context (set_alias): the kernel runs on the sender's GPU (push).
  if (sp.device != dp.device) {
    if (sp.device < 0 || dp.device < 0) return "pools on different devices";
    const Pool& far = launch_device(sp, dp) == dp.device ? sp : dp;  // the pool the launching GPU maps
    if (far.alias.find(launch_device(sp, dp)) == far.alias.end())
      return "pools on two GPUs, not mapped in the launching GPU's context";
  }
  for (size_t i = 0; i < sp.regions.size(); ++i) {
    const uint64_t a_ = sp.regions[i].nbytes, b_ = dp.regions[i].nbytes;
    if (nh == 0 ? a_ != b_
                : (a_ % ((uint64_t)sp.ps * sp.hn) || b_ % ((uint64_t)dp.ps * dp.hn) ||
                   a_ / ((uint64_t)sp.ps * sp.hn) != b_ / ((uint64_t)dp.ps * dp.hn)))
      return "region geometry differs";
  }
  if ((int64_t)src.size() != a.prefix + (int64_t)a.dst.size()) return "page count is not prefix + delta";
  return "";
}

// The copy's segments: per target, per region. A head slice of token-major pages is a run of
// nh heads per token; of head-major pages one run of nh heads' tokens:
//
//   NHD page [ps][hn][hb]:  token k's run at hs*hb + k*hn*hb (sender), hd*hb + k*hn'*hb (receiver)
//   HND page [hn][ps][hb]:  one run of nh*ps*hb at hs*ps*hb (sender), hd*ps*hb (receiver)
std::vector<Seg> Lane::segments(const Pool& sp, const std::vector<Target>& tg, size_t moved) const {
  const int on = tg.empty() ? sp.device : launch_device(sp, tg[0].dp);
  const std::vector<uint64_t>* sa = sp.device == on || sp.device < 0 ? nullptr : &sp.alias.at(on);
  std::vector<Seg> out;
  for (size_t t = 0; t < tg.size(); ++t) {
    const Target& x = tg[t];
    const Pool& dp = x.dp;
    const std::vector<uint64_t>* da = dp.device == on || dp.device < 0 ? nullptr : &dp.alias.at(on);
    for (size_t r = 0; r < sp.regions.size(); ++r) {
      const RegionDesc &s = sp.regions[r], &d = dp.regions[r];
      Seg g{sa ? (*sa)[r] : s.base, da ? (*da)[r] : d.base, s.stride, d.stride, s.nbytes, s.nbytes, 0, 0,
            (uint64_t)(t * moved)};
      if (x.nh) {
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

std::string Lane::pages_ok(const Pool& sp, const std::vector<int32_t>& src) {
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

}  // namespace kvlane
