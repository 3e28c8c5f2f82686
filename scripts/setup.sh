#!/usr/bin/env bash
# Creates .venv (if missing) and installs kvservice, its client SDK and the test tools into it.
# Needs only python3 (>= 3.10) and network access to PyPI. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.kvservice-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ clients/python/pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch pulls ~3 GB of CUDA wheels from PyPI: resume broken downloads instead of failing, and keep
  # no second copy in the pip cache (a 2-core CI machine ran out of disk with one)
  .venv/bin/python -m pip install -q --no-cache-dir --resume-retries 20 -e ./clients/python -e ".[dev]"
  touch "$stamp"
fi
# The native modules (cached by source hash: instant once built): the fault guard every service
# loads before it serves, and the lane (a service builds it in the background otherwise)
.venv/bin/python -c 'import kvservice.buffers.guard as g; g.main()' >/dev/null
.venv/bin/python -m kvservice.transfer.lane.native >/dev/null || echo "warning: the native lane did not build; services use gRPC only"
