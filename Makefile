# Baton — developer commands. Every target does its own set-up first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.baton-installed
PROTO_SRC := $(wildcard protos/baton/v1/*.proto)

.PHONY: setup protos test test-fast lint format bench bench-engine clean

setup: $(STAMP) protos

# torch is pinned to the CPU build first: a bare `torch` requirement would pull CUDA wheels.
$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

protos: $(STAMP)
	@if [ -n "$(PROTO_SRC)" ]; then $(BIN)/python -m baton.services.protos_build; fi

# The whole suite. pytest exits 5 when it collects nothing, which fails this target.
test: setup
	$(BIN)/pytest tests

test-fast: setup
	$(BIN)/pytest tests -m "not slow"

lint: setup
	$(BIN)/ruff check services kernels tests bench
	$(BIN)/ruff format --check services kernels tests bench

format: setup
	$(BIN)/ruff check --fix services kernels tests bench
	$(BIN)/ruff format services kernels tests bench

bench: bench-engine

bench-engine: setup
	$(BIN)/python bench/engine.py

clean:
	rm -rf $(VENV) .baton build *.egg-info
