#!/usr/bin/env bash
# `make images`: one container image per service (DESIGN.md §1, "CI builds one image per
# service") plus cilia-redis for deploy/compose, built through the Docker SDK by
# scripts/images.py with the project's .venv (which holds the `docker` package):
#
#   scripts/images.sh [--base-image NAME] [--tag TAG] [--no-cache] [--quiet] [--wheels-only] [IMAGE...]
#
# Tags cilia-<service>:<version> and cilia-<service>:git-<rev12>. When the base image
# (default cilia-base:bookworm) is missing, it is built first with debootstrap + docker import
# (no registry here). Needs a running engine: scripts/setup.sh installs docker.io and starts
# dockerd. See `scripts/images.py --help` and the docstring of scripts/images.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/images.py "$@"
