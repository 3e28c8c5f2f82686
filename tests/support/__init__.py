"""Shared test helpers: test modules import these, never each other (tests/test_architecture.py).

Modules, one concept each:

- ``poll``: ``eventually``, the one wait-until helper
- ``services``: in-process services (``ServerThread``, ``make_config``) and service processes
  (``ServiceProc``, ``MeteredService``, the fault-injecting ``faulty_service.py``)
- ``fixtures``: the end-to-end fixtures (``pair``, ``make_pool``, ``make_client``) a conftest imports
- ``pools``: shm pool bytes (random fills, snapshots, page and head-slice checks)
- ``transfers``: linked engines across a pair, statuses until terminal, staging left idle
- ``engines``: engine processes driven over a pipe; ``peers``: services that authenticate peers
- ``pki``: a test CA and its leaves (mutual TLS)
- ``regions``: torch KV regions for route tests; ``lane``: the native lane's engines
- ``gpu``: VRAM engine processes and service processes for GPU tests
- ``kv_events``, ``engine_schemas``, ``vllm_engine``: KV-event publishers, schemas, a real vLLM
- ``engine_pools``, ``sglang_stub``, ``sglang_pools``, ``vllm_pair``: engine adapters' harnesses
- ``index``, ``integrity_procs``, ``metrics_workload``, ``tcp_proxy``, ``grpcurl``: the rest
"""
