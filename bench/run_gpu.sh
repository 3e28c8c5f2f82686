#!/usr/bin/env bash
# A GPU suite on the device machine: bash bench/run_gpu.sh [gpu|gpu2] (default gpu; one call each,
# under ten minutes). Sets up the machine's Python (NIXL and the other wheels from .whl/), then runs
# bench/run.py, which writes <kind>/<suite>.json and its plot under ${OUT:-bench/results}.
set -eu
suite=${1:-gpu}
if [ -d .whl ] && ! python3 -c "import nixl" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/clients/python${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
exec python3 bench/run.py "$suite" --results "${OUT:-bench/results}"
