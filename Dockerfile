# syntax=docker/dockerfile:1
#
# Images of the hybrid search server. Three runtime targets; `cpu` is the default (last) stage.
#
#   docker build --target cpu   -t hybrid-search:cpu   .   # serve (default), router, index-builder
#   docker build --target cuda  -t hybrid-search:cuda  .   # the same on NVIDIA GPUs (.[gpu])
#   docker build --target shard -t hybrid-search:shard .   # `search-server shard` only (slim)
#
# Packages come from the default package registry, or from whatever index your own pip
# configuration names: hand that file to the build as a secret (mounted at /etc/pip.conf for the
# pip steps only, never stored in a layer or in the image history):
#
#   docker build --secret id=pipconf,src=path/to/pip.conf --target cpu -t hybrid-search:cpu .
#
# Every image: non-root user 10001, the gRPC port on every interface (SEARCH_HOST=0.0.0.0, so a
# shard server refuses to start without --shard-token-file or mutual TLS), Prometheus metrics on
# 9100, builds read from /data, state written under /state (the default commands pass
# `--state-dir /state`: mount a writable volume there, and pass it too in a command of your own;
# /data may be read-only), models only from the image (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE) and
# a HEALTHCHECK that runs `search-server health` (exit 0 only when the server answers SERVING;
# a shard answers NOT_SERVING until it has caught up on the write log). Every default is a
# SEARCH_* environment variable (server/config.py), so `-e SEARCH_PORT=...` moves the port and
# the health check with it.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# PyPI's CUDA wheels bring their own CUDA user-space libraries: torch 2.13.0 is a CUDA 13.0 build,
# faiss-gpu-cu12 pulls CUDA 12.x libraries. The host driver must support CUDA 13.0 (R580 or
# newer); a CUDA 13.0 base image makes the NVIDIA container runtime refuse older drivers up front.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
# torch for the cpu and cuda targets. The same release scripts/setup.sh installs.
ARG TORCH_VERSION=2.13.0

# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime-base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME=/tmp/huggingface XDG_CACHE_HOME=/tmp/cache \
    SEARCH_HOST=0.0.0.0 SEARCH_DATA_DIR=/data SEARCH_METRICS_PORT=9100
RUN groupadd --gid 10001 search \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/search \
            --shell /usr/sbin/nologin search \
 && mkdir -p /data /state \
 && chown 10001:10001 /state
WORKDIR /home/search

FROM ${PYTHON_IMAGE} AS venv-base
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src

# ---------------------------------------------------------------------------------------------
# shard: `search-server shard` and nothing else. The shard server never imports torch,
# transformers or onnxruntime, so the image holds only its runtime packages
# (deploy/requirements-shard.txt) and the project installed with --no-deps.
# ---------------------------------------------------------------------------------------------
FROM venv-base AS build-shard
COPY deploy/requirements-shard.txt /tmp/requirements-shard.txt
RUN --mount=type=secret,id=pipconf,target=/etc/pip.conf,required=false \
    --mount=type=cache,target=/root/.cache/pip \
    pip install -r /tmp/requirements-shard.txt
COPY pyproject.toml README.md ./
COPY server ./server
COPY index_builder ./index_builder
RUN --mount=type=secret,id=pipconf,target=/etc/pip.conf,required=false \
    --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps . \
 && search-server shard --help > /dev/null \
 && python -c "import sys, server.transport.shard_server, server.replication.log; \
bad = sorted({'torch', 'transformers', 'onnxruntime'} & set(sys.modules)); \
sys.exit('the shard role imports ' + ', '.join(bad) if bad else 0)"

FROM runtime-base AS shard
COPY --from=build-shard /opt/venv /opt/venv
USER 10001:10001
EXPOSE 50061 9100
# start period: loading a large build and catching up on the write log both count as "starting";
# the port comes from SEARCH_PORT (not --port), and a TLS shard needs a check with --tls-ca
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD search-server health --address "127.0.0.1:${SEARCH_PORT:-50061}" --timeout 4 || exit 1
ENTRYPOINT ["search-server"]
# e.g. shard --collection docs --shard 0 --data-dir /data --state-dir /state \
#        --shard-token-file /run/secrets/shard-token --nats nats://nats:4222 --replica-id shard-0a
CMD ["shard"]

# ---------------------------------------------------------------------------------------------
# cuda: everything (serve / router / shard / index-builder) on NVIDIA GPUs: faiss-gpu-cu12,
# onnxruntime-gpu and PyPI's torch (a CUDA build) from the project's `gpu` extra.
# ---------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS cuda-base
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME=/tmp/huggingface XDG_CACHE_HOME=/tmp/cache \
    SEARCH_HOST=0.0.0.0 SEARCH_DATA_DIR=/data SEARCH_METRICS_PORT=9100
RUN groupadd --gid 10001 search \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/search \
            --shell /usr/sbin/nologin search \
 && mkdir -p /data /state \
 && chown 10001:10001 /state
WORKDIR /home/search

FROM cuda-base AS build-cuda
ARG TORCH_VERSION
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY server ./server
COPY index_builder ./index_builder
# The base dependencies name faiss-cpu and onnxruntime, and the gpu extra adds faiss-gpu-cu12 and
# onnxruntime-gpu: each pair installs the same Python package (faiss, onnxruntime), so whichever
# landed last would win. Remove the CPU pair, then reinstall the GPU pair's files (same versions).
RUN --mount=type=secret,id=pipconf,target=/etc/pip.conf,required=false \
    --mount=type=cache,target=/root/.cache/pip \
    pip install "torch==${TORCH_VERSION}" ".[gpu]" \
 && pip uninstall -y faiss-cpu onnxruntime \
 && pip install --no-deps --force-reinstall \
        "faiss-gpu-cu12==$(pip show faiss-gpu-cu12 | sed -n 's/^Version: //p')" \
        "onnxruntime-gpu==$(pip show onnxruntime-gpu | sed -n 's/^Version: //p')" \
 && search-server --help > /dev/null \
 && python -c "import faiss, onnxruntime, torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"

FROM cuda-base AS cuda
COPY --from=build-cuda /opt/venv /opt/venv
USER 10001:10001
EXPOSE 50051 50061 9100
# Docker's health check reads the port from SEARCH_PORT: run a shard or a server on another port
# with SEARCH_PORT=... rather than --port (Kubernetes ignores HEALTHCHECK: its probes name the
# port). A server with --tls-cert needs a check of its own that passes --tls-ca.
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD search-server health --address "127.0.0.1:${SEARCH_PORT:-50051}" --timeout 4 || exit 1
ENTRYPOINT ["search-server"]
CMD ["serve", "--data-dir", "/data", "--state-dir", "/state", "--device", "cuda"]

# ---------------------------------------------------------------------------------------------
# cpu (default): serve, router and index-builder on CPU.
#
# torch and image size: on PyPI, torch for Linux x86_64 is a CUDA build (2.13.0: CUDA 13.0) that
# pulls the nvidia-* CUDA libraries, never used on a CPU host; the CPU-only build (`+cpu` local
# version) is published only on the PyTorch project's own wheel index. Measured as virtual
# environments with this target's two pip steps (a proxy for the image, not the image): 5.4 GB
# with PyPI's torch, 1.7 GB with the +cpu wheel (the shard target: 0.2 GB). This file names no
# index, so:
#   * by default this target installs PyPI's torch: it works on CPU, but the image is ~3.7 GB
#     larger than it needs to be (and every node pulls that);
#   * to get the small image, pass a pip configuration that adds an index carrying the CPU wheels
#     (the pipconf secret above): "torch==${TORCH_VERSION}" then resolves to
#     "${TORCH_VERSION}+cpu", because a local version sorts above the plain release.
# The build prints which one it installed ("CUDA None" = the CPU-only build).
# ---------------------------------------------------------------------------------------------
FROM venv-base AS build-cpu
ARG TORCH_VERSION
RUN --mount=type=secret,id=pipconf,target=/etc/pip.conf,required=false \
    --mount=type=cache,target=/root/.cache/pip \
    pip install "torch==${TORCH_VERSION}" \
 && python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
COPY pyproject.toml README.md ./
COPY server ./server
COPY index_builder ./index_builder
# torch is already there, so the project's own `torch>=2.2` is met and not reinstalled
RUN --mount=type=secret,id=pipconf,target=/etc/pip.conf,required=false \
    --mount=type=cache,target=/root/.cache/pip \
    pip install . \
 && search-server --help > /dev/null && index-builder --help > /dev/null

FROM runtime-base AS cpu
COPY --from=build-cpu /opt/venv /opt/venv
USER 10001:10001
EXPOSE 50051 50061 9100
# Docker's health check reads the port from SEARCH_PORT: run a shard or a server on another port
# with SEARCH_PORT=... rather than --port (Kubernetes ignores HEALTHCHECK: its probes name the
# port). A server with --tls-cert needs a check of its own that passes --tls-ca.
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD search-server health --address "127.0.0.1:${SEARCH_PORT:-50051}" --timeout 4 || exit 1
ENTRYPOINT ["search-server"]
# The embedded default over every published collection in /data (state in /state).
# Router: router --collection docs --replicas a:50061,b:50061 --replicas c:50061,d:50061 \
#                --shard-token-file /run/secrets/shard-token --nats nats://nats:4222
# Builder: --entrypoint index-builder ... build --data-dir /data --collection docs --corpus ...
CMD ["serve", "--data-dir", "/data", "--state-dir", "/state"]
