# syntax=docker/dockerfile:1
# kvservice images, two variants from one file (multi-stage; the final stages hold no compilers,
# pip caches or sources):
#
#   CPU (default):  docker build --target cpu -t kvservice:cpu .
#     torch is Debian's CPU build (python3-torch), so no CUDA library is in the image; NIXL moves
#     DRAM over UCX. For CPU nodes, CI and demos.
#   GPU:            docker build --target gpu --build-arg GPU_BASE=<image with python3> -t kvservice:gpu .
#     torch, triton and NIXL from PyPI (torch's wheels carry the CUDA user-space libraries, so no
#     CUDA runtime base is needed; the driver comes from the host through the NVIDIA container
#     runtime). NIXL loads the flavour of torch's CUDA major (13), so nixl-cu12 is removed, and
#     so are NIXL's expert-parallel libraries that nothing here loads.
#
# Both run as uid 10001 (or any uid with gid 0: installed files are world-readable, nothing is written
# under /opt), with a read-only root filesystem: only the socket dir (/run/kvservice) and /tmp must
# be writable. JIT caches (numba; Triton on GPU) go to $KVSERVICE_CACHE_DIR (under /tmp unless a
# volume is mounted there), never into site-packages. The native lane's C++ module is built at image
# build time into $KVSERVICE_NATIVE_DIR, so no compiler is needed (or shipped) at run time.
# scripts/image-smoke.sh proves all of it.
ARG BASE=debian:trixie-slim
ARG GPU_BASE=${BASE}

# ---- CPU ------------------------------------------------------------------------------------
FROM ${BASE} AS cpu-runtime-base
# NOTE: Debian's torch depends on Open MPI, whose accelerator plugins pull the ROCm runtime and
# LLVM 17 (~210 MB). Nothing in torch's or our load path links them and the service never
# initialises MPI, so they are removed (dpkg --force-depends keeps the package database honest).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-torch ca-certificates \
 && dpkg --purge --force-depends libamdhip64-5 libamd-comgr2 libllvm17t64 libhsa-runtime64-1 \
                                 libhsakmt1 libdrm-amdgpu1 \
 && python3 -c "import torch; torch.zeros(1)" \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/apt /var/log/dpkg.log \
           /usr/share/doc /usr/share/man /usr/share/info /usr/share/locale

FROM cpu-runtime-base AS cpu-build
# Optional CA bundle for pip behind a TLS-inspecting proxy (mounted at build time, not kept).
ARG PIP_CERT
WORKDIR /src
COPY clients/python clients/python
COPY pyproject.toml README.md ./
COPY kvservice kvservice
# NOTE: --system-site-packages so Debian's CPU torch satisfies the torch requirement (PyPI's x86_64
# torch wheels are CUDA builds that pull ~3 GB of CUDA libraries). nixl's meta package depends
# on both CUDA flavours; without CUDA it loads nixl_cu13, so nixl-cu12 is removed, and so is the
# expert-parallel library nixl_ep_cu13 (92 MB) that nothing here loads. Debian's torch metadata pins
# an older sympy, which pip duplicates into the venv; torch runs with Debian's, so it goes too.
# The native lane (kvservice/transfer/lane) is built here, into /opt/kvservice/native: the runtime image has
# no compiler and imports the built module (KVSERVICE_NATIVE_DIR), read-only, as any uid. Its
# build needs g++ and the headers of Python and pybind11: Debian's python3-torch ships no pybind11,
# and its torch/include links point into libtorch-dev, which is not needed (the module includes
# none of torch's headers; torch/lib's links resolve, so torch's link flags work). apt's database
# is broken on purpose above (the purged ROCm/LLVM libraries), so apt refuses any install until
# --fix-broken puts them back: here only, in a stage that is not shipped.
RUN apt-get update \
 && apt-get install -y --fix-broken --no-install-recommends \
 && apt-get install -y --no-install-recommends g++ python3-dev pybind11-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv --system-site-packages /opt/kvservice \
 && /opt/kvservice/bin/pip install --no-cache-dir ./clients/python . \
 && KVSERVICE_NATIVE_DIR=/opt/kvservice/native /opt/kvservice/bin/python -m kvservice.transfer.lane.native \
 && KVSERVICE_NATIVE_DIR=/opt/kvservice/native /opt/kvservice/bin/python -c 'import kvservice.buffers.guard as g; g.main()' \
 && find /opt/kvservice/native -type f ! -name 'kvservice_lane*.so' ! -name 'kvservice_guard*.so' -delete \
 && /opt/kvservice/bin/pip uninstall -y nixl-cu12 sympy pip \
 && rm -rf /opt/kvservice/lib/python3*/site-packages/nixl_ep_cu13 \
 && /opt/kvservice/bin/kvservice --help >/dev/null

FROM cpu-runtime-base AS cpu
COPY --from=cpu-build /opt/kvservice /opt/kvservice
COPY --chmod=0755 deploy/compose/engine.py /opt/engine/engine.py
# NOTE: one UCX per process. Debian's torch links libmpi, which links Debian's UCX; NIXL bundles its
# own UCX. Two copies in one process abort at load ("Assertion !ucs_debug_initialized"). So the
# system UCX sonames point at NIXL's copies (glibc then maps each file once), the loader finds
# NIXL's private libraries, and UCX loads its transports from NIXL's module dir, never Debian's.
RUN ln -s "$(echo /opt/kvservice/lib/python3*/site-packages/nixl_cu13.libs)" /opt/kvservice/nixl-libs \
 && echo /opt/kvservice/nixl-libs > /etc/ld.so.conf.d/kvservice-nixl-ucx.conf \
 && cd /usr/lib/x86_64-linux-gnu && rm -rf ucx libucs.so.0* libucp.so.0* libuct.so.0* libucm.so.0* \
 && for l in ucs ucp uct ucm; do ln -s /opt/kvservice/nixl-libs/lib$l-*.so.0.0.0 lib$l.so.0; done \
 && ldconfig \
 && UCX_MODULE_DIR=/opt/kvservice/nixl-libs/ucx /opt/kvservice/bin/python -c "import torch, nixl; print('torch', torch.__version__, 'and nixl load')"
RUN useradd --system --uid 10001 --gid 0 --home-dir /tmp --no-create-home kvservice \
 && mkdir -p /run/kvservice && chown 10001:0 /run/kvservice && chmod 0770 /run/kvservice
ENV PATH=/opt/kvservice/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    UCX_MODULE_DIR=/opt/kvservice/nixl-libs/ucx \
    KVSERVICE_CACHE_DIR=/tmp/kvservice-cache \
    KVSERVICE_NATIVE_DIR=/opt/kvservice/native \
    KVSERVICE_UDS_PATH=/run/kvservice/kvservice.sock \
    KVSERVICE_METRICS_PORT=9400
USER 10001
EXPOSE 50052 9400
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["kvservice", "health", "--address", "unix:/run/kvservice/kvservice.sock"]
ENTRYPOINT ["kvservice", "serve"]

# ---- GPU ------------------------------------------------------------------------------------
FROM ${GPU_BASE} AS gpu-runtime-base
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/apt /var/log/dpkg.log

FROM gpu-runtime-base AS gpu-build
ARG PIP_CERT
WORKDIR /src
COPY clients/python clients/python
COPY pyproject.toml README.md ./
COPY kvservice kvservice
RUN apt-get update && apt-get install -y --no-install-recommends g++ python3-dev && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/kvservice \
 && /opt/kvservice/bin/pip install --no-cache-dir ./clients/python ".[gpu]" \
 && KVSERVICE_NATIVE_DIR=/opt/kvservice/native /opt/kvservice/bin/python -m kvservice.transfer.lane.native \
 && KVSERVICE_NATIVE_DIR=/opt/kvservice/native /opt/kvservice/bin/python -c 'import kvservice.buffers.guard as g; g.main()' \
 && find /opt/kvservice/native -type f ! -name 'kvservice_lane*.so' ! -name 'kvservice_guard*.so' -delete \
 && /opt/kvservice/bin/pip uninstall -y nixl-cu12 pip \
 && rm -rf /opt/kvservice/lib/python3*/site-packages/nixl_ep_cu1? \
 && /opt/kvservice/bin/kvservice --help >/dev/null

FROM gpu-runtime-base AS gpu
COPY --from=gpu-build /opt/kvservice /opt/kvservice
RUN useradd --system --uid 10001 --gid 0 --home-dir /tmp --no-create-home kvservice \
 && mkdir -p /run/kvservice && chown 10001:0 /run/kvservice && chmod 0770 /run/kvservice
ENV PATH=/opt/kvservice/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    KVSERVICE_CACHE_DIR=/tmp/kvservice-cache \
    KVSERVICE_NATIVE_DIR=/opt/kvservice/native \
    KVSERVICE_UDS_PATH=/run/kvservice/kvservice.sock \
    KVSERVICE_METRICS_PORT=9400
USER 10001
EXPOSE 50052 9400
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["kvservice", "health", "--address", "unix:/run/kvservice/kvservice.sock"]
ENTRYPOINT ["kvservice", "serve"]

# The default target (a plain `docker build .`) is the CPU image.
FROM cpu
