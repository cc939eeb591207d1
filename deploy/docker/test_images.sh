#!/usr/bin/env bash
# make test-images: build the CPU images and test them as containers (deploy/docker/tests).
#  1. A Docker engine: the one that answers, else dockerd started here (docker.io installed
#     first when missing; root) and stopped again at the end, pass or fail.
#  2. `make images` with --network host: the public base image, or where it cannot be pulled a
#     base made from Debian packages (cached by its tag); the scheduler's torch from pip's local
#     wheel folder; the layer cache of earlier runs reused.
#  3. pytest deploy/docker/tests: prepare the model into a volume, start the four containers on
#     host networking, check them; the containers and the volume are removed at the end.
# Prints each image's size and the timings. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
DOCKER=${DOCKER:-docker}
export DOCKER
started=""
log=$(mktemp /tmp/ringserve-dockerd.XXXXXX.log)
t0=$(date +%s)
phase() { echo "test-images: $1 $(( $(date +%s) - t0 )) s"; }
# apt-get install, after an apt-get update when the package lists do not have the package.
apt_install() {
    export DEBIAN_FRONTEND=noninteractive NEEDRESTART_SUSPEND=1
    apt-get install -y -q "$@" >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q "$@" >/dev/null; }
}

stop_engine() {
    if [ -n "$started" ]; then
        kill "$started" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 "$started" 2>/dev/null || break; sleep 0.5; done
        echo "test-images: stopped the dockerd started here"
    fi
    rm -f "$log"
}
trap stop_engine EXIT

if ! $DOCKER info >/dev/null 2>&1; then
    if ! command -v dockerd >/dev/null; then
        apt_install docker.io
    fi
    dockerd >"$log" 2>&1 &
    started=$!
    for _ in $(seq 60); do $DOCKER info >/dev/null 2>&1 && break; sleep 0.5; done
    $DOCKER info >/dev/null 2>&1 || { tail -20 "$log"; echo "test-images: dockerd did not start"; exit 1; }
    phase "engine started (dockerd $started):"
fi

build_log=${TMPDIR:-/tmp}/ringserve-test-images-build.log
if ! make --no-print-directory images IMAGE_BUILD_ARGS="--network host" REGISTRY="$REGISTRY" TAG="$TAG" \
        >"$build_log" 2>&1; then
    tail -40 "$build_log"
    echo "test-images: make images failed (the whole log: $build_log)"
    exit 1
fi
grep '^local-base:' "$build_log" || true
phase "images built (log: $build_log):"
for image in ringserve-gateway:$TAG ringserve-tokenizer:$TAG ringserve-detokenizer:$TAG ringserve-scheduler:$TAG-cpu; do
    size=$($DOCKER image inspect -f '{{.Size}}' "$REGISTRY/$image")
    echo "test-images: image $REGISTRY/$image $(( size / 1000000 )) MB"
done

REGISTRY="$REGISTRY" TAG="$TAG" "$PY" -m pytest -q -s -p no:cacheprovider deploy/docker/tests "$@"
phase "done:"
