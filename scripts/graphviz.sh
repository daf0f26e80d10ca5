#!/usr/bin/env bash
# Graphviz's dot from Debian's package, for the docs' lifecycle diagram (docs/lifecycle.md,
# drawn from celery_leases/states.py at each build): installed when missing. Runs as root
# (CI, the dev box).
set -euo pipefail
if command -v dot >/dev/null; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q graphviz || { apt-get update -q && apt-get install -y -q graphviz; }
