#!/usr/bin/env bash
# Set up, then run every test (CPU; GPU tests skip without CUDA). grpcurl is installed with Go
# when Go is present so the reflection test runs against a client we did not write.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! command -v grpcurl >/dev/null 2>&1 && [ ! -x "$HOME/go/bin/grpcurl" ] && command -v go >/dev/null 2>&1; then
  go install github.com/fullstorydev/grpcurl/cmd/grpcurl@latest >/dev/null 2>&1 || echo "warning: grpcurl install failed; its test will skip"
fi
export PATH="$PATH:$HOME/go/bin"
exec .venv/bin/python -m pytest -q "$@"
