// The native lane (DESIGN.md "Data plane"; docs/decisions/0014, 0018).
//
// One thread per service reads engines' lane sockets (SOCK_SEQPACKET, authenticated by Python
// before the fd is handed here), matches a SEND command to an armed transfer, copies the pages
// (one copy kernel launched through the driver API: Triton's, compiled ahead of time to cubins;
// memcpy for host pools), then writes END to both engines' lanes and queues a completion for Python's
// bookkeeping (records, index, metrics), which runs after the engines have their answer.
//
// Python owns every decision that is not per-transfer: who may connect, which pools exist, which
// transfers are armed (and disarming them on abort/expiry). This thread accepts a command only
// for an armed transfer whose layout signature, region geometry and page count match; anything
// else is answered FALLBACK and the engine repeats the call over gRPC, which gives the full
// validation and its errors. No GIL is taken on this path: nothing here includes pybind11
// (module.cpp, the bindings, is the only file that does).
//
// One object, its methods by route, and the Copier it copies with (one lock order: nx_mu_ is
// never taken inside mu_; the Copier's locks and fin_mu_ nest inside neither):
//
//   lane.cpp         threads, the reader loop, messages to engines, completions
//   arming.cpp       what Python arms: engines' connections, pools, same-node transfers
//   same_node.cpp    a SEND (a chunk of a transfer, or all of it): checked against what is armed
//                    and against its stream's earlier chunks (handle -> copy_local)
//   same_copy.cpp    its aux rows and pages copied, its stream ended: END, the completion
//   copy.cpp         the copy itself (copier.h, class Copier): CUDA driver + kernel
//                    launches, the ring of launches in flight, host memcpy
//   cross_setup.cpp  the cross-node lane's NIXL agent, staging, offers and declarations
//   cross_send.cpp   a SEND_TO: packed, written through NIXL in chunks, acknowledged
//   cross_stream.cpp an engine's chunks of one SEND_TO stream: WRITEs overlapped, noted in order
//   cross_recv.cpp   notifications: a chunk written here is unpacked, acked or credited
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "copier.h"
#include "cuda.h"
#include "nixl_capi.h"
#include "state.h"
#include "wire.h"

namespace kvlane {

class Lane {
 public:
  // ---- lifecycle (lane.cpp) ------------------------------------------------------------------
  Lane();
  ~Lane() { stop(); }
  void stop();
  int completion_fd() const { return done_; }
  // The completions queued since the last call (the completion fd's reader; Python books them).
  std::deque<Completion> drain();

  // ---- calls Python answers (lane.cpp): CALL messages, queued with the completions ----------
  // Take CALLs (false: each is answered FALLBACK, the engine makes it over gRPC).
  void set_calls(bool on) { calls_on_ = on; }
  // The CALLs read since the last take (the completion fd signals them too).
  std::deque<LaneCall> take_calls();
  // The REPLY to a call, if connection ``fd`` is still ``session``'s; false when it is gone.
  bool answer(int fd, const std::string& session, uint32_t seq, int32_t code, const std::string& msg);
  // sent, pack µs, post µs, wait µs, W-note µs, ack µs, received, unpack µs, re-posts, CUDA copies,
  // their µs waiting for the device lock, and in cuStreamSynchronize (cumulative)
  std::vector<uint64_t> stats();

  // ---- tuning (config lane_*) ----------------------------------------------------------------
  // Bytes of one page region a CUDA block copies (config lane_cuda_chunk_kb; a multiple of 16).
  void set_chunk(unsigned bytes) { cu_.set_chunk(bytes); }
  // µs the lane thread polls without sleeping after a message (config lane_spin_us; 0: never).
  void set_spin_us(unsigned us) { spin_us_ = us; }
  // Between two GPUs the kernel runs on the receiver's GPU (pull) or the sender's (push, default).
  void set_pull(bool pull) { cu_.set_pull(pull); }
  void set_req_cache(bool on) { req_cache_ = on; }
  void set_note_after(bool on) { note_after_ = on; }
  // Chunks of a streamed cross-node send in flight (config lane_cross_parts): the slot and the
  // scratch split in this many parts.
  void set_parts(unsigned parts) { parts_ = std::min(16u, std::max(2u, parts)); }
  // The cross-node chunks' timeline (kept only while on; at most kTraceMax rows until taken).
  void set_trace(bool on) { trace_on_ = on; }
  std::vector<ChunkTrace> take_trace();
  // Fault injection for tests: each cross-node unpack starts ``us`` late (a slow receiver).
  void set_slow_unpack(unsigned us) { slow_unpack_us_ = us; }

  // ---- the fault guard (arming.cpp; kvservice/buffers/guard.py) ----------------------------
  void set_guard(uint64_t faults_fn, uint64_t range_fn);
  std::string lost(const Pool& p) const;

  // ---- CUDA (the Copier, copy.cpp) -----------------------------------------------------------
  bool init_cuda(const std::string& libcuda, const std::vector<KernelImage>& kernels) {
    return cu_.init(libcuda, kernels);
  }
  std::string cuda_why() const { return cu_.why(); }
  void prepare_device(int dev) { cu_.prepare(dev); }

  // ---- same node: what Python arms (arming.cpp) ----------------------------------------------
  void add_conn(int fd, const std::string& session);
  void drop_session(const std::string& session);
  int conns();
  int conns_of(const std::string& session);  // open connections of one session
  void add_pool(const std::string& bs, const std::string& owner, int device, int64_t num_pages, uint64_t sig, int rank,
                std::vector<RegionDesc> regions, uint64_t xsig);
  void set_alias(const std::string& bs, int device, std::vector<uint64_t> bases);
  bool drop_pool(const std::string& bs, double wait_s);
  void set_heads(const std::string& bs, int hmode, uint64_t msig, int hlo, int hn, int ps);
  void set_units(const std::string& bs, uint64_t usig, uint64_t xusig);
  // false: a row outside its region's page (the pool keeps no page-layout conversions)
  bool set_rows(const std::string& bs, uint64_t lsig, std::vector<RowDesc> rows);
  void set_aux(const std::string& bs, std::vector<AuxDesc> aux);
  void arm(const std::string& tid, int rank, const std::string& recv_session, const std::string& recv_bs,
           int64_t prefix, std::vector<int32_t> dst, double deadline, int senders, std::vector<AuxRows> aux);
  int disarm(const std::string& tid, int rank, bool cancel);
  // The sender's side of (tid, buffer set bs) ended in Python (Abort, its buffer set unregistered):
  // its stream, same node or cross-node, if it still takes chunks, fails with ``why`` (its copies
  // or WRITEs in flight end first).
  void abort_stream(const std::string& tid, const std::string& bs, const std::string& why);
  // The sending engine's Abort of ``tid`` (session ``session``): its cross-node streams still
  // taking chunks fail with ``why`` (once their WRITEs in flight end); their buffer sets.
  std::vector<std::string> abort_xstreams(const std::string& session, const std::string& tid, const std::string& why);
  int forget(const std::string& tid, int rank);
  size_t armed_count();

  // ---- cross node: set-up (cross_setup.cpp) --------------------------------------------------
  bool init_nixl(const std::string& capi, const std::string& name);
  std::string nixl_why() const { return nx_.why; }
  uint64_t add_arena(int device, uint64_t in_bytes, uint64_t scratch_bytes);
  std::string local_md();
  std::string load_md(const std::string& md);
  void refuse_out(const std::string& tid, int rank);
  void arm_out(const std::string& tid, int rank, const std::string& address, const std::string& remote_agent,
               uint64_t raddr, uint64_t rbytes, int rdev, int rmem, uint64_t xsig, int64_t prefix, int64_t ndst,
               double deadline, uint64_t xusig, int rps, uint64_t rlsig, std::vector<RowDesc> rrows,
               std::vector<uint64_t> rpages);
  // 0 none, 1 was armed (now gone), 2 taken: an engine's stream of it waiting for chunks ends
  int disarm_out(const std::string& tid, int rank);
  void forget_out(const std::string& tid, int rank);
  void arm_in(const std::string& tid, int rank, const std::string& recv_session, const std::string& recv_bs,
              const std::string& sender_agent, int64_t prefix, std::vector<int32_t> dst, uint64_t slot, uint64_t bytes,
              int device, double deadline, std::vector<AuxRows> aux);
  int disarm_in(const std::string& tid, int rank, bool cancel);
  void forget_in(const std::string& tid, int rank);
  size_t cross_count();

 private:
  static std::string key(const std::string& tid, int rank) { return tid + '\0' + std::to_string(rank); }

  // ---- lane.cpp: the reader loop, messages, the bulk thread ----------------------------------
  void run();
  void closed(int fd);
  bool tell(int fd, const std::string& session, const std::string& m);
  static bool sendmsg_(int fd, const std::string& m);
  static void reply(int fd, uint32_t seq, int32_t code, const std::string& msg);
  static std::string end_msg(uint32_t role, bool ok, const std::string& tid, const std::string& bs,
                             const std::string& err, uint64_t nbytes, uint64_t npages, uint64_t skipped, uint64_t us,
                             uint32_t flags = 0, const LocalCopy* at = nullptr);
  static bool read_src(const char* q, uint32_t n, uint64_t w, std::vector<int32_t>& out);
  void to_bulk(std::function<void()> job);
  void bulk_run();

  // ---- arming.cpp ----------------------------------------------------------------------------
  void unarm(std::unordered_map<std::string, Armed>::iterator it, const std::string& tid, int rank);

  // ---- same_node.cpp: accepting a chunk -----------------------------------------------------
  void handle(int fd, const char* p, size_t n);
  std::string first_chunk(const std::string& tid, const std::string& session, int fd, uint32_t flags,
                          const SendChunk& c, const std::vector<int32_t>& src, LocalCopy& job);
  std::string next_chunk(Stream& s, const SendChunk& c, const std::vector<int32_t>& src, LocalCopy& job, bool& fatal);
  std::string targets(const std::string& tid, const Pool& sp, const SendChunk& c, const std::vector<int32_t>& src,
                      std::vector<Target>& tg, int64_t& prefix);
  std::string check(const Pool& sp, const Pool& dp, const Armed& a, const SendChunk& c, size_t n, const Target& t) const;
  std::string aux_ok(const Pool& sp, const std::vector<Target>& tg, const std::vector<AuxRows>& aux,
                     LocalCopy& job) const;
  void mark_aux(const std::vector<Target>& tg, const std::vector<AuxRows>& aux);
  static std::string pages_ok(const Pool& sp, const std::vector<int32_t>& src);
  // Whether a chunk ending at unit ``end`` fits a delta ending at unit ``room`` (units of
  // gcd(page sizes) tokens; ``ms``, ``md``: units a sender / receiver page; 1, 1: pages).
  static bool fits(int64_t end, int64_t room, int64_t ms, int64_t md, bool last);
  // Pool ``p`` in units of 1/``per`` of its page (its pages back to back in every region).
  static Pool unit_view(const Pool& p, int per);
  static bool read_chunk(const char* q, size_t n, SendChunk& c);
  // mu_ held; true: a completion was queued (signal_done once mu_ is released)
  bool fail_stream(std::unordered_map<std::string, Stream>::iterator it, const std::string& why);
  template <class P>
  bool fail_streams(P pred, const std::string& why);
  bool fail_streams_of_session(const std::string& session);
  bool fail_streams_of_fd(int fd);
  bool fail_streams_into(const std::string& akey);
  // ---- same_copy.cpp: copying it, ending its stream ------------------------------------------
  void copy_local(LocalCopy& job);
  std::string launch_local(LocalCopy& job, const std::vector<Seg>& segs, const std::vector<int32_t>& pairs,
                           size_t moved, uint64_t nbytes, double t0);
  void finish_run();
  void end_local(LocalCopy& job, std::string err, uint64_t us, uint64_t nbytes, size_t moved);
  void end_stream(std::unordered_map<std::string, Stream>::iterator it, const LocalCopy* at, uint64_t nbytes,
                  uint64_t us);  // mu_ held
  static void fill(Completion& c, const Stream& s, const LocalCopy* at, uint64_t nbytes, uint64_t us);
  void signal_done();
  std::vector<Seg> segments(const Pool& sp, const std::vector<Target>& tg, size_t moved) const;
  static void row_segments(const Pool& sp, const Pool& dp, const std::vector<uint64_t>* sa,
                           const std::vector<uint64_t>* da, uint64_t pairs, std::vector<Seg>& out);
  // A chunk's (source, destination) pairs into every target: pages, or units (copy_local); how many a target.
  static size_t page_pairs(const LocalCopy& job, std::vector<int32_t>& pairs);
  static size_t unit_pairs(const LocalCopy& job, std::vector<int32_t>& pairs);
  int launch_device(const Pool& sp, const Pool& dp) const { return cu_.launch_device(sp.device, dp.device); }
  // A larger same-node copy of host pools goes to the bulk thread: the lane thread keeps
  // answering (a 256 MiB host copy takes ~25 ms). GPU copies stay here (2 GiB is ~1.4 ms on one
  // GPU, and the hand-off would land on the same-node 2 GiB row, a goal still missed).
  static constexpr uint64_t LOCAL_BULK_BYTES = 16ull << 20;
  // A GPU copy launched, not waited for: the lane thread takes the next SEND while it runs (a
  // TP 4 -> 2 transfer's four SENDs queue four kernels back to back); the finisher thread waits
  // for it (Copier::finish) and ends it (end_local).
  struct InFlight {
    LocalCopy job;
    int device = 0, slot = 0;
    uint64_t nbytes = 0;
    size_t moved = 0;
    double t0 = 0;
  };

  // ---- cross_send.cpp: pool to pool, whole pages (a pack or an unpack), waited for ---------
  // (``rows``: another page layout, each head's rows: Target::rows)
  std::string copy(const Pool& sp, const Pool& dp, const std::vector<int32_t>& pairs, size_t moved,
                   bool rows = false);
  // where sender pool ``sp`` packs for offer ``xo``: its own pages (or units), or the receiver's
  static const Pool& pack_like(const Pool& sp, const XOut& xo) { return xo.rows ? *xo.rlike : sp; }

  // ---- cross_setup.cpp -----------------------------------------------------------------------
  // 0 none, 1 was armed (now gone), 2 moving/moved (``moving`` sees it, under the lock)
  template <class M, class F = void (*)(typename M::mapped_type&)>
  int disarm_of(M& m, const std::string& k, F moving = [](typename M::mapped_type&) {}) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = m.find(k);
    if (it == m.end()) return 0;
    if (it->second.state == ARMED) {
      m.erase(it);
      return 1;
    }
    moving(it->second);
    return 2;
  }
  std::string nx_register(const Arena& a, bool on);
  void free_arena(const Arena& a);
  void close_nixl();  // threads joined

  // ---- cross_send.cpp ------------------------------------------------------------------------
  static Pool packed(uint64_t base, const Pool& like, int device);
  static std::string x_units(const Pool& sp, XOut& x);  // mu_ held: pages, units or rows (x.ms, x.md, x.rows)
  void handle_x(int fd, const char* p, size_t n);
  void send_out(XSend& job);
  std::string stream_out(const Pool& sp, const XOut& xo, const std::string& xk, const std::string& tid,
                         const std::vector<int32_t>& src, uint64_t scratch, uint64_t page, uint64_t chunk,
                         uint64_t parts);
  std::string await_credits(const std::string& xk, uint64_t need, double deadline, const Pool& sp);
  void kick();  // mu_ held: wake the lane thread to look at the parked SEND_TOs
  void unpark();
  static std::string note(uint32_t kind, int rank, bool ok, uint64_t nbytes, uint64_t npages, uint64_t first,
                          uint64_t off, const std::string& tid, const std::string& msg, uint32_t flags = 0,
                          uint32_t src_first = 0, uint32_t per_page = 1);
  // an engine's chunks of one transfer (FLAG_CHUNK SEND_TOs), its delta within the slot
  std::string aux_note(const Pool& sp, const std::vector<AuxRows>& aux, std::string& out, uint64_t& nbytes) const;
  std::string x_next_chunk(XOut& x, const std::string& xk, const SendChunk& c, const std::vector<int32_t>& src,
                           std::string& aux, uint64_t& aux_bytes, bool& fatal);
  void x_write_chunk(const Pool& sp, const XOut& xo, const std::string& xk, const std::string& tid, const SendChunk& c,
                     const std::vector<int32_t>& src, const std::string& aux, uint64_t aux_bytes);
  void poll_writes();             // lane thread: the posted chunks done so far, in order
  void book_chunk(XWrite& w);     // ... each booked on its stream
  bool fail_xstream(const std::string& xk, const std::string& why);  // mu_ held
  bool fail_xstreams_of(int fd, const std::string& session, const std::string& why);  // mu_ held
  void flush_notes();
  std::string nx_post(uint64_t local, uint64_t n, int device, const XOut& xo, uint64_t off, Posted& o);
  std::string nx_finish(const XOut& xo, Posted& o);  // nx_poll until done, then nx_complete
  // false: still in flight; true: done, or failed (``err``; the request released)
  bool nx_poll(const XOut& xo, Posted& o, std::string& err);
  std::string nx_complete(const XOut& xo, Posted& o, bool notify);  // a done WRITE: kept, noted
  void release_req(void* req);
  void finish_sent(std::unordered_map<std::string, XPend>::iterator it, bool ok, const std::string& err);
  void expire_sent();  // no ack a second past the deadline: the receiver is gone or wedged

  // ---- cross_recv.cpp ------------------------------------------------------------------------
  void send_note(const std::string& agent, const std::string& msg);
  void xrun();
  void on_note(const std::string& agent, const std::string& m);
  void on_failed(const std::string& agent, const std::string& tid, int rank, const std::string& why);
  void finish_received(const XIn& xi, const std::string& tid, int rank, const std::string& err, uint64_t nbytes,
                       uint64_t npages, uint64_t prefix, uint64_t us, bool tell, int64_t src_first = 0);
  void on_written(const std::string& agent, const std::string& tid, int rank, uint64_t nbytes, uint64_t npages,
                  uint64_t first, uint64_t off, uint32_t flags, const std::string& aux, uint32_t src_first,
                  uint32_t per_page);
  std::string land_aux(const XIn& x, const Pool& dp, const std::string& aux, uint64_t& nbytes) const;

  // ---- state ---------------------------------------------------------------------------------
  std::atomic<uint64_t (*)()> guard_faults_{nullptr};
  std::atomic<int (*)(uint64_t, uint64_t)> guard_range_{nullptr};
  std::atomic<unsigned> spin_us_{0};
  double at_msg_ = 0;               // when the lane thread read the message it handles (LocalCopy::at_recv)
  std::atomic<unsigned> parts_{4};  // a streamed cross-node send's chunks in flight
  int epfd_, wake_, done_;
  std::atomic<bool> running_{true};
  std::thread thread_;
  std::mutex mu_;
  Copier cu_;
  std::unordered_map<int, Conn> conns_;
  std::unordered_map<std::string, Pool> pools_;
  std::unordered_map<std::string, Armed> armed_;
  std::unordered_map<std::string, std::vector<int>> by_tid_;  // transfer id -> its armed ranks
  std::unordered_map<std::string, Stream> streams_;           // tid '\0' sender bs -> its chunks so far
  // ... and the streams that ended: the offset a next chunk would have, and what became of it
  struct Ended {
    int64_t next = 0;
    bool got_last = false;  // its last chunk was taken
    std::string how;        // "DONE", "FAILED: why"
  };
  std::unordered_map<std::string, Ended> ended_;
  static constexpr size_t kEndedMax = 4096;
  std::deque<Completion> completions_;
  std::deque<LaneCall> calls_;  // mu_
  std::atomic<bool> calls_on_{false};
  static constexpr size_t kCallsMax = 4096;  // CALLs waiting for Python; past it: FALLBACK
  void handle_call(int fd, const char* p, size_t n);
  // cross-node lane
  xnixl::Api nx_;
  xnixl::Agent agent_ = nullptr;
  void* backend_ = nullptr;
  std::mutex nx_mu_;                              // one NIXL call at a time (never taken inside mu_)
  std::unordered_map<int, Arena> arenas_;         // device (-1: host) -> staging
  std::unordered_map<std::string, XOut> xout_;    // key(tid, rank) -> an offer an engine here may SEND_TO
  // receivers' page geometries by their geometry signature (XOut::xsig: one page layout each;
  // arm_out: Python sends each one once)
  std::unordered_map<uint64_t, std::shared_ptr<const Pool>> rlikes_;
  std::unordered_map<std::string, XIn> xin_;      // key(tid, rank) -> a declaration with a slot
  std::unordered_map<std::string, XPend> xpend_;  // key(tid, rank) -> written, waiting for the ack
  std::vector<std::pair<std::string, std::string>> pending_notes_;  // (agent, note) to send outside mu_
  struct Parked {
    int fd;
    std::string msg;
    double until;
  };
  std::condition_variable credit_cv_;  // a streamed transfer's credit (or ack) came
  static constexpr double PARK_S = 0.02;
  // cumulative µs (and counts) of the cross-node path's steps, for benchmarks (stats())
  enum {
    S_SENT,
    S_PACK,
    S_POST,
    S_WAIT,
    S_NOTE,
    S_ACK,
    S_RECEIVED,
    S_UNPACK,
    S_REPOST,
    S_COPIES,
    S_CULOCK,
    S_CUSYNC,
    S_N
  };
  std::atomic<uint64_t> st_[S_N] = {};
  void stat(int i, double since) { st_[i] += (uint64_t)std::max(0.0, (now_s() - since) * 1e6); }
  std::unordered_map<std::string, void*> reqs_;  // finished WRITEs kept for re-posting (nx_mu_)
  std::atomic<bool> req_cache_{true};
  std::atomic<bool> note_after_{true};
  std::atomic<unsigned> slow_unpack_us_{0};
  static constexpr size_t kTraceMax = 1 << 16;
  std::atomic<bool> trace_on_{false};
  std::mutex trace_mu_;  // innermost: taken inside mu_ or nx_mu_, takes nothing
  std::vector<ChunkTrace> trace_;
  void trace(ChunkTrace&& row) {
    if (!trace_on_) return;
    std::lock_guard<std::mutex> g(trace_mu_);
    if (trace_.size() < kTraceMax) trace_.push_back(std::move(row));
  }
  std::unordered_map<std::string, Parked> parked_;  // key(tid, rank) -> a SEND_TO waiting for its offer
  std::atomic<size_t> parked_count_{0};
  bool kicked_ = false;
  bool unparking_ = false;            // lane thread only
  std::set<std::string> lane_peers_;  // addresses whose lanes have offered slots
  std::condition_variable xcv_;
  std::deque<XWrite> xwrites_;  // lane thread only: streamed chunks posted, finished front first
  std::thread xthread_;
  std::thread bthread_;  // larger cross-node sends (bulk_run)
  std::mutex bulk_mu_;
  std::condition_variable bulk_cv_;
  std::deque<std::function<void()>> bulk_q_;
  std::atomic<double> bulk_at_{0};  // the bulk thread's last job, or the last offer (heat_bulk)
  bool bulk_hot() const { return spin_us_ && (now_s() - bulk_at_.load()) * 1e6 < spin_us_; }
  void heat_bulk();
  std::thread fthread_;  // same-node GPU copies in flight (finish_run)
  std::mutex fin_mu_;
  std::condition_variable fin_cv_;
  std::deque<InFlight> fin_q_;
  std::atomic<bool> fin_running_{true};
};

}  // namespace kvlane
