"""The data plane's copy kernel (``lane_copy``) compiled ahead of time, for the native lane.

For each compute capability of the devices present the lane needs six variants: 16-byte words
or bytes (``VEC``), times a small block (128 threads; a block that moves at most 8 KiB), a narrow
one (256) or a wide one (512; whole pages of at least 32 KiB a block). Triton compiles each to a
cubin for that capability (no GPU needed to compile: ``python -m kvservice.kernels.aot 90``
prepares an image's cache); the cubins are cached outside the package::

    <cache root>/kernels/<key>/lane_copy-v<VEC>-t<threads>.cubin   + .json (name, shared, params)
    key = sha256(kernel source, Triton version, capability)[:16]

(``kvservice_client.jit_cache.cache_root``: ``$KVSERVICE_CACHE_DIR``, else the XDG cache, else
tmp). The lane loads them with ``cuModuleLoadData`` and launches them with ``cuLaunchKernel``
(``transfer/lane/csrc/copy.cpp``): no Python on a copy's path. ``params`` counts the kernel's parameters
as compiled (its five arguments, then the scratch pointers this Triton version appends).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = ["THREADS", "KernelImage", "compile_image", "images"]

log = logging.getLogger(__name__)

THREADS = (128, 256, 512)  # the small, narrow and wide blocks (copier.h SMALL_/NARROW_/WIDE_THREADS)
SMALL_BYTES = 8192  # a block moving at most this takes the small block (copier.h SMALL_BYTES)
_WORDS_PER_THREAD = 4  # 16-byte words (or bytes) a thread moves per step: four loads in flight
_SIGNATURE = {
    "segs_ptr": "*u64",
    "pairs_ptr": "*i32",
    "chunk": "i32",
    "per_target": "i32",
    "moved": "i32",
    "VEC": "constexpr",
    "BLOCK": "constexpr",
}


@dataclasses.dataclass(frozen=True)
class KernelImage:
    """One compiled variant: what ``Lane.init_cuda`` takes (``as_tuple``)."""

    cc: int  # compute capability, major * 10 + minor
    vec: int  # 1: 16-byte words, 0: bytes
    threads: int
    shared: int  # bytes of shared memory a block
    params: int  # the kernel's parameters as compiled
    name: str  # its symbol in the cubin
    cubin: bytes

    def as_tuple(self) -> tuple[int, int, int, int, int, str, bytes]:
        return (self.cc, self.vec, self.threads, self.shared, self.params, self.name, self.cubin)


def _key(cc: int) -> str:
    import triton

    from . import lane_copy

    src = inspect.getsource(lane_copy)
    return hashlib.sha256(f"{src}\0{triton.__version__}\0{cc}".encode()).hexdigest()[:16]


def compile_image(cc: int, vec: int, threads: int, words: int = _WORDS_PER_THREAD) -> KernelImage:
    """Compile one variant for capability ``cc`` (Triton, ~1 s; no GPU needed); ``words``: words
    a thread moves per step (the lane's is fixed; bench/sweep_lane_kernel.py tries others)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction

    from .lane_copy import lane_copy

    # NOTE: under TRITON_INTERPRET=1 (CPU tests) the decorated kernel is the interpreter's: compile
    # the same function as a JIT one
    fn = lane_copy if isinstance(lane_copy, JITFunction) else JITFunction(lane_copy.fn)
    block = threads * words
    # NOTE: the segments start the lane's descriptor buffer (cuMemAlloc: 256-byte aligned); the
    # pairs follow 72 bytes a segment after it, so only 8-byte aligned: no hint for them
    attrs = {(0,): [["tt.divisibility", 16]]}
    consts = {(fn.arg_names.index("VEC"),): vec, (fn.arg_names.index("BLOCK"),): block}
    src = ASTSource(fn=fn, signature=_SIGNATURE, constexprs=consts, attrs=attrs)
    target = GPUTarget("cuda", cc, 32)
    options = make_backend(target).parse_options({"num_warps": threads // 32})
    # (Triton reads TRITON_INTERPRET at compile time too: a process that set it after importing
    # the kernel, as the CPU tests do, still compiles the cubin, not the interpreter's function)
    interpret = os.environ.pop("TRITON_INTERPRET", None)
    try:
        k = triton.compile(src, target=target, options=options.__dict__)
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
    md = k.metadata
    for scratch in ("global_scratch_size", "profile_scratch_size"):
        if getattr(md, scratch, 0):
            raise RuntimeError(f"lane_copy for sm_{cc} needs {scratch}={getattr(md, scratch)}: unsupported")
    entry = re.search(r"\.entry\s+\w+\s*\((.*?)\)", k.asm["ptx"], re.S)
    if entry is None:
        raise RuntimeError(f"lane_copy for sm_{cc}: no .entry in its PTX")
    params = entry.group(1).count(".param")
    return KernelImage(cc, vec, threads, int(md.shared), params, str(md.name), bytes(k.asm["cubin"]))


def _cached(folder: Path, cc: int, vec: int, threads: int) -> KernelImage | None:
    stem = folder / f"lane_copy-v{vec}-t{threads}"
    try:
        meta = json.loads(stem.with_suffix(".json").read_text())
        cubin = stem.with_suffix(".cubin").read_bytes()
    except (OSError, ValueError):
        return None
    if len(cubin) != meta.get("bytes"):
        return None
    return KernelImage(cc, vec, threads, int(meta["shared"]), int(meta["params"]), str(meta["name"]), cubin)


def _store(folder: Path, im: KernelImage) -> None:
    stem = folder / f"lane_copy-v{im.vec}-t{im.threads}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = stem.with_suffix(".cubin.tmp")
        tmp.write_bytes(im.cubin)
        tmp.replace(stem.with_suffix(".cubin"))  # NOTE: the cubin first: a .json names a whole file
        meta = {"name": im.name, "shared": im.shared, "params": im.params, "bytes": len(im.cubin)}
        tmp = stem.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(meta))
        tmp.replace(stem.with_suffix(".json"))
    except OSError as exc:  # a read-only cache: compiled again at the next start
        log.warning("kernel cache not written: %s", exc)


def images(ccs: Iterable[int], cache_root: Path | None = None) -> list[KernelImage]:
    """Every variant for each capability in ``ccs``, from the cache or compiled (then cached)."""
    if cache_root is None:
        from kvservice_client.jit_cache import cache_root as default_root

        cache_root = default_root()
    out = []
    for cc in sorted(set(ccs)):
        folder = cache_root / "kernels" / _key(cc) if cache_root is not None else None
        for vec in (1, 0):
            for threads in THREADS:
                im = _cached(folder, cc, vec, threads) if folder is not None else None
                if im is None:
                    im = compile_image(cc, vec, threads)
                    if folder is not None:
                        _store(folder, im)
                out.append(im)
    return out


if __name__ == "__main__":  # python -m kvservice.kernels.aot 90 100: fill the cache ahead of time
    logging.basicConfig(level=logging.INFO)
    got = images(int(a) for a in sys.argv[1:])
    for im in got:
        print(f"sm_{im.cc} vec={im.vec} threads={im.threads}: {len(im.cubin)} bytes, {im.params} params")
