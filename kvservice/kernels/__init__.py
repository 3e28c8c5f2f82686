"""Pack/unpack of KV pages through a contiguous, destination-major staging buffer.

``pack`` gathers the selected pages (and optionally a head slice) of every layer's K and V
(MHA) or latent (MLA) into staging; ``unpack`` scatters such a buffer into destination pages
at a head offset. The staging layout is drawn in ``_regions``; mixed-TP head routing lives in
``heads``. Backends ("auto"): Triton on CUDA tensors, the compiled CPU copy loop (``_pack_cpu``,
one pass, no temporary) on host tensors; the torch reference (``reference``, ``backend="torch"``)
is the oracle; ``backend="triton"`` runs the kernels on CPU under ``TRITON_INTERPRET=1`` (tests).
All raise :class:`~kvservice.errors.InvalidArgument` for a bad call and then change nothing.
"""

from __future__ import annotations

from typing import Literal

import torch

from . import reference
from ._checks import PageIndices, check_copy, distinct
from ._regions import KVRegions, packed_nbytes
from .heads import HeadRoute, plan_heads

__all__ = ["Backend", "HeadRoute", "KVRegions", "distinct", "pack", "packed_nbytes", "plan_heads", "unpack"]

Backend = Literal["auto", "torch", "triton", "cpu"]


def _backend(regions: KVRegions, staging: torch.Tensor | None, backend: Backend) -> str:
    # NOTE: "auto" never picks the Triton interpreter for CPU tensors, even under
    # TRITON_INTERPRET=1: the interpreter is not thread-safe and the service unpacks concurrently.
    # Tests exercise the interpreted kernels with backend="triton".
    if backend != "auto":
        return backend
    if regions.device.type == "cuda":
        return "triton"
    return "cpu" if staging is None or staging.device.type == "cpu" else "torch"


def pack(
    regions: KVRegions,
    pages: PageIndices,
    out: torch.Tensor | None = None,
    *,
    head_start: int = 0,
    num_heads: int | None = None,
    num_slices: int = 1,
    backend: Backend = "auto",
    unit: int | None = None,
    head_major: bool | None = None,
) -> torch.Tensor:
    """Gather ``pages`` (selection order) of every region into staging; return the packed bytes.

    Slice ``s`` holds local heads ``head_start + s*num_heads + [0, num_heads)`` (``num_heads``
    defaults to every head from ``head_start``). ``out`` (allocated on the regions' device if
    None; pinned host memory allowed for CUDA regions) needs ``packed_nbytes(...)`` bytes;
    the returned uint8 view is exactly that long. On CUDA the copy is asynchronous on the
    current stream. ``unit`` (tokens, dividing the page size) makes ``pages`` unit indices (see
    ``_regions``); ``head_major`` is the staging order (default the pool's own: pass the
    receiver's, so that its unpack is the straight copy).
    """
    kind = _backend(regions, out, backend)
    if kind == "triton":
        from . import _triton

        return _triton.pack(
            regions,
            pages,
            out,
            head_start=head_start,
            num_heads=num_heads,
            num_slices=num_slices,
            unit=unit,
            head_major=head_major,
        )
    if kind == "cpu":
        from . import _pack_cpu  # numba: imported on first use, like the fused copy

        args = check_copy(
            regions,
            pages,
            out,
            head_start,
            num_heads,
            num_slices,
            to_staging=True,
            unit=unit,
            head_major=head_major,
        )
        _pack_cpu.pack(regions, args)
        return args.staging
    return reference.pack(
        regions,
        pages,
        out,
        head_start=head_start,
        num_heads=num_heads,
        num_slices=num_slices,
        unit=unit,
        head_major=head_major,
    )


def unpack(
    regions: KVRegions,
    staging: torch.Tensor,
    pages: PageIndices,
    *,
    head_start: int = 0,
    num_heads: int | None = None,
    num_slices: int = 1,
    backend: Backend = "auto",
    unit: int | None = None,
    head_major: bool | None = None,
    gate: torch.Tensor | None = None,
) -> None:
    """Scatter packed ``staging`` into distinct destination ``pages`` at local head ``head_start``.

    Inverse of :func:`pack` with the same arguments; only heads
    ``[head_start, head_start + num_slices*num_heads)`` of the named pages (units) change.
    ``gate`` (int64 [1], e.g. ``checksum.launch(...).gate``): copy only if it holds non-zero. The
    Triton kernel reads it on the device, in stream order, so a verdict computed just before on
    the same stream needs no host round trip; the other backends read it on the host.
    """
    kind = _backend(regions, staging, backend)
    if kind == "triton":
        from . import _triton

        _triton.unpack(
            regions,
            staging,
            pages,
            head_start=head_start,
            num_heads=num_heads,
            num_slices=num_slices,
            unit=unit,
            head_major=head_major,
            gate=gate,
        )
        return
    if gate is not None and not int(gate.reshape(-1)[0]):
        check_copy(  # a refused call is still a checked one
            regions,
            pages,
            staging,
            head_start,
            num_heads,
            num_slices,
            to_staging=False,
            unit=unit,
            head_major=head_major,
        )
        return
    if kind == "cpu":
        from . import _pack_cpu

        _pack_cpu.unpack(
            regions,
            check_copy(
                regions,
                pages,
                staging,
                head_start,
                num_heads,
                num_slices,
                to_staging=False,
                unit=unit,
                head_major=head_major,
            ),
        )
        return
    reference.unpack(
        regions,
        staging,
        pages,
        head_start=head_start,
        num_heads=num_heads,
        num_slices=num_slices,
        unit=unit,
        head_major=head_major,
    )
