# Two commands for a newcomer on a fresh Debian/Ubuntu machine (as root):
#   make demo   - virtualenv, sandbox rig, deploy, then the endpoint and a real question answered
#   make test   - everything the tests need, then lint, the unit tests and one sandbox scenario
#   make test-all - the same, then every sandbox scenario (what CI runs)
#   make test-soak - the scenarios under sustained load for minutes, by themselves
VENV ?= .venv
PYTHON ?= python3
BIN = $(VENV)/bin
INSTALLED = $(VENV)/.installed

.PHONY: demo test test-all test-soak test-fast lint clean-sandbox

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

demo: $(INSTALLED)
	$(BIN)/llamarig sandbox up
	RIG_INVENTORY=inventory/hosts.yml $(BIN)/pyinfra -y inventory.py deploy.py
	RIG_INVENTORY=inventory/hosts.yml $(BIN)/llamarig complete --chat --tokens 32 \
		--prompt "What is the capital of France? Answer in one word."

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test-fast: $(INSTALLED) lint
	$(BIN)/pytest -m "not sandbox" -n auto -rs

test: $(INSTALLED) lint
	scripts/test_tiers.sh quick $(BIN)

test-all: $(INSTALLED) lint
	scripts/test_tiers.sh all $(BIN)

test-soak: $(INSTALLED)
	scripts/test_tiers.sh soak $(BIN)

clean-sandbox: $(INSTALLED)
	$(BIN)/llamarig sandbox down
