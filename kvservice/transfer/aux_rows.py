"""Aux rows of a chunk (SGLang's metadata rows and the like): checked against the plan, as descriptors.

sender rows ``chunk.aux[name]`` ─▶ receiver rows ``plan.aux[name]``   (same count, same row_bytes)
each row one descriptor ``[address, row_bytes, device 0]`` (aux regions live in host memory)
"""

from __future__ import annotations

import numpy as np

from ..buffers import BufferSet
from ..errors import FailedPrecondition
from .values import Plan

__all__ = ["aux_rows"]


def aux_rows(bs: BufferSet, plan: Plan, aux: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) descriptor rows for writing ``aux`` (name -> our rows) into the rows the
    receiver declared; FAILED_PRECONDITION when a name, a row count or a row size disagrees."""
    local_rows, remote_rows = [], []
    for name, rows in aux.items():
        if name not in plan.aux_names:
            raise FailedPrecondition(f"aux: receiver has no aux region named {name!r}")
        i = plan.aux_names.index(name)
        want = plan.aux.get(name)
        if want is None or want.size != rows.size:
            raise FailedPrecondition(
                f"aux[{name}]: sender names {rows.size} rows, receiver declared "
                f"{0 if want is None else want.size}"
            )
        mine = bs.aux_by_name(name)
        assert mine is not None
        if mine.row_bytes != plan.aux_row_bytes[i]:
            raise FailedPrecondition(
                f"aux[{name}]: row_bytes {mine.row_bytes} != receiver's {plan.aux_row_bytes[i]}"
            )
        rb = mine.row_bytes
        local_rows.append(
            np.stack([mine.region.address + rows * rb, np.full_like(rows, rb), np.zeros_like(rows)], 1)
        )
        remote_rows.append(
            np.stack(
                [plan.aux_regions[i].address + want * rb, np.full_like(want, rb), np.zeros_like(want)], 1
            )
        )
    if not local_rows:
        empty = np.zeros((0, 3), dtype=np.int64)
        return empty, empty
    return np.concatenate(local_rows), np.concatenate(remote_rows)
