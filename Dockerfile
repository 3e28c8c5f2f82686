# syntax=docker/dockerfile:1
# Multi-stage build of kvservice from this repository; runs as a non-root user.
# GPU nodes: build FROM a CUDA runtime image instead (ARG BASE) and run with --ipc=host --gpus all.
ARG BASE=python:3.12-slim

FROM ${BASE} AS build
WORKDIR /src
COPY clients/python clients/python
COPY pyproject.toml README.md ./
COPY kvservice kvservice
RUN python -m venv /opt/kvservice \
 && /opt/kvservice/bin/pip install --no-cache-dir ./clients/python . \
 && /opt/kvservice/bin/kvservice --help >/dev/null

FROM ${BASE}
RUN groupadd --system kvservice && useradd --system --gid kvservice --home /var/lib/kvservice kvservice \
 && mkdir -p /run/kvservice && chown kvservice:kvservice /run/kvservice
COPY --from=build /opt/kvservice /opt/kvservice
ENV PATH=/opt/kvservice/bin:$PATH \
    KVSERVICE_UDS_PATH=/run/kvservice/kvservice.sock \
    KVSERVICE_TCP_ADDRESS=0.0.0.0:50051 \
    KVSERVICE_METRICS_PORT=9400
USER kvservice
EXPOSE 50051 9400
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["kvservice", "health", "--address", "unix:/run/kvservice/kvservice.sock"]
ENTRYPOINT ["kvservice", "serve"]
