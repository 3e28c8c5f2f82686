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
