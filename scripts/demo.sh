#!/usr/bin/env bash
# The main job: set up, then run the multi-turn transfer demo on the CPU default
# (two kvservice processes, two engine processes, KV pools in POSIX shared memory).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvservice demo "$@"
