#!/usr/bin/env bash
# `make demo` (DESIGN.md §6): start the standalone stack, create pods as network namespaces
# through the real cilia-cni binary, ping them, list endpoints, delete them, tear down
# (KEEP=1 keeps the stack running). The steps live in scripts/demo.py; extra arguments are
# passed through (scripts/demo.sh --help).
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -x .venv/bin/python ]] || scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
