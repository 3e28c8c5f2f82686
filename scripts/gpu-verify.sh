#!/usr/bin/env bash
# GPU tests on the device machine: bash scripts/gpu-verify.sh [pytest paths...] (default tests/gpu).
# Sets up the machine's Python (NIXL and the other wheels from .whl/, bench/README.md), builds the
# native lane and the Triton kernels' cubins for the GPUs present ahead of the tests (so no test
# times a first build), then runs pytest with the log written to ${OUT:-/tmp/kvservice-gpu}/
# <gpu>_tests.log in docs/gpu-verification/'s form (the command, the tree, the machine first).
set -u
out=${OUT:-/tmp/kvservice-gpu}
mkdir -p "$out"
if [ -d .whl ] && ! python3 -c "import nixl" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/clients/python${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
n=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
kind=$(echo "$gpu" | sed -E 's/.*(H100|H200|B200|A100|L40S).*/\1/' | tr 'A-Z' 'a-z')
[ "$n" -gt 1 ] && kind="${kind}x$n"
ccs=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | tr -d . | sort -u | tr '\n' ' ')
python3 -m kvservice.transfer.lane.native >"$out/native_build.log" 2>&1 || echo "native lane build failed (see native_build.log)"
# shellcheck disable=SC2086
python3 -m kvservice.kernels.aot $ccs >"$out/aot.log" 2>&1 || echo "Triton AOT compile failed (see aot.log)"
[ $# -gt 0 ] || set -- tests/gpu
log="$out/${kind}_tests.log"
{
  echo "# ${n}x $gpu, $(date -u +%F), tree ${TREE:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}:"
  echo "# python3 -m pytest -v -p no:cacheprovider -o addopts= -rs $*"
} >"$log"
python3 -m pytest -v -p no:cacheprovider -o addopts="" -rs "$@" 2>&1 | tee -a "$log"
