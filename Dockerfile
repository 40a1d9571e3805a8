# One image for the Dagster webserver, daemon and code location (the orchestration side).
# vLLM is NOT in here: it keeps its own image/venv on the GPU node (requirements/serving-*.txt).
#   docker build -t eagle3-assets .
#   webserver:     docker run -p 127.0.0.1:3000:3000 eagle3-assets dagster-webserver -h 0.0.0.0 -p 3000 -w workspace.yaml
#   daemon:        docker run eagle3-assets dagster-daemon run -w workspace.yaml
#   code location: docker run eagle3-assets dagster code-server start -h 0.0.0.0 -p 4000 -m eagle3_assets.definitions
FROM python:3.11.7-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DAGSTER_HOME=/opt/dagster/home

RUN useradd --create-home --uid 10001 dagster \
    && mkdir -p /opt/dagster/home /opt/dagster/app /data \
    && chown -R dagster:dagster /opt/dagster /data

WORKDIR /opt/dagster/app

# Dependencies first (a layer that survives code edits). Training runs on the GPU node's
# own torch; this image needs torch only to import the lib, so take the CPU wheel.
COPY pyproject.toml README.md ./
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && mkdir eagle3_assets && touch eagle3_assets/__init__.py \
    && pip install . && pip uninstall --yes eagle3-assets && rm -rf eagle3_assets build

# Then the code: a code change rebuilds only this layer.
COPY eagle3_assets ./eagle3_assets
COPY workspace.yaml dagster.yaml ./
RUN pip install --no-deps . && cp dagster.yaml "$DAGSTER_HOME/dagster.yaml"

USER dagster
EXPOSE 3000 4000
CMD ["dagster-webserver", "-h", "0.0.0.0", "-p", "3000", "-w", "workspace.yaml"]
