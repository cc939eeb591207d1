#!/usr/bin/env bash
# Print the base image the build should use: DEFAULT when the Docker engine has it or can pull
# it (or when no engine answers: the build then says so itself), else LOCAL, the base that
# deploy/docker/local-base.sh makes from Debian packages. Changes nothing but a pulled image.
#   deploy/docker/base_image.sh DEFAULT LOCAL
set -uo pipefail
default=${1:?usage: base_image.sh DEFAULT LOCAL}
local=${2:?usage: base_image.sh DEFAULT LOCAL}
docker=${DOCKER:-docker}
if ! $docker info >/dev/null 2>&1 || $docker image inspect "$default" >/dev/null 2>&1 \
        || timeout 300 $docker pull -q "$default" >/dev/null 2>&1; then
    echo "$default"
else
    echo "$local"
fi
