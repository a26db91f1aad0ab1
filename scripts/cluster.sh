#!/usr/bin/env bash
# A multi-node Cilia cluster on this host (issue 11): each node a network namespace with its own
# cilia-agent on a LAN bridge (198.18.<slot>.0/24), redis + operator + relay in the host netns.
#
#   scripts/cluster.sh up     [--nodes N] [--routing native|tunnel] [--timeout S]   start, print how to reach each node
#   scripts/cluster.sh down   [--stop-timeout S]                                    stop, delete its namespaces and LAN
#   scripts/cluster.sh status                                                       print how to reach each node
#
# `make cluster-up NODES=3 ROUTING=tunnel` / `make cluster-down` call it. The cluster is held by a
# supervisor process (cilia_testkit.clusterctl; pid and log under .run/cluster/) that stops it
# on SIGTERM; the components are started by the test kit's Cluster, the same code the e2e tests use.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]] || ! .venv/bin/python -c 'import cilia_testkit' 2>/dev/null; then
  echo "[cluster] .venv or its cilia_testkit missing: run scripts/setup.sh (make setup)" >&2
  exit 1
fi
exec .venv/bin/python -m cilia_testkit.clusterctl "$@"
