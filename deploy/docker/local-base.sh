#!/usr/bin/env bash
# Make a Python base image from Debian's packages, for machines that reach no image registry:
#   deploy/docker/local-base.sh TAG
# debootstrap (minbase, Debian bookworm: Python 3.11, the version of the public default base)
# with python3, pip and venv, a `python` link, this machine's CA bundle, and a pip.conf that
# keeps this machine's package indexes (http(s) only: a local folder is not in the image), so
# that pip inside a build reaches the registries the way pip here does. An existing TAG is
# reused as is (delete it to rebuild). Needs root, debootstrap and a running Docker engine.
set -euo pipefail
tag=${1:?usage: local-base.sh TAG}
suite=${DEBIAN_SUITE:-bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "local-base: $tag exists, reused"
    exit 0
fi
if ! command -v debootstrap >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive NEEDRESTART_SUSPEND=1
    apt-get install -y -q debootstrap >/dev/null \
        || { apt-get update -q >/dev/null && apt-get install -y -q debootstrap >/dev/null; }
fi
root=$(mktemp -d /tmp/ringserve-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
start=$(date +%s)
debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
    "$suite" "$root" "$mirror" >"$root.log" 2>&1 || { tail -20 "$root.log"; exit 1; }
rm -f "$root.log"
ln -sf python3 "$root/usr/bin/python"
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
# pip's settings as `pip config list` shows them here, less what names a path of this machine.
python3 - "$root/etc/pip.conf" <<'PY'
import subprocess, sys
keep = {"index-url", "extra-index-url", "trusted-host", "timeout", "default-timeout", "retries"}
lines = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
out = ["[global]", "cert = /etc/ssl/certs/ca-certificates.crt"]
seen = set()
for line in lines.splitlines():
    key, _, value = line.partition("=")
    name = key.rsplit(".", 1)[-1]
    name = "timeout" if name == "default-timeout" else name  # the environment's name for it
    value = value.strip().strip("'\"")
    if name in keep and name not in seen:
        urls = [v for v in value.split() if not v.startswith("file:")] if "url" in name else [value]
        if urls:
            seen.add(name)
            out.append(f"{name} = {' '.join(urls)}")
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PY
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import -c 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' -c 'ENV LANG=C.UTF-8' - "$tag" >/dev/null
echo "local-base: built $tag from Debian $suite in $(( $(date +%s) - start )) s"
