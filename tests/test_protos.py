"""The checked-in generated code is exactly what the one generator command produces."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh() -> None:
    """Regenerating from protos/ changes nothing (run `python tools/gen_protos.py` if it does)."""
    r = subprocess.run(
        [sys.executable, "tools/gen_protos.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr


def test_every_message_and_field_is_documented() -> None:
    """Each message, field, rpc and enum in the protos has a comment right above it."""
    undocumented = []
    for proto in (ROOT / "protos").rglob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            is_decl = s.startswith(("message ", "rpc ", "enum ")) or (
                s.endswith(";")
                and "=" in s
                and not s.startswith(("option", "syntax", "//", "package", "import"))
            )
            if not is_decl or s.startswith("message ") and s.endswith("{}"):
                continue
            prev = lines[i - 1].strip() if i else ""
            if not prev.startswith("//") and not _doc_block_above(lines, i):
                undocumented.append(f"{proto.name}:{i + 1}: {s}")
    assert not undocumented, "\n".join(undocumented)


def _doc_block_above(lines: list[str], i: int) -> bool:
    # NOTE: fields of one documented group (e.g. `uint32 tp_size = 10; uint32 tp_rank = 11;`)
    # share the comment above the first of them.
    j = i - 1
    while j >= 0 and lines[j].strip() and not lines[j].strip().startswith("//"):
        s = lines[j].strip()
        if not (s.endswith(";") and "=" in s):
            return False
        j -= 1
    return j >= 0 and lines[j].strip().startswith("//")
