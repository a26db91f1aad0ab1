#!/bin/bash
# PID 2 of a cilia-node container (tini is PID 1): prepare the node's mounts, then run and
# supervise the node's services. Written for cilia_testkit.kind; read its README section.
#
# The harness bind-mounts /etc/cilia-node (read-only): services/NN-NAME files, each a bash
# script that ends in `exec <daemon> ...`; they start in name order and each is restarted
# RESTART_SECONDS after it exits, so a stopped and started container (a "rebooted node") brings
# its containerd, kubelet (and control plane) back on its own. Logs: /var/log/cilia-node/NAME.log
# (a host directory of the harness). SIGTERM (docker stop) ends every service and exits.
set -uo pipefail
RESTART_SECONDS=${CILIA_NODE_RESTART_SECONDS:-1}
CONF=/etc/cilia-node
LOGS=/var/log/cilia-node
mkdir -p "$LOGS"
say() { printf '%s [entrypoint] %s\n' "$(date -u +%FT%TZ)" "$*" >>"$LOGS/entrypoint.log"; }

# --- mounts -----------------------------------------------------------------------------
# Docker mounts /sys and the cgroup v1 hierarchies read-only in a non-privileged container;
# this one has CAP_SYS_ADMIN and no AppArmor/seccomp profile, so it may remount them.
mount -o remount,rw /sys 2>>"$LOGS/entrypoint.log" || say "remount /sys rw failed"
for d in /sys/fs/cgroup/*; do
  # (a bind remount changes this mount's flag; a plain remount of the shared superblock is refused)
  mountpoint -q "$d" && { mount -o remount,bind,rw "$d" 2>>"$LOGS/entrypoint.log" || say "remount $d rw failed"; }
done
# The container has its own cgroup namespace (docker --cgroupns=private): the cgroup2
# mounted here is rooted at this container's own cgroup in the host's unified hierarchy, so
# cgroup-v2 BPF programs attached at this node's root act on this node's processes only.
# Mounted where the host has it (hybrid layout: v1 controllers + /sys/fs/cgroup/unified).
if ! mountpoint -q /sys/fs/cgroup/unified; then
  mkdir -p /sys/fs/cgroup/unified
  mount -t cgroup2 -o nsdelegate cgroup2 /sys/fs/cgroup/unified 2>/dev/null \
    || mount -t cgroup2 cgroup2 /sys/fs/cgroup/unified || say "cgroup2 mount failed"
fi
# the node's own BPF filesystem (a new instance per mount): pins of one node are not another's
mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf || say "bpffs mount failed"
# volumes the kubelet mounts for pods (and Bidirectional mounts of privileged pods) propagate
mount --make-rshared /
# The kubelet writes a few kernel-wide tunables at start (vm.overcommit_memory, kernel.panic,
# ...). This container's /proc/sys is the host's: give the kubelet copies to write, so a
# test cluster never changes the machine's panic behaviour. Bind mounts in this container's
# mount namespace only.
mkdir -p /run/cilia-node/sysctl
for f in vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops \
         kernel/keys/root_maxkeys kernel/keys/root_maxbytes; do
  [[ -e /proc/sys/$f ]] || continue
  copy=/run/cilia-node/sysctl/${f//\//.}
  cat "/proc/sys/$f" >"$copy"
  mount --bind "$copy" "/proc/sys/$f" || say "bind $f failed"
done
# per network namespace: this node routes for its pods
sysctl -qw net.ipv4.ip_forward=1 net.ipv4.conf.all.rp_filter=0 2>>"$LOGS/entrypoint.log" || true
say "mounts ready; cgroup: $(tr '\n' ' ' </proc/self/cgroup)"

# --- services ----------------------------------------------------------------------------
supervise() {  # NAME FILE: run FILE with bash, again after every exit, until SIGTERM
  local name=$1 file=$2
  trap 'kill -TERM "$child" 2>/dev/null; wait "$child"; exit 0' TERM
  while :; do
    bash "$file" >>"$LOGS/$name.log" 2>&1 &
    child=$!
    wait "$child"
    say "$name exited with $?; restarting in ${RESTART_SECONDS}s"
    sleep "$RESTART_SECONDS"
  done
}
pids=()
shopt -s nullglob
for file in "$CONF"/services/*; do
  name=$(basename "$file"); name=${name#[0-9][0-9]-}
  supervise "$name" "$file" &
  pids+=($!)
  say "started $name (supervisor $!)"
done
stop() {
  say "SIGTERM: stopping services"
  # in reverse order: the kubelet before containerd, the API server before etcd
  for ((i=${#pids[@]}-1; i>=0; i--)); do kill -TERM "${pids[i]}" 2>/dev/null; wait "${pids[i]}"; done
  exit 0
}
trap stop TERM INT
touch /run/cilia-node/ready
while :; do wait; sleep 1; done
