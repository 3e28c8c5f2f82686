"""Knobs of the data plane's performance. Their defaults are the measured best on the hardware
we ship for (docs/decisions/0014, 0017, 0018, 0019); they exist so that a benchmark can sweep
them, and a deployment should leave them alone. None changes what a transfer does, only how
fast and at which CPU cost."""

from __future__ import annotations

import dataclasses

from ._option import check_choice, check_range, opt

__all__ = ["Tuning"]


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Tuning (benchmark knobs; the defaults are the measured best)."""

    gil_switch_us: int = opt(
        0,
        "Python's thread switch interval in this service, in µs (sys.setswitchinterval; 0 keeps "
        "Python's 5,000). A completion or poller thread that finished waiting needs the GIL to hand "
        "its result to the event loop; while the loop runs Python it waits up to this long for it.",
    )
    two_gpu_copy: str = opt(
        "auto",
        "A same-node copy between pools on two GPUs: 'push' (the fused kernel on the source GPU "
        "writes the destination pools through their mapping in its own context), 'pull' (the "
        "kernel on the destination GPU reads the source pools), 'staged' (pack, one link copy, "
        "unpack: no second mapping), 'auto' (the measured fastest per size; docs/decisions/0017). "
        "The native lane copies in one kernel: on the destination GPU with 'pull', else the source's.",
    )
    lane_cuda_chunk_kb: int = opt(
        32,
        "KiB of one page region each CUDA block of the lane's copy kernel moves (a page region is "
        "split into such chunks). Whole pages of 32 KiB a block or more take the 512-thread kernel, "
        "blocks of at most 8 KiB (a 4 -> 2 head slice) the 128-thread one, the rest (other head "
        "slices, smaller pages) the 256-thread one (docs/decisions/0019: on an H200, "
        "32 KiB blocks move the same-node 2 GiB row 2 points closer to a device copy than 16 KiB).",
    )
    lane_spin_us: int = opt(
        -1,
        "µs the lane's threads keep polling without sleeping after a message or a job, the bulk "
        "thread also after an offer (0: they sleep at once; -1: 5000 when the lane copies on a "
        "GPU, 0 otherwise). A sleeping thread's wake-up on an idle core of the GPU host costs "
        "~50 µs per hop, which a transfer pays on its way in; spinning holds a core while engines "
        "send.",
    )
    lane_wait_spin_us: int = opt(
        -1,
        "µs an engine's thread waiting for the lane's answer (a REPLY, a transfer's END) polls "
        "before it sleeps, told to engines when their lane opens (an engine's own "
        "KVSERVICE_LANE_SPIN_US or Client(lane_spin_us=) wins). -1: 5000 when the lane copies on "
        "a GPU, 0 otherwise. A waiter asleep in poll wakes ~50-80 µs after its END on the GPU "
        "host (a twentieth of a 2 GiB copy); spinning holds a core of the engine's host while it lasts "
        "(each try releases the GIL).",
    )
    lane_cross_gpu_mb: int = opt(
        1024,
        "MiB of the cross-node lane's staging on each GPU (lane_cross_mb is host memory's, and the "
        "GPUs' too when this is 0). Larger slots mean fewer, larger chunks for a streamed delta: "
        "2 GiB through the default 256 MiB slot goes in 64 MiB chunks.",
    )
    lane_cross_parts: int = opt(
        4,
        "Chunks of a streamed cross-node delta in flight: its slot is split in this many parts, "
        "and chunk k waits until the receiver has unpacked chunk k - parts (2..16). More parts hide "
        "the notification round trip behind the WRITEs; fewer make each chunk larger.",
    )
    lane_cross_stream: str = opt(
        "gpu",
        "Which deltas larger than a cross-node lane slot stream through it in chunks: 'gpu' (GPU "
        "pools: the gRPC route packs those anyway), 'all' (host pools too; there the gRPC route's "
        "DIRECT writes into the registered pools are faster), 'off' (larger deltas use gRPC).",
    )
    lane_note_with_write: bool = opt(
        False,
        "The cross-node lane's notification rides its last WRITE instead of following it once that "
        "WRITE is done (off: the measured faster way). Replaces KVLANE_NOTE_WITH_WRITE=1.",
    )

    def validate(self) -> None:
        check_range("gil_switch_us", self.gil_switch_us, 0, 100_000, "0 (Python's default) .. 100000 µs")
        check_choice("two_gpu_copy", self.two_gpu_copy, ("auto", "push", "pull", "staged"))
        check_range("lane_cuda_chunk_kb", self.lane_cuda_chunk_kb, 1, 65536, "1..65536 (KiB)")
        check_range("lane_spin_us", self.lane_spin_us, -1, 1_000_000, "-1 (auto) or 0..1000000 (µs)")
        check_range(
            "lane_wait_spin_us", self.lane_wait_spin_us, -1, 1_000_000, "-1 (auto) or 0..1000000 (µs)"
        )
        check_range("lane_cross_gpu_mb", self.lane_cross_gpu_mb, 0, 1 << 20, "0..1048576 (MiB)")
        check_range("lane_cross_parts", self.lane_cross_parts, 2, 16, "2..16")
        check_choice("lane_cross_stream", self.lane_cross_stream, ("gpu", "all", "off"))
