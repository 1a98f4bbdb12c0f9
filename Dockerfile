# syntax=docker/dockerfile:1
# lightspan in one image: collector, rollout runner, transition builder, trainer, gateway, CLI.
#
#   docker build -t lightspan .                                        # CPU torch (the default)
#   docker build -t lightspan:cu128 --build-arg TORCH_VARIANT=cu128 .  # CUDA torch, for the trainer
#
# vLLM is not in this image: it runs from the official vllm/vllm-openai image (docker-compose.yml),
# and lightspan only talks to it over HTTP.
FROM python:3.11-slim

# torch comes first, from PyTorch's own wheel index: PyPI's Linux wheel is the CUDA build
# (gigabytes), which the collector, the agents and the transition builder never use.
# TORCH_VARIANT is the index's directory: cpu, or a CUDA build such as cu126 or cu128.
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LIGHTSPAN_DATA_DIR=/data \
    HF_HUB_OFFLINE=1

WORKDIR /app
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# the package (pyproject's package-dir maps these folders into the one `lightspan` namespace);
# `torch==2.13.0` in its dependencies is satisfied by the local build installed above
COPY pyproject.toml README.md ./
COPY lightspan/ lightspan/
COPY collector/ collector/
COPY store/ store/
COPY tracing/ tracing/
COPY rollout/ rollout/
COPY lightningrl/ lightningrl/
COPY trainer/ trainer/
COPY dashboards/ dashboards/
RUN pip install ".[full]" && lightspan --help > /dev/null

# the example agents (`lightspan rollout -- python /app/examples/math_agent.py`) and the loop for
# jobs without a schedule of their own
COPY examples/ examples/
COPY deploy/compose/every.sh /usr/local/bin/every

# not root: the data directory and the model directory belong to an unprivileged user (a new
# named volume mounted there takes this ownership)
RUN useradd --create-home --uid 10001 lightspan \
    && mkdir -p /data /models \
    && chown lightspan:lightspan /data /models
USER lightspan
VOLUME ["/data"]
# OTLP gRPC, OTLP HTTP, the collector's API, the trainer's Prometheus metrics
EXPOSE 4317 4318 8321 9464
# no HEALTHCHECK here: one image runs several jobs, each with its own check (docker-compose.yml)
CMD ["lightspan", "--help"]
