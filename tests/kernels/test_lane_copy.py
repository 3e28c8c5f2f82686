"""The data plane's copy kernel (kernels/lane_copy.py) against its numpy program, on awkward shapes
(16-byte words and bytes, whole pages and head-slice runs, chunks that cut a page anywhere,
several targets); and its ahead-of-time cubins (kernels/aot.py), compiled without a GPU and cached."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvservice.kernels.lane_copy import SEG_FIELDS, lane_copy, reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[2]


def _program(vec: bool, runs: bool, targets: int, moved: int, per: int, rng: np.random.Generator):
    src = torch.from_numpy(rng.integers(0, 256, 1 << 16, dtype=np.uint8)).to(DEVICE)
    dst = torch.zeros(1 << 16, dtype=torch.uint8, device=DEVICE)
    a, b = src.data_ptr(), dst.data_ptr()
    unit = 16 if vec else 3  # bytes of a run's unit: 16-byte words, or nothing aligned
    skew = (0, 0) if vec else (5, 7)
    segs = []
    for t in range(targets):
        for r in range(per):
            nbytes = 32 * unit
            run = (2 * unit, 4 * unit, 3 * unit) if runs else (nbytes, 0, 0)
            src_stride, dst_stride = (512, 1024) if vec else (515, 1027)
            base_s, base_d = a + r * 4096 + skew[0], b + t * 16384 + r * 4096 + skew[1]
            segs.append([base_s, base_d, src_stride, dst_stride, nbytes, *run, t * moved])
    segs_np = np.array(segs, dtype=np.uint64)
    pairs = np.array([[i % 5, (2 * i + 1) % 4] for i in range(targets * moved)], dtype=np.int32)
    for t in range(targets):  # a target's destination pages are distinct (as the lane arms them)
        pairs[t * moved : (t + 1) * moved, 1] = np.arange(moved)
    return src, dst, segs_np, pairs


@pytest.mark.parametrize("vec", [1, 0], ids=["words16", "bytes"])
@pytest.mark.parametrize("runs", [False, True], ids=["whole", "runs"])
@pytest.mark.parametrize("chunk", [64, 1 << 20, 80], ids=["chunk64", "one-chunk", "chunk80"])
def test_the_kernel_moves_exactly_what_the_program_says(vec: int, runs: bool, chunk: int) -> None:
    """Every destination byte equals the numpy program's; nothing else is written."""
    rng = np.random.default_rng(vec * 100 + runs * 10 + chunk % 7)
    moved, per, targets = 3, 2, 2
    src, dst, segs, pairs = _program(bool(vec), runs, targets, moved, per, rng)
    want = np.zeros(dst.numel(), np.uint8)
    reference(segs, pairs, moved, {src.data_ptr(): src.cpu().numpy(), dst.data_ptr(): want})
    zc = -(-int(segs[:, SEG_FIELDS.index("nbytes")].max()) // chunk)
    seg_t = torch.from_numpy(segs.view(np.int64)).to(DEVICE)
    lane_copy[(moved, len(segs), zc)](
        seg_t, torch.from_numpy(pairs).to(DEVICE), chunk, per, moved, VEC=vec, BLOCK=16
    )
    got = dst.cpu().numpy()
    assert want.any() and np.array_equal(got, want), np.flatnonzero(got != want)[:8]


def test_the_reference_refuses_an_address_outside_its_buffers() -> None:
    """The numpy program names the segment that points nowhere rather than writing somewhere."""
    segs = np.array([[1 << 40, 1 << 41, 16, 16, 16, 16, 0, 0, 0]], dtype=np.uint64)
    with pytest.raises(ValueError, match="in no buffer"):
        reference(segs, np.array([[0, 0]], np.int32), 1, {})


def _fresh(code: str, *args: str) -> None:
    """``code`` in a fresh Python without TRITON_INTERPRET, as a service compiles its cubins: in
    the whole suite an interpreted kernel run earlier in this process (Triton 3.9) can leave the
    interpreter's patches on ``triton.language``, and a real compile here then fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "clients" / "python"), env.get("PYTHONPATH", "")]
    )
    run = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]


def test_cubins_compile_without_a_gpu_and_take_the_scratch_parameters() -> None:
    """sm_90's narrow variant: a cubin, its symbol, no shared memory, five arguments + scratch."""
    _fresh(
        "from kvservice.kernels import aot\n"
        "im = aot.compile_image(90, 1, 256)\n"
        "assert im.cubin[:4] == b'\\x7fELF' and im.name == 'lane_copy' and im.shared == 0, im\n"
        "assert 5 <= im.params <= 8, im.params\n"
    )


def test_images_are_cached_by_source_triton_and_capability(tmp_path: Path) -> None:
    """A second start loads the six variants from the cache; a torn cache entry is compiled again."""
    _fresh(
        """
import sys
from pathlib import Path

from kvservice.kernels import aot

tmp = Path(sys.argv[1])
first = aot.images([90], tmp)
assert sorted((im.vec, im.threads) for im in first) == [(v, t) for v in (0, 1) for t in (128, 256, 512)]
calls = []
real = aot.compile_image
aot.compile_image = lambda cc, v, t: calls.append((cc, v, t)) or real(cc, v, t)
again = aot.images([90], tmp)
assert calls == [] and [im.cubin for im in again] == [im.cubin for im in first], calls
(torn,) = tmp.glob("kernels/*/lane_copy-v1-t512.cubin")
torn.write_bytes(torn.read_bytes()[:100])
aot.images([90], tmp)
assert calls == [(90, 1, 512)], calls
""",
        str(tmp_path),
    )
