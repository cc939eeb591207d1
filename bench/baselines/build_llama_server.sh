#!/usr/bin/env bash
# Build llama.cpp's C++ llama-server from the source vendored in the llama-cpp-python sdist
# (the only llama.cpp source the package registries carry), once, outside the repository.
#
#   bench/baselines/build_llama_server.sh [CACHE_DIR]   # default ~/.cache/ringserve
#
# Prints the binary's path. About 20 minutes on one core; later calls return at once.
# Run the binary with --no-repack: on these CPUs its AMX int8 repack path dies with SIGILL.
set -euo pipefail
VERSION=0.3.36
CACHE_DIR=${1:-${RINGSERVE_CACHE_DIR:-$HOME/.cache/ringserve}}
ROOT=$CACHE_DIR/llama-cpp
BIN=$ROOT/build-$VERSION/bin/llama-server
JOBS=${JOBS:-1}
if [[ -x $BIN ]]; then echo "$BIN"; exit 0; fi
PIP=${PIP:-pip}
mkdir -p "$ROOT"
cd "$ROOT"
[[ -f llama_cpp_python-$VERSION.tar.gz ]] ||
  "$PIP" download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d . >&2
rm -rf "src-$VERSION" && mkdir "src-$VERSION"
tar -xzf "llama_cpp_python-$VERSION.tar.gz" -C "src-$VERSION" --strip-components=1
cmake -S "src-$VERSION/vendor/llama.cpp" -B "build-$VERSION" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "build-$VERSION" --target llama-server -j "$JOBS" >&2
echo "$BIN"
