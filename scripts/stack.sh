#!/usr/bin/env bash
# The local standalone stack (DESIGN.md §6): Redis, cilia-operator, one cilia-agent, cilia-relay,
# started in the background with pids, logs, sockets and state under .run/.
#
#   scripts/stack.sh up     [--fresh] [--timeout S] [COMPONENT...]   start (idempotent), wait until ready
#   scripts/stack.sh down   [--stop-timeout S] [COMPONENT...]        stop (idempotent)
#   scripts/stack.sh status                                          what runs, is the agent ready
#   scripts/stack.sh purge                                           down, delete leftover demo/e2e/bench/test-kit/cluster
#                                                                    netns whose owner process is gone (a running test's,
#                                                                    demo's or cluster's are kept: "kept netns X: ..."), rm .run
#
# COMPONENT: redis operator agent relay (default: all; started in that order, stopped in reverse).
#
# Options (each also settable by environment):
#   --timeout S        CILIA_STACK_TIMEOUT (90)       seconds `up` waits for each component to be ready;
#                                                     the agent is ready when it wrote
#                                                     .run/cni/net.d/05-cilia.conflist
#   --stop-timeout S   CILIA_STACK_STOP_TIMEOUT (10)  seconds `down` waits after SIGTERM before SIGKILL
#   --fresh            CILIA_STACK_FRESH=1            `up` first deletes Redis data and agent state
#   CILIA_STACK_LOG_LINES (40)                        log lines shown when a component fails to start
#
# Addresses (fixed, README "The local stack"): Redis 127.0.0.1:6390 (appendonly), operator gRPC
# 127.0.0.1:4250 + metrics :9963, agent socket .run/cilia.sock (Hubble .run/hubble.sock, :4244,
# the plugin's DEL queue .run/del-queue, named in the conflist) + metrics :9962, relay Observer
# 127.0.0.1:4245 + health 127.0.0.1:4222. A component that cannot bind its port (another stack
# of another checkout?) fails to start and its log tail says so. Exit status: 0 ok, 1 a
# component failed (its log tail is printed), 2 usage, 3 (status) a component is stopped.
#
# The components are started by the test kit (lib/testkit, cilia_testkit.stack.Stack in its
# shared layout; the command line is cilia_testkit.stackctl), the same code that starts the
# private stacks of the e2e tests, the benchmarks and the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]] || ! .venv/bin/python -c 'import cilia_testkit' 2>/dev/null; then
  echo "[stack] .venv or its cilia_testkit missing: run scripts/setup.sh (make setup)" >&2
  exit 1
fi
exec .venv/bin/python -m cilia_testkit.stackctl "$@"
