// The lane's wire format: engine <-> service (SEND, SEND_TO, REPLY, END) and the cross-node lane's
// NIXL notifications between two services. Python's side: kvservice_client's lane_wire.py and
// kvservice/transfer/lane/cross.py (the note format).
#pragma once

#include <time.h>

#include <cstddef>
#include <cstdint>

namespace kvlane {

// ---- wire format (little endian; documented in clients/python/kvservice_client/lane_wire.py) -------------------------
enum : uint32_t { MSG_SEND = 1, MSG_REPLY = 2, MSG_END = 3, MSG_SEND_TO = 4, MSG_CALL = 5 };
// FALLBACK: make the call over gRPC. A later chunk of a transfer the lane has: INVALID, the chunk
// is refused and nothing changed (the transfer goes on: INVALID_ARGUMENT); REFUSED, the transfer
// has ended or ends FAILED now, with the message (FAILED_PRECONDITION).
enum : int32_t { REPLY_ACCEPTED = 0, REPLY_FALLBACK = 1, REPLY_INVALID = 2, REPLY_REFUSED = 3 };
constexpr uint32_t FLAG_SRC_I64 = 2;  // SEND / SEND_TO flags: the source pages are i64 (lane_wire)
constexpr uint32_t FLAG_CHUNK = 4;    // SEND: a ChunkTrailer (and its aux rows) follows the pages
struct SendHdr {
  uint32_t type, seq, n_src, tid_len, bs_len, flags;
};
// A chunk of a transfer (SendDelta's chunk_offset, last_chunk, aux), after the source pages;
// then n_aux times: u32 name_len, u32 n_rows | name | i64 rows[n_rows]. A SEND without it is the
// whole transfer: offset 0, last, no aux rows.
struct ChunkTrailer {
  uint64_t offset;
  uint32_t last, n_aux;
};
struct AuxHdr {
  uint32_t name_len, n_rows;
};
// A call Python answers (ExpectDelta, kind CALL_EXPECT): the request id, then the serialized
// request; the REPLY carries the serialized response (ACCEPTED), the error (REPLY_ERROR: its gRPC
// code name, a newline, its message), or FALLBACK (make the call over gRPC).
struct CallHdr {
  uint32_t type, seq, kind, rid_len, body_len;
};
enum : uint32_t { CALL_EXPECT = 1 };
constexpr int32_t REPLY_ERROR = 4;
struct SendToHdr {  // SEND to another node's service: + the receiving service's address
  uint32_t type, seq, n_src, tid_len, bs_len, flags, addr_len;
};
// The cross-node lane's NIXL notifications (W: the sender wrote a chunk of a transfer's pages
// into the receiver's slot; C: the receiver unpacked a chunk that was not the last, its part of
// the slot is free again; A: the receiver unpacked the last chunk, or refused), binary, then tid
// and message. A delta larger than its slot streams through it in chunks (lane_cross_parts parts in turn).
//
// An engine's chunks of one transfer (FLAG_CHUNK SEND_TOs) whose delta fits its slot are each
// written at their own place in the slot (the delta page's), one W note per chunk; the one
// that says XF_LAST ends it, and the W note of a chunk with aux rows carries them (XF_AUX, the
// message: aux_rows_msg), as does a note with no pages (a last chunk of prefix pages only).
struct XNote {
  char magic[4];
  uint32_t kind, rank, ok;
  uint64_t nbytes, npages;
  uint64_t first, off;  // W: the chunk's first page (of the delta) and its offset in the slot
  double at;            // CLOCK_MONOTONIC s when sent (one clock per host: the lane's timings, stats())
  uint32_t tid_len, msg_len;
  uint32_t flags;       // W: XF_*
  uint32_t src_first;   // W: the receiver page the sender's first sent page is in (below the prefix: skipped)
  // W: units a receiver page (1: whole pages; more: a page-size conversion, units of gcd(page
  // sizes) tokens): npages, first and nbytes count units then
  uint32_t per_page;
  uint32_t reserved;
};
inline constexpr char XMAGIC[4] = {'K', 'V', 'X', '4'};
enum : uint32_t { XF_LAST = 1, XF_AUX = 2 };
constexpr size_t MAX_AUX_NOTE = 64 * 1024;  // aux rows a W note carries (more: over gRPC)
// The scratch's first 1/XSMALL is where the lane thread packs the cross-node sends that fit it
// whole; the rest is the bulk thread's (streamed sends). A slot is at most half the receive
// staging, which is as large as the scratch: with 2, every one-WRITE send stays on the lane
// thread (as measured: no hand-off on the 64 MiB row) and only streamed ones move.
constexpr uint64_t XSMALL = 2;
enum : uint32_t { XNOTE_WRITTEN = 1, XNOTE_ACK = 2, XNOTE_CREDIT = 3 };
// A receiver that ended a transfer while the lane unpacked one of its chunks, or while a same-node
// stream into it waited for its next chunk (Abort, deadline): the completion's error, which
// Python books as the receiver's own end (no END to the receiver from the lane).
inline constexpr const char* CANCELLED = "cancelled by the receiving service";
struct ReplyHdr {
  uint32_t type, seq;
  int32_t code;
  uint32_t msg_len;
};
struct EndHdr {
  uint32_t type, role, state, tid_len, bs_len, msg_len;
  uint64_t nbytes, npages, skipped, copy_us;
};
constexpr size_t MAX_MSG = 256 * 1024;
constexpr uint32_t END_CROSS = 1;

inline double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

}  // namespace kvlane
