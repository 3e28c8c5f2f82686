# syntax=docker/dockerfile:1
# vLLM's own GPU image (0.32) with kvservice's connector added; the engine registers its KV cache
# with the kvservice sidecar through CUDA IPC (same pod/IPC namespace, deploy/k8s/vllm-sidecar-example.yaml).
#
#   docker build -f deploy/engines/vllm.Dockerfile -t kvservice-vllm:gpu .
ARG BASE=vllm/vllm-openai:v0.32.0
FROM ${BASE}
COPY clients/python /src/clients/python
COPY clients/vllm /src/clients/vllm
RUN pip install --no-cache-dir /src/clients/python /src/clients/vllm && rm -rf /src
