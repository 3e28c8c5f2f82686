"""The native lane object (``csrc/module.cpp``'s ``Lane``, built by ``native.py``) as Python's half
of the lane calls it: the methods ``book.py``, ``finalize.py``, ``cross*.py`` and ``listener.py``
use, with the types pybind11 takes and gives (``std::string``: str, ``py::bytes``: bytes, a
``std::vector``: a list, a ``py::array_t``: a numpy array, which it converts to its dtype), and the
tuples it hands back. Types only: nothing here runs.

Methods bound without argument names take theirs positionally (pybind11 names them ``arg0``...).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt

__all__ = ["AuxRows", "Call", "ChunkTrace", "Completion", "NativeLane"]

# ``drain()``: a copy or cross-node end the native thread made (csrc/state.h Completion), in this
# order; the cross-node kinds leave the same-node fields (12-15) at their defaults.
Completion = tuple[
    str,  # 0 tid: the transfer
    int,  # 1 rank: the receiver rank (same node: the first of ``ranks``)
    str,  # 2 bs: the sender's buffer set
    str,  # 3 sender_session: the sending engine's session
    npt.NDArray[np.int32],  # 4 src: the sender's pages sent (int32)
    bool,  # 5 ok
    str,  # 6 error: why not, when not ok
    int,  # 7 nbytes
    int,  # 8 copy_us: the copy's (or WRITE's) µs
    int,  # 9 flags: the SEND's lane_wire flags
    bool,  # 10 told_recv: the receiving engine had its END on the lane
    bool,  # 11 told_send: the sending engine had its END on the lane
    list[int],  # 12 ranks: same node, the receiver ranks copied into
    list[int],  # 13 told: same node, per rank of ``ranks``: 1 when its END went out now
    int,  # 14 first: the transfer page of ``src[0]``
    int,  # 15 aux_rows: same node, the aux rows copied
    int,  # 16 kind: 0 same-node end, 1 sent, 2 received, 3 same-node chunk, 4 cross-node chunk
]

# ``take_calls()``: a CALL an engine sent on its lane (csrc/state.h LaneCall):
# (its connection's fd, session, seq, kind, request id, serialized request)
Call = tuple[int, str, int, int, str, bytes]

# ``take_trace()``: a chunk the cross-node lane timed (csrc/state.h ChunkTrace):
# (tid, side: 0 sender / 1 receiver, first page, pages, bytes, its five time points)
ChunkTrace = tuple[str, int, int, int, int, tuple[float, float, float, float, float]]

# (name, rows): a declaration's aux rows (int64), as ``arm`` and ``arm_in`` take them
AuxRows = list[tuple[str, npt.NDArray[np.int64]]]


class NativeLane(Protocol):
    """The methods of the native ``Lane`` that the lane's Python calls (csrc/lane.h says what
    each does)."""

    # -- setup and teardown (lane.h, module.cpp) ---------------------------------------------
    def set_guard(self, faults_fn: int, range_fn: int, /) -> None: ...

    def set_chunk(self, bytes_: int, /) -> None: ...

    def set_pull(self, pull: bool, /) -> None: ...

    def set_note_after(self, on: bool, /) -> None: ...

    def set_spin_us(self, us: int, /) -> None: ...

    def set_parts(self, parts: int, /) -> None: ...

    def init_cuda(self, libcuda: str, kernels: list[tuple[int, int, int, int, int, str, bytes]]) -> bool: ...

    def cuda_why(self) -> str: ...

    def completion_fd(self) -> int: ...

    def stop(self) -> None: ...

    # -- same node (arming.cpp) ----------------------------------------------------------------
    def prepare_device(self, dev: int, /) -> None: ...

    def add_conn(self, fd: int, session: str, /) -> None: ...

    def drop_session(self, session: str, /) -> None: ...

    def conns_of(self, session: str, /) -> int: ...

    def add_pool(
        self,
        bs: str,
        owner: str,
        device: int,
        num_pages: int,
        sig: int,
        rank: int,
        regions: npt.NDArray[np.uint64],
        xsig: int,
        /,
    ) -> None: ...

    def set_alias(self, bs: str, device: int, bases: npt.NDArray[np.uint64], /) -> None: ...

    def drop_pool(self, bs: str, wait_s: float = 10.0) -> bool: ...

    def set_heads(self, bs: str, hmode: int, msig: int, hlo: int, hn: int, ps: int, /) -> None: ...

    def set_units(self, bs: str, usig: int, xusig: int, /) -> None: ...

    def set_rows(self, bs: str, lsig: int, rows: npt.NDArray[np.uint64], /) -> bool: ...

    def set_aux(self, bs: str, aux: list[tuple[str, int, int, int]], /) -> None: ...

    def arm(
        self,
        tid: str,
        rank: int,
        recv_session: str,
        recv_bs: str,
        prefix: int,
        dst: npt.NDArray[np.int32],
        deadline: float,
        senders: int = 1,
        aux: AuxRows = ...,
    ) -> None: ...

    def disarm(self, tid: str, rank: int, cancel: bool = False) -> int: ...

    def forget(self, tid: str, rank: int, /) -> int: ...

    def abort_stream(self, tid: str, bs: str, why: str, /) -> None: ...

    def abort_xstreams(self, session: str, tid: str, why: str, /) -> list[str]: ...

    def drain(self) -> list[Completion]: ...

    # -- calls (lane_wire CALL) ----------------------------------------------------------------
    def set_calls(self, on: bool, /) -> None: ...

    def take_calls(self) -> list[Call]: ...

    def answer(self, fd: int, session: str, seq: int, code: int, msg: bytes) -> bool: ...

    # -- cross node (cross_setup.cpp, cross_send.cpp, cross_recv.cpp) ----------------------------
    def init_nixl(self, capi: str, name: str, /) -> bool: ...

    def nixl_why(self) -> str: ...

    def add_arena(self, device: int, in_bytes: int, scratch_bytes: int, /) -> int: ...

    def local_md(self) -> bytes: ...

    def load_md(self, md: bytes, /) -> str: ...

    def refuse_out(self, tid: str, rank: int, /) -> None: ...

    def arm_out(
        self,
        tid: str,
        rank: int,
        address: str,
        remote_agent: str,
        raddr: int,
        rbytes: int,
        rdev: int,
        rmem: int,
        xsig: int,
        prefix: int,
        ndst: int,
        deadline: float,
        xusig: int,
        rps: int,
        rlsig: int,
        rrows: npt.NDArray[np.uint64],
        rpages: npt.NDArray[np.uint64],
        /,
    ) -> None: ...

    def disarm_out(self, tid: str, rank: int, /) -> int: ...

    def forget_out(self, tid: str, rank: int, /) -> None: ...

    def arm_in(
        self,
        tid: str,
        rank: int,
        recv_session: str,
        recv_bs: str,
        sender_agent: str,
        prefix: int,
        dst: npt.NDArray[np.int32],
        slot: int,
        bytes: int,
        device: int,
        deadline: float,
        aux: AuxRows = ...,
    ) -> None: ...

    def disarm_in(self, tid: str, rank: int, cancel: bool = False) -> int: ...

    def forget_in(self, tid: str, rank: int, /) -> None: ...

    def stats(self) -> list[int]: ...

    def set_trace(self, on: bool, /) -> None: ...

    def take_trace(self) -> list[ChunkTrace]: ...
