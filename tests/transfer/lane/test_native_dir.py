"""Where the native module comes from: a prebuilt dir (the image's, read-only, no compiler) is
imported as is; one that does not hold this build and cannot be written is passed over for the
cache dir, never written into."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from kvservice.transfer.lane import native

# Runs in a fresh interpreter (a pybind11 module loads once per process): the prebuilt dir is
# read-only as in the image, and building anywhere but `may_build` fails the test.
_PROBE = """
import sys
from pathlib import Path
from kvservice.transfer.lane import native
may_build = sys.argv[1]
native._writable = lambda d: False
def no_build():
    if not may_build:
        raise SystemExit("would build")
    return Path(may_build)
native._build_dir = no_build
print(native.load().__file__)
"""


def _probe(native_dir: Path, may_build: str) -> str:
    env = {**os.environ, "KVSERVICE_NATIVE_DIR": str(native_dir)}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, may_build], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_prebuilt_module_is_imported_without_building(tmp_path: Path) -> None:
    built = Path(native.load().__file__)  # this host's build (cached)
    pre = tmp_path / "native" / native._tag()
    pre.mkdir(parents=True)
    shutil.copy(built, pre / built.name)
    assert _probe(tmp_path / "native", "") == str(pre / built.name)


def test_read_only_native_dir_without_this_build_falls_back_to_the_cache(tmp_path: Path) -> None:
    built = Path(native.load().__file__)
    (tmp_path / "native").mkdir()
    assert _probe(tmp_path / "native", str(built.parent)) == str(built)
    assert not any((tmp_path / "native").iterdir()), "nothing written into the prebuilt dir"
