#!/usr/bin/env bash
# `make demo` (DESIGN.md §6): a two-node cluster on this host (scripts/demo_cluster.py): pods
# on both nodes through the real cilia-cni, cross-node ping, a CiliumNetworkPolicy enforced
# across nodes, the flows of both nodes through the relay, then everything torn down.
#   DEMO_NODES=N (2..8, default 2), ROUTING=native|tunnel (default native).
# DEMO_NODES=1 or KEEP=1 runs the single-node demo on the standalone stack (scripts/demo.py;
# KEEP=1 keeps that stack running). Extra arguments are passed through (--help).
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -x .venv/bin/python ]] || scripts/setup.sh
if [[ ${DEMO_NODES:-2} == 1 || ${KEEP:-0} == 1 ]]; then
  exec .venv/bin/python scripts/demo.py "$@"
fi
exec .venv/bin/python scripts/demo_cluster.py --nodes "${DEMO_NODES:-2}" --routing "${ROUTING:-native}" "$@"
