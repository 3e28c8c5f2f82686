# syntax=docker/dockerfile:1
# SGLang's own GPU image (0.5.23) with kvservice's transfer backend added. SGLang has no plug-in
# hook for transfer backends, so the image's command is kvservice_sglang's launcher, which
# registers the backend and runs SGLang's own server with the same arguments:
#
#   docker build -f deploy/engines/sglang.Dockerfile -t kvservice-sglang:gpu .
#   docker run ... kvservice-sglang:gpu --model-path /models/m --disaggregation-mode prefill \
#       --disaggregation-transfer-backend kvservice
ARG BASE=lmsysorg/sglang:v0.5.23
FROM ${BASE}
COPY clients/python /src/clients/python
COPY clients/sglang /src/clients/sglang
RUN pip install --no-cache-dir /src/clients/python /src/clients/sglang && rm -rf /src
ENV SGLANG_KVSERVICE_ADDRESS=unix:/run/kvservice/kvservice.sock
ENTRYPOINT ["python", "-m", "kvservice_sglang.launch_server"]
