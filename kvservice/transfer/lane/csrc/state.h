// What the lane holds: pools, armed transfers (same node), offers and declarations (cross node),
// and the jobs and completions that pass between its threads. Plain data; the Lane (lane.h)
// guards it with its locks.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace kvlane {

struct RegionDesc {
  uint64_t base, stride, nbytes;
};

// Where one head's K (or V) rows lie in a page of a pool (geometry.row_table): its region, the
// byte offset of its first token in the page, bytes from one token to the next, a row's bytes.
struct RowDesc {
  uint64_t region, off, tok, run;
};

// An aux region of a pool (SGLang's metadata rows and the like): ``rows`` rows of ``row_bytes``
// at ``base``, in host memory (RegisterBuffers refuses aux rows in VRAM).
struct AuxDesc {
  std::string name;
  uint64_t base = 0, row_bytes = 0;
  int64_t rows = 0;
};

// Aux rows by name: a receiver's declared rows, or the rows a sender's chunk names.
struct AuxRows {
  std::string name;
  std::vector<int64_t> rows;
};

struct AuxCopy {  // one aux row: host memory to host memory
  uint64_t src, dst, n;
};

struct SendChunk {  // what a SEND says of its chunk (wire.h ChunkTrailer; none: the whole transfer)
  int64_t offset = 0;
  bool last = true;
  std::vector<AuxRows> aux;
};

// Shared by every copy of a Pool: each job holds one, so drop_pool knows when no copy can touch
// the pool's memory any more (the weak pointer expires), and a job waiting on a peer sees the
// pool dropped and stops waiting.
struct PoolLife {
  std::atomic<bool> dropped{false};
};

struct Pool {
  std::string owner;  // session id
  std::string name;   // its buffer set id (errors name it)
  int device;         // -1: host memory
  int64_t num_pages;
  uint64_t sig;
  int rank;
  std::vector<RegionDesc> regions;
  std::vector<AuxDesc> aux;  // (set_aux)
  uint64_t xsig = 0;  // layout and region geometry (the cross-node lane compares it with the receiver's)
  // heads (set_heads): mixed TP on the lane. hmode 0: no head slices (another page layout,
  // replicated heads); 1: token-major pages (NHD), 2: head-major (HND). msig: the layout but for
  // its TP; global heads [hlo, hlo + hn) of ``ps`` tokens a page.
  int hmode = 0, hlo = 0, hn = 0, ps = 0;
  uint64_t msig = 0;
  // page-size conversions (set_units): the layout but for its page size, when every region's
  // page is its tokens' rows in order (token-major, K and V apart or side by side in a row), so
  // that a unit of g tokens is a run of g rows; 0: page for page only
  uint64_t usig = 0;
  // ... across services (cross_slots.unit_geometry_signature): usig and each region's bytes a
  // token, which the receiver's offer carries (0: page for page only)
  uint64_t xusig = 0;
  // page-layout conversions (set_rows): the layout but for its page layout, and where each
  // (layer, K/V, head)'s rows lie in a page, in that order on every layout; 0: none (MLA)
  uint64_t lsig = 0;
  std::vector<RowDesc> rows;
  // another GPU -> each region's base as mapped in that GPU's context (an imported pool is mapped
  // only in the context that opened it: a kernel on another GPU needs its own opening)
  std::unordered_map<int, std::vector<uint64_t>> alias;
  std::shared_ptr<PoolLife> life = std::make_shared<PoolLife>();
};

// ARMED: takes senders; RUNNING: every sender taken; COMPLETED: all copied (or one failed);
// GATED: disarmed while a copy was pending (takes no sender, goes once booked).
enum : int { ARMED = 1, RUNNING = 2, COMPLETED = 3, GATED = 4 };

struct Armed {  // one receiver rank's declaration
  int state = ARMED;
  std::string recv_session, recv_bs;
  int64_t prefix = 0;
  std::vector<int32_t> dst;
  double deadline = 0;
  int senders = 1;      // sender ranks it expects (mixed TP: several; 0: the first says)
  int pending = 0;      // copies taken and not yet booked by Python (forget)
  int done = 0;         // copies made
  int failed = 0;       // copies that failed
  std::string error;    // the first failure's
  uint64_t ranks = 0;   // sender ranks taken (bit per rank)
  uint64_t nbytes = 0;  // bytes copied into it
  bool told = false;    // its END went out
  std::vector<AuxRows> aux;  // the aux rows it declared (a sender must deliver them)
  bool aux_done = false;     // a sender's chunk delivered aux rows
  bool cancelled = false;    // its receiver ended it (disarm with cancel): Python tells the receiver
};

// A segment of a copy: one region of one receiver rank (the kernel's Region, 9 x u64).
struct Seg {
  uint64_t src, dst, src_stride, dst_stride, nbytes, run, src_run, dst_run, pairs;
};

struct Target {  // a receiver rank a same-node SEND copies into: all of it, or a head slice
  std::string akey;
  int rank = 0;
  Pool dp;
  std::vector<int32_t> dst;
  int hs = 0, hd = 0, nh = 0;  // nh 0: the whole page (equal layouts)
  int ms = 1, md = 1;          // units of gcd(page sizes) tokens a sender / receiver page (1, 1: pages)
  bool rows = false;           // another page layout: each head's rows moved (Pool::rows)
  int senders = 1;             // sender ranks this receiver rank has, by the layouts
};

struct Conn {
  int fd;
  std::string session;  // "" once its session ended: the lane thread closes it (drop_session)
};

// ---- cross-node lane (docs/decisions/0018) ---------------------------------------------
struct Arena {  // staging registered with this lane's NIXL agent: receive slots, then the scratch
  uint64_t base = 0, size = 0, scratch = 0;  // scratch: offset of the sender's packing area
  int device = -1;
};

struct XOut {  // a transfer the receiving service offered: its slot there
  int state = ARMED;
  int rank = 0;  // the receiver's rank
  std::string address, remote_agent;
  uint64_t raddr = 0, rbytes = 0, xsig = 0;
  int rdev = 0, rmem = 0;
  int64_t prefix = 0, ndst = 0;  // receiver pages
  // page-size conversions: the receiver's unit signature and page size (XOut::xusig, rps); the
  // sender writes units of gcd(page sizes) tokens, ms a sender page and md a receiver page (1, 1:
  // whole pages), ``units`` of them for a one-shot send (Lane::x_units)
  uint64_t xusig = 0;
  int rps = 0, ms = 1, md = 1;
  uint64_t units = 0;
  // page-layout conversions: the receiver pool's geometry (its regions' page bytes and head rows,
  // from its layout; its row signature from the offer); ``rows``: the sender packs pages in the
  // receiver's page layout (Lane::x_units), which the receiver unpacks as its own pages
  std::shared_ptr<const Pool> rlike;
  bool rows = false;
  double deadline = 0;
  // an engine's chunks of it (FLAG_CHUNK SEND_TOs, the delta within the slot): who sends them,
  // the next one's offset, whether the last came; packed at the same place in the scratch as in
  // the slot
  bool streaming = false, last = false;
  int fd = -1;
  std::string session, bs;
  int64_t next = 0, first = 0;  // ... and the first one's
  uint64_t scratch = 0, page = 0;  // page: a unit's bytes (a page's when ms == md == 1)
};

struct XIn {  // a transfer this service declared and offered with a slot
  int state = ARMED;
  std::string recv_session, recv_bs, sender_agent;
  int64_t prefix = 0;
  std::vector<int32_t> dst;
  uint64_t slot = 0, bytes = 0;  // the slot: its address and size (a larger delta streams through it)
  uint64_t got = 0, us = 0;      // units unpacked so far, and the µs it took
  uint32_t md = 0;               // units a page (the sender's notes say; 0: no note yet)
  bool cancel = false;           // ended by the receiver while a chunk was being unpacked
  int device = -1;
  double deadline = 0;
  std::vector<AuxRows> aux;  // the aux rows it declared (a W note with XF_AUX delivers them)
  bool aux_done = false;
  uint64_t aux_bytes = 0;     // aux bytes landed
  int64_t src_first = 0;      // the transfer page of the sender's first sent page (its notes say)
};

// One sender rank's chunks of a same-node transfer (key: transfer id and the sender's buffer
// set), from its first SEND to its end. A one-shot SEND is a stream of one chunk. Its chunks
// come in order; each is copied on its own; the stream ends (END to the engines, one completion
// for Python) once its last chunk's copy and every earlier one ended, or at a failure once no
// copy of it is in flight.
//
//   transfer pages   0 ........ prefix ........................ prefix + dst.size()
//   chunk            [off, off + n)  pages below ``prefix`` are the receiver's already: skipped
//   copied           src[i] -> dst[off + i - prefix]   for off + i >= prefix
struct Stream {
  int fd = -1;
  uint32_t flags = 0;
  std::string tid, bs, session;
  Pool sp;
  std::vector<Target> tg;
  int64_t prefix = 0, first = 0, next = 0;  // the first chunk's offset, and the next one's
  int inflight = 0;                         // chunks accepted whose copy has not ended
  bool last = false;                        // its last chunk was accepted
  std::string error;                        // the first failure (the stream ends with it)
  uint64_t nbytes = 0, us = 0;
  size_t moved = 0;  // pages copied (each target's)
};

struct LocalCopy {  // an accepted same-node chunk, to copy (the lane thread, or the bulk thread)
  int fd = -1;
  uint32_t flags = 0;
  std::string tid, bs, session, skey;  // skey: its Stream
  Pool sp;
  std::vector<Target> tg;
  int64_t prefix = 0, off = 0;  // the receiver's prefix; the chunk's first page in the transfer
  std::vector<int32_t> src;     // the chunk's pages
  std::vector<AuxCopy> aux;     // its aux rows, into every target
  bool behind = false;          // an earlier chunk of its stream is still being copied (host: queue behind it)
  uint32_t seq = 0;  // the SEND's: a GPU copy's REPLY goes once it is launched (copy_local)
  // CLOCK_MONOTONIC s: the SEND read, checked (targets), its copy launched, seen done (the END's trailer)
  double at_recv = 0, at_checked = 0, at_launch = 0, at_done = 0;
};

struct XSend {  // an accepted SEND_TO, to pack and write (the lane thread, or the bulk thread)
  Pool sp;
  XOut xo;
  std::string xk, tid;
  std::vector<int32_t> src;
  uint64_t scratch = 0, page = 0, chunk = 0;  // where it packs, a page's bytes, pages a chunk
  uint64_t parts = 2;                         // chunks in flight (stream_out)
};

struct XPend {  // written (or being written), waiting for the receiver's ack
  int fd = -1, rank = 0;
  std::string tid, session, bs, remote_agent;
  std::vector<int32_t> src;
  uint64_t nbytes = 0, npages = 0, prefix = 0, copy_us = 0;
  uint64_t credits = 0;  // chunks the receiver unpacked (a streamed transfer)
  uint32_t flags = 0;
  double deadline = 0;
  int64_t first = 0;  // the offset of src[0] in the transfer (a stream may start in the prefix)
  uint32_t inflight = 0;  // its chunks accepted and not yet finished (a WRITE posted or to come)
  std::string fail_why;   // a stream failing while chunks were in flight: it ends once they are done
  bool written = false, acked = false, ack_ok = false;
  std::string ack_msg;
};

// One chunk of a streamed cross-node transfer, timed (CLOCK_MONOTONIC s) when tracing is on:
// the batch timeline of bench_transfer --timeline. Sender: packing started, packed, WRITE
// posted, WRITE done, its note sent. Receiver: note read, unpack started, unpacked, credit or
// ack sent (t[4] unused).
struct ChunkTrace {
  std::string tid;
  uint32_t side = 0;  // 0 sender, 1 receiver
  uint64_t first = 0, npages = 0, nbytes = 0;
  double t[5] = {0, 0, 0, 0, 0};
};

struct Posted {  // a chunk's WRITE in flight (stream_out, XWrite)
  void* req = nullptr;
  int state = 0;
  bool after = true;
  double at = 0;  // when it was posted
  std::string rkey, msg;
  ChunkTrace tr;  // its timeline so far (tracing on)
};

// An engine chunk of a cross-node stream, packed and its WRITE posted (or failed), waiting its
// turn to be finished in order (cross_stream.cpp poll_writes).
struct XWrite {
  XOut xo;
  std::string xk, tid, err;
  std::vector<int32_t> src;
  Posted o;
  bool last = false, note_only = false;  // note_only: no pages, a note (aux rows, the last) alone
  uint64_t aux_bytes = 0, pages = 0, page = 0;  // its delta pages (the rest are in the prefix)
  int64_t offset = 0;                           // its chunk_offset
  double t0 = 0;
};

// DONE_SAME_NODE: a same-node stream ended (its last chunk, or its failure); DONE_CHUNK: a chunk
// of one copied before its last (booked in order: Poll and WatchTransfers follow the stream);
// DONE_XCHUNK: a chunk of a cross-node stream written before its last (the sender's record)
enum : int { DONE_SAME_NODE = 0, DONE_SENT = 1, DONE_RECEIVED = 2, DONE_CHUNK = 3, DONE_XCHUNK = 4 };

struct LaneCall {  // a CALL for Python (lane.cpp handle_call): who asked, its request
  int fd = -1;
  std::string session;
  uint32_t seq = 0, kind = 0;
  std::string rid, body;
};

struct Completion {
  std::string tid, bs, sender_session, error;
  int kind = DONE_SAME_NODE;
  int rank = 0;
  bool ok = true;
  uint32_t flags = 0;
  uint64_t nbytes = 0, copy_us = 0;
  bool told_recv = false, told_send = false;  // END reached that engine's lane
  std::vector<int32_t> src;
  int64_t first = 0;                       // same node: the offset of src[0] in the transfer
  uint64_t aux_rows = 0;                   // same node: aux rows copied
  std::vector<int> ranks;  // same node: the receiver ranks copied into
  std::vector<int> told;   // ... and whether each one's END went out now (1) or not (0)
};

}  // namespace kvlane
