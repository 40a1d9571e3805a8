# One image for the Dagster webserver, daemon and code location (the orchestration side), and
# a `gpu` target for the code location on a GPU node, where runs extract, train and evaluate.
# The three processes and Postgres: deploy/docker-compose.yaml (+ docker-compose.gpu.yaml on a
# GPU node); docs/deployment.md explains.
#   docker build -t eagle3-assets .
#   webserver:     dagster-webserver -h 0.0.0.0 -p 3000 -w deploy/workspace-grpc.yaml
#                  (publish it on the host's loopback only: -p 127.0.0.1:3000:3000)
#   daemon:        dagster-daemon run -w deploy/workspace-grpc.yaml
#   code location: dagster code-server start -h 0.0.0.0 -p 4000 -m eagle3_assets.definitions
# Pinned: the base image by tag (pin its digest in your registry: PYTHON_IMAGE=python@sha256:...),
# every Python package by deploy/constraints.txt (the whole resolved set, transitive included).
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm
FROM ${PYTHON_IMAGE} AS orchestration

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DAGSTER_HOME=/opt/dagster/home \
    EAGLE3_DATA_ROOT=/data

# A fixed numeric uid/gid, so volumes can be prepared for it on the host.
RUN groupadd --gid 10001 dagster \
    && useradd --create-home --uid 10001 --gid 10001 dagster \
    && mkdir -p /opt/dagster/home /opt/dagster/app /data \
    && chown -R 10001:10001 /opt/dagster/home /data

WORKDIR /opt/dagster/app

# Layer 1, torch: the biggest download, changes least. The CPU wheel by default (the webserver
# and daemon only import the lib); the gpu target is built with a CUDA index, e.g.
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 (docker-compose.gpu.yaml).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
COPY deploy/constraints.txt deploy/constraints.txt
RUN pip install --constraint deploy/constraints.txt --index-url "${TORCH_INDEX}" torch==2.13.0

# Layer 2, every other dependency, from pyproject.toml alone (a stub package stands in for the
# code): survives code edits.
COPY pyproject.toml README.md ./
RUN mkdir eagle3_assets && touch eagle3_assets/__init__.py \
    && pip install --constraint deploy/constraints.txt ".[postgres,k8s]" \
    && pip uninstall --yes eagle3-assets \
    && rm -rf eagle3_assets build eagle3_assets.egg-info

# Layer 3, the code: a code change rebuilds only this (seconds). Editable: the package stays
# beside pyproject.toml, where `load_from_defs_folder` looks for the project root.
COPY eagle3_assets ./eagle3_assets
COPY workspace.yaml dagster.yaml ./
COPY deploy ./deploy
RUN pip install --no-deps --constraint deploy/constraints.txt --editable .
# SQLite by default; the compose file mounts deploy/dagster-postgres.yaml over it.
COPY --chown=10001:10001 dagster.yaml /opt/dagster/home/dagster.yaml

USER 10001:10001
EXPOSE 3000 4000
CMD ["dagster-webserver", "-h", "0.0.0.0", "-p", "3000", "-w", "workspace.yaml"]

# The code location on a GPU node: the runs it starts extract, train and evaluate there, so it
# holds a CUDA torch (TORCH_INDEX) and the serving venv those steps start vLLM from, apart from
# the project's packages (vLLM pins its own torch and CUDA stack).
FROM orchestration AS gpu
USER 0:0
COPY requirements/serving-gpu.txt /opt/vllm/requirements.txt
RUN python -m venv /opt/vllm \
    && /opt/vllm/bin/pip install --no-cache-dir --requirement /opt/vllm/requirements.txt
ENV EAGLE3_PLATFORM=cuda \
    EAGLE3_SERVING_PYTHON=/opt/vllm/bin/python
USER 10001:10001

# The default target (the last stage): the orchestration image, CPU torch; what CI checks.
FROM orchestration
