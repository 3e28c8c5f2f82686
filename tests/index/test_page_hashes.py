"""Canonical page hashes: known-answer vectors and the vectorised XXH3 against xxhash."""

from __future__ import annotations

import json
import pathlib
import threading
from typing import Any

import numpy as np
import pytest
import xxhash
from kvservice_client import hashing
from kvservice_client.hashing import tokens_to_u32le

VECTORS = pathlib.Path(__file__).parents[1] / "vectors" / "page_hash.json"
SEEDS = [0, 1, 12345678901234, 2**64 - 1]


def _cases() -> list[dict]:
    return json.loads(VECTORS.read_text())["cases"]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"ps{c['page_size']}-n{len(c['tokens'])}")
def test_known_answer_vectors(case: dict) -> None:
    """page_hashes and the reference loop reproduce every stored vector."""
    want = [int(h, 16) for h in case["hashes"]]
    tokens = np.array(case["tokens"], dtype=np.uint64)
    seed = int(case["seed"])
    assert hashing.page_hashes(tokens, case["page_size"], seed).tolist() == want
    assert hashing.page_hashes_reference(tokens, case["page_size"], seed).tolist() == want


@pytest.mark.parametrize("page_size", list(range(1, 70)) + [96, 128, 200, 255, 256])
def test_vectorised_xxh3_matches_xxhash(page_size: int) -> None:
    """The numpy XXH3 equals xxhash for every page size 1..69 and the long single-block sizes."""
    rng = np.random.default_rng(page_size)
    words = rng.integers(0, 2**32, (7, page_size), dtype=np.uint64).astype("<u4")
    for seed in SEEDS:
        want = [xxhash.xxh3_64_intdigest(row.tobytes(), seed) for row in words]
        assert hashing._xxh3_pages(words, seed).tolist() == want


@pytest.mark.parametrize("page_size", [1, 3, 16, 33, 64, 257, 300])
def test_page_hashes_equal_reference(page_size: int) -> None:
    """The fast path equals the one-call-per-page definition, partial last page ignored."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 2**32, page_size * 9 + page_size // 2, dtype=np.uint64)
    for seed in SEEDS:
        assert (
            hashing.page_hashes(tokens, page_size, seed)
            == hashing.page_hashes_reference(tokens, page_size, seed)
        ).all()


def test_xxhash_chain_fallback_equals_compiled_chain() -> None:
    """The chain without numba (xxhash loop) equals the compiled chain."""
    local = np.random.default_rng(3).integers(0, 2**63, 500, dtype=np.uint64)
    for seed in SEEDS:
        assert (hashing._chain_xxhash(local, seed) == hashing._chain(local, seed)).all()


def test_parent_continues_the_chain() -> None:
    """Hashing a suffix from its parent's hash equals hashing the whole sequence."""
    tokens = np.arange(16 * 10, dtype=np.uint64)
    whole = hashing.page_hashes(tokens, 16, 5)
    tail = hashing.page_hashes(tokens[16 * 4 :], 16, 5, parent=int(whole[3]))
    assert (tail == whole[4:]).all()


def test_bad_arguments_raise() -> None:
    """Non-positive page size, seeds outside u64 and odd byte strings raise ValueError."""
    with pytest.raises(ValueError):
        hashing.page_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        hashing.page_hashes([1, 2], 1, seed=-1)
    with pytest.raises(ValueError):
        hashing.page_hashes(b"\x00" * 5, 1)
    assert hashing.page_hashes([1, 2, 3], 4).size == 0


@pytest.mark.parametrize("n", [0, 1, 17, 1 << 16, (1 << 16) + 3, 1 << 17])
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint32, np.uint16])
def test_tokens_pack_as_u32_little_endian_whatever_the_scratch_holds(n: int, dtype: Any) -> None:
    """The packed form equals numpy's own conversion, for every size (a thread's scratch grows,
    and a shorter prompt after a longer one reads none of the longer one's tail)."""
    rng = np.random.default_rng(n)
    top = min(np.iinfo(dtype).max, 150_000)
    tokens = rng.integers(0, top, n).astype(dtype)
    assert tokens_to_u32le(tokens) == tokens.astype("<u4").tobytes()
    assert tokens_to_u32le(tokens[: n // 2]) == tokens[: n // 2].astype("<u4").tobytes()
    assert tokens_to_u32le(tokens.tolist()) == tokens.astype("<u4").tobytes()


def test_threads_pack_tokens_each_in_their_own_scratch() -> None:
    prompts = [np.random.default_rng(i).integers(0, 150_000, 70_000 + i) for i in range(4)]
    want = [p.astype("<u4").tobytes() for p in prompts]
    bad: list[int] = []

    def run(i: int) -> None:
        for _ in range(50):
            if tokens_to_u32le(prompts[i]) != want[i]:
                bad.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
