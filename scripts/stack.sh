#!/usr/bin/env bash
# The local standalone stack (DESIGN.md §6): Redis, cilia-operator, one cilia-agent, cilia-relay,
# started in the background with pids, logs, sockets and state under .run/.
#
#   scripts/stack.sh up     [--fresh] [--timeout S] [COMPONENT...]   start (idempotent), wait until ready
#   scripts/stack.sh down   [--stop-timeout S] [COMPONENT...]        stop (idempotent)
#   scripts/stack.sh status                                          what runs, is the agent ready
#   scripts/stack.sh purge                                           down, delete demo/e2e/bench/test-kit netns, rm .run
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
#   CILIA_STACK_PORT_WAIT (5)                         seconds `up` waits for a component's TCP ports
#                                                     to be released (a process just SIGKILLed holds
#                                                     its listeners until its exit finishes)
#
# Addresses (fixed by the team brief): Redis 127.0.0.1:6390 (appendonly), operator gRPC
# 127.0.0.1:4250 + metrics :9963, agent socket .run/cilia.sock (Hubble .run/hubble.sock, :4244,
# the plugin's DEL queue .run/del-queue, named in the conflist) +
# metrics :9962, relay Observer 127.0.0.1:4245 + health 127.0.0.1:4222 (SERVING once it reached the
# agent's Peer service). Exit status: 0 ok, 1 a component failed (its log tail is printed), 2 usage.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
RUN=$ROOT/.run
BIN=$ROOT/.venv/bin
COMPONENTS=(redis operator agent relay)

TIMEOUT=${CILIA_STACK_TIMEOUT:-90}
STOP_TIMEOUT=${CILIA_STACK_STOP_TIMEOUT:-10}
FRESH=${CILIA_STACK_FRESH:-0}
LOG_LINES=${CILIA_STACK_LOG_LINES:-40}
PORT_WAIT=${CILIA_STACK_PORT_WAIT:-5}

REDIS_PORT=6390
OPERATOR_ADDR=127.0.0.1:4250
RELAY_ADDR=127.0.0.1:4245
RELAY_HEALTH_ADDR=127.0.0.1:4222
POOLS='default=ipv4-cidrs:10.200.0.0/16;ipv4-mask-size:24'
SOCKET=$RUN/cilia.sock
HUBBLE_SOCKET=$RUN/hubble.sock  # the agent's default: next to --socket
CNI_CONF_DIR=$RUN/cni/net.d
CONFLIST=$CNI_CONF_DIR/05-cilia.conflist
NODE_NAME=$(hostname)

say() { printf '[stack] %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }
usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

pidfile() { echo "$RUN/$1.pid"; }
logfile() { echo "$RUN/$1.log"; }
# The executable each component's /proc/PID/cmdline must mention (guards against pid reuse).
binary_of() {
  case $1 in
    redis) echo redis-server ;; operator) echo cilia-operator ;;
    agent) echo cilia-agent ;; relay) echo cilia-relay ;;
  esac
}

# Print the pid of a running component, or nothing.
running_pid() {
  local f pid
  f=$(pidfile "$1")
  [[ -f $f ]] || return 0
  pid=$(<"$f")
  [[ $pid =~ ^[0-9]+$ ]] || return 0
  if [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$(binary_of "$1")"; then
    echo "$pid"
  fi
}

# Set CMD to the argv of a component.
set_command() {
  case $1 in
    redis)
      CMD=(redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --appendonly yes --save ""
           --dir "$RUN/redis" --daemonize no) ;;
    operator)
      CMD=("$BIN/cilia-operator" serve --store "redis://127.0.0.1:$REDIS_PORT/0"
           --listen "$OPERATOR_ADDR" --prometheus-serve-addr :9963
           --auto-create-cilium-pod-ip-pools "$POOLS" --ipam-default-ip-pool default --log-level info) ;;
    agent)
      CMD=("$BIN/cilia-agent" serve --node-name "$NODE_NAME" --operator "$OPERATOR_ADDR"
           --state-dir "$RUN/agent/state" --socket "$SOCKET" --cni-conf-dir "$CNI_CONF_DIR"
           --cni-conf-name 05-cilia.conflist --cni-del-queue-dir "$RUN/del-queue"
           --prometheus-serve-addr :9962 --log-level info) ;;
    relay)
      CMD=("$BIN/cilia-relay" serve --peer-service "unix:$HUBBLE_SOCKET"
           --listen-address "$RELAY_ADDR" --health-listen-address "$RELAY_HEALTH_ADDR" --log-level info) ;;
  esac
}

show_log_tail() {
  local log
  log=$(logfile "$1")
  if [[ -s $log ]]; then
    say "last $LOG_LINES lines of $log (this start only):"
    # Logs are appended across starts; each start writes a "# <time> <command>" header.
    awk '/^# [0-9][0-9][0-9][0-9]-/ {buf = ""} {buf = buf $0 "\n"} END {printf "%s", buf}' "$log" \
      | tail -n "$LOG_LINES" | sed 's/^/    /' >&2
  else
    say "$log is empty"
  fi
}

# health ADDR -> prints SERVING / NOT_SERVING / UNKNOWN; exit 1 when nothing answers.
health() {
  "$BIN/python" - "$1" <<'EOF' 2>/dev/null
import sys, grpc
from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g
with grpc.insecure_channel(sys.argv[1]) as ch:
    r = g.HealthStub(ch).Check(h.HealthCheckRequest(), timeout=1.0)
print(h.HealthCheckResponse.ServingStatus.Name(r.status))
EOF
}

# ready COMPONENT -> 0 when the component answers. The relay counts as started once its health
# server answers: it reports SERVING only after reaching the agent's Hubble Peer service.
ready() {
  case $1 in
    redis) redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG ;;
    operator) [[ $(health "$OPERATOR_ADDR") == SERVING ]] ;;
    relay) health "$RELAY_HEALTH_ADDR" >/dev/null ;;
    agent) [[ -s $CONFLIST ]] ;;
  esac
}

# TCP ports a component listens on (fixed by the team brief).
ports_of() {
  case $1 in
    redis) echo "$REDIS_PORT" ;; operator) echo "4250 9963" ;;
    agent) echo "9962 4244" ;; relay) echo "4245 4222" ;;
  esac
}

# Fail early, naming the holder, when another process (e.g. a second checkout's stack on this
# shared host) still listens on one of the component's ports after PORT_WAIT seconds. The wait
# covers a component that was just SIGKILLed: the kernel closes its listeners only when the last
# of its threads has exited, a moment after /proc stops showing its command line.
check_ports_free() {
  local port holder deadline=$((SECONDS + PORT_WAIT))
  for port in $(ports_of "$1"); do
    while holder=$(ss -ltnpH "sport = :$port" 2>/dev/null | grep -o 'users:(([^)]*))' | head -1 || true)
      [[ -n $holder ]] || ss -ltnH "sport = :$port" 2>/dev/null | grep -q .; do
      if ((SECONDS >= deadline)); then
        die "$1 cannot start: TCP port $port is already in use ${holder:-by another process}" \
          "(another stack? scripts/stack.sh status, or stop it where it was started)"
      fi
      sleep 0.1
    done
  done
}

start_one() {
  local name=$1 pid log deadline
  pid=$(running_pid "$name")
  if [[ -n $pid ]]; then
    say "$name already running (pid $pid)"
    return 0
  fi
  check_ports_free "$name"
  local bin
  bin=$(binary_of "$name")
  if [[ $name == redis ]]; then
    command -v redis-server >/dev/null || die "redis-server not found: run scripts/setup.sh"
  elif [[ ! -x $BIN/$bin ]]; then
    die "$BIN/$bin not found: run scripts/setup.sh (make setup)"
  fi
  log=$(logfile "$name")
  # The agent writes the conflist only once ready; a file left by an earlier run must not
  # count as readiness.
  [[ $name == agent ]] && rm -f "$CONFLIST"
  set_command "$name"
  printf '# %s %s\n' "$(date -u +%FT%TZ)" "${CMD[*]}" >>"$log"
  # setsid: the stack outlives the terminal/pytest that started it and gets no stray SIGINT.
  setsid "${CMD[@]}" </dev/null >>"$log" 2>&1 &
  pid=$!
  echo "$pid" >"$(pidfile "$name")"
  deadline=$((SECONDS + TIMEOUT))
  until ready "$name"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      wait "$pid" 2>/dev/null && rc=0 || rc=$?
      say "$name exited with status $rc during start-up"
      show_log_tail "$name"
      rm -f "$(pidfile "$name")"
      exit 1
    fi
    if ((SECONDS >= deadline)); then
      say "$name (pid $pid) not ready after ${TIMEOUT}s$([[ $name == agent ]] && echo ": no $CONFLIST")"
      show_log_tail "$name"
      stop_one "$name"
      say "components started before $name keep running: scripts/stack.sh down stops them"
      exit 1
    fi
    sleep 0.2
  done
  local extra=""
  [[ $name == relay ]] && extra=", health $(health "$RELAY_HEALTH_ADDR")"
  say "$name ready (pid $pid, log $log$extra)"
}

stop_one() {
  local name=$1 pid deadline
  pid=$(running_pid "$name")
  if [[ -z $pid ]]; then
    rm -f "$(pidfile "$name")"
    return 0
  fi
  kill -TERM "$pid" 2>/dev/null || true
  deadline=$((SECONDS + STOP_TIMEOUT))
  while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    say "$name (pid $pid) still running ${STOP_TIMEOUT}s after SIGTERM: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  fi
  rm -f "$(pidfile "$name")"
  say "$name stopped (was pid $pid)"
}

status() {
  local name pid rc=0
  for name in "${COMPONENTS[@]}"; do
    pid=$(running_pid "$name")
    if [[ -n $pid ]]; then
      local extra=""
      [[ $name == relay ]] && extra="  health $(health "$RELAY_HEALTH_ADDR" || echo '?')"
      printf '%-9s running  pid %-7s log %s%s\n' "$name" "$pid" "$(logfile "$name")" "$extra"
    else
      printf '%-9s stopped\n' "$name"; rc=3
    fi
  done
  if [[ -s $CONFLIST ]]; then echo "cni conf  $CONFLIST"; else echo "cni conf  (not written)"; fi
  if [[ -n $(running_pid agent) ]]; then
    echo
    "$BIN/cilia-agent" status --socket "$SOCKET" || rc=1
    echo
  fi
  return $rc
}

cmd=${1:-}
[[ -n $cmd ]] || usage
shift
selected=()
while (($#)); do
  case $1 in
    --timeout) TIMEOUT=${2:?--timeout needs seconds}; shift 2 ;;
    --stop-timeout) STOP_TIMEOUT=${2:?--stop-timeout needs seconds}; shift 2 ;;
    --fresh) FRESH=1; shift ;;
    -h | --help) usage ;;
    redis | operator | agent | relay) selected+=("$1"); shift ;;
    *) say "unknown argument: $1"; usage ;;
  esac
done
[[ $TIMEOUT =~ ^[0-9]+$ && $STOP_TIMEOUT =~ ^[0-9]+$ ]] || die "timeouts must be whole seconds"
((${#selected[@]})) || selected=("${COMPONENTS[@]}")

case $cmd in
  up)
    [[ $(id -u) -eq 0 ]] || die "the agent needs root (netns, veth, iptables): run as root"
    if [[ $FRESH == 1 ]]; then
      for name in "${COMPONENTS[@]}"; do
        [[ -z $(running_pid "$name") ]] || die "--fresh needs a stopped stack: scripts/stack.sh down first"
      done
      rm -rf "$RUN/redis" "$RUN/agent" "$RUN/cni"
    fi
    mkdir -p "$RUN/redis" "$RUN/agent/state" "$CNI_CONF_DIR"
    for name in "${COMPONENTS[@]}"; do
      [[ " ${selected[*]} " == *" $name "* ]] && start_one "$name"
    done
    say "up: conflist $CONFLIST, agent socket $SOCKET"
    ;;
  down)
    for ((i = ${#COMPONENTS[@]} - 1; i >= 0; i--)); do
      name=${COMPONENTS[i]}
      [[ " ${selected[*]} " == *" $name "* ]] && stop_one "$name"
    done
    true
    ;;
  status) status ;;
  purge)
    for ((i = ${#COMPONENTS[@]} - 1; i >= 0; i--)); do stop_one "${COMPONENTS[i]}"; done
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^cilia-(demo|e2e|bench|tk|ipmig)-' || true); do
      ip netns delete "$ns" && say "deleted netns $ns"
    done
    rm -rf "$RUN"
    say "purged $RUN"
    ;;
  *) usage ;;
esac
