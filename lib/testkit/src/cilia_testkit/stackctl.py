"""The command line of the ``make up`` stack (``scripts/stack.sh``): ``python -m
cilia_testkit.stackctl up|down|status|purge``.

It drives :class:`cilia_testkit.stack.Stack` in its shared layout (``Stack(shared=True)``):
run dir ``.run/``, the README's fixed addresses, pid files ``.run/<component>.pid`` so that a
later command finds what an earlier one started (the processes outlive it, in sessions of
their own). The components and their command lines are the test kit's: this is not a
second way to start them.

    up     [--fresh] [--timeout S] [COMPONENT...]   start (idempotent), wait until each is ready
    down   [--stop-timeout S] [COMPONENT...]        stop (idempotent), reverse order
    status                                          what runs; the agent's ``cilia-agent status``
    purge                                           down, delete leftover demo/e2e/bench/test-kit/cluster
                                                    netns whose owner process is gone (those of a running
                                                    test, demo or cluster are kept and named), rm .run

COMPONENT: redis operator agent relay (default all). Environment defaults:
``CILIA_STACK_TIMEOUT`` (90), ``CILIA_STACK_STOP_TIMEOUT`` (10), ``CILIA_STACK_FRESH`` (0),
``CILIA_STACK_LOG_LINES`` (40). Exit status: 0 ok, 1 a component failed (its log tail is
printed), 2 usage, 3 (``status``) a component is stopped.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import pathlib
import re
import shutil
import subprocess
import sys
from collections.abc import Collection, Sequence

from cilia_testkit import VENV_BIN
from cilia_testkit.bpfmaps import DEFAULT_PIN_DIR
from cilia_testkit.host import tail
from cilia_testkit.netns import delete_netns, list_netns, netns_owner
from cilia_testkit.stack import SHARED_POOL, SHARED_RUN, SLOT_DIR, Stack, StackError

COMPONENTS = ("redis", "operator", "agent", "relay")
#: netns prefixes of the demo, the e2e tests, the benches, the test kit's own tests and
#: the clusters (``cilia-cl<slot>-``: nodes and pods of :class:`~cilia_testkit.cluster.Cluster`).
LEFTOVER_NETNS = re.compile(r"^cilia-(demo|e2e|bench|tk|ipmig|cl([0-9]+))-")


def _say(text: str) -> None:
    print(f"[stack] {text}", file=sys.stderr, flush=True)


def shared_stack(ready_seconds: float = 90.0) -> Stack:
    """The ``make up`` stack: one agent (node = host name), the relay, pool 10.200.0.0/16."""
    return Stack(
        "make-up", shared=True, pool_cidr=SHARED_POOL, ready_seconds=ready_seconds
    ).prepare()


def _log_tail(stack: Stack, name: str, lines: int) -> None:
    log = stack.components()[name].log
    _say(f"last {lines} lines of {log} (this start only):")
    for line in tail(log, lines).splitlines():
        print(f"    {line}", file=sys.stderr)


def up(stack: Stack, selected: Sequence[str], *, fresh: bool, log_lines: int) -> int:
    """Start the selected components in order; 1 (after the log tail) when one fails."""
    if os.geteuid() != 0:
        _say("the agent needs root (netns, veth, iptables): run as root")
        return 1
    procs = stack.components()
    if fresh:
        if any(p.running() for p in procs.values()):
            _say("--fresh needs a stopped stack: scripts/stack.sh down first")
            return 1
        for sub in ("redis", "agent", "cni"):
            shutil.rmtree(SHARED_RUN / sub, ignore_errors=True)
    for name in COMPONENTS:
        if name not in selected:
            continue
        pid = procs[name].pid
        if pid is not None:
            _say(f"{name} already running (pid {pid})")
            continue
        try:
            stack.start_component(name)
        except StackError as exc:
            _say(str(exc).splitlines()[0])
            _log_tail(stack, name, log_lines)
            _say("components started before it keep running: scripts/stack.sh down stops them")
            return 1
        _say(f"{name} ready (pid {procs[name].pid}, log {procs[name].log})")
    _say(f"up: conflist {stack.agent.conflist_path}, agent socket {stack.agent.socket}")
    return 0


def down(stack: Stack, selected: Sequence[str], *, stop_timeout: float) -> int:
    """Stop the selected components in reverse order."""
    procs = stack.components()
    for name in reversed(COMPONENTS):
        if name not in selected:
            continue
        pid, killed = procs[name].stop(timeout=stop_timeout)
        if killed:
            _say(f"{name} (pid {pid}) still running {stop_timeout:g}s after SIGTERM: SIGKILL")
        if pid is not None:
            _say(f"{name} stopped (was pid {pid})")
    return 0


def status(stack: Stack) -> int:
    """Print each component's state and the agent's status; 3 when one is stopped."""
    rc = 0
    for name, proc in stack.components().items():
        pid = proc.pid
        if pid is not None:
            print(f"{name:<9} running  pid {pid:<7} log {proc.log}")
        else:
            print(f"{name:<9} stopped")
            rc = 3
    conflist = stack.agent.conflist_path
    print(f"cni conf  {conflist if conflist.exists() else '(not written)'}")
    if stack.agent.pid is not None:
        print()
        out = subprocess.run(
            [str(VENV_BIN / "cilia-agent"), "status", "--socket", str(stack.agent.socket)],
            check=False,
        )
        print()
        rc = rc or (1 if out.returncode else 0)
    return rc


def purge(stack: Stack, *, stop_timeout: float) -> int:
    """Stop everything, remove the agent's BPF pins (its maps, and the links that keep its
    socket load balancer attached to the host's cgroup2 with the stack's old Services) and
    host device, delete leftover netns of the demo/tests/benches, remove ``.run``. (``down``
    keeps the pins, so a restarted agent serves the same pods, as upstream's does.) Only
    namespaces whose owner is gone are deleted (:func:`remove_leftover_netns`); the pins and
    device stay while an agent uses them (:func:`agents_using`: another checkout's
    ``make up`` agent has the same ones)."""
    down(stack, COMPONENTS, stop_timeout=stop_timeout)
    users = agents_using(stack.agent.pin_dir)
    if users:
        # the make-up stacks of all checkouts share the pin dir and host device: another
        # checkout's running agent keeps them (its datapath would be gone under it)
        _say(
            f"kept {stack.agent.pin_dir} and {stack.agent.host_device}: cilia-agent pid "
            f"{', '.join(map(str, users))} still uses them (another checkout's `make up`?)"
        )
    else:
        stack.agent.remove_leftovers()
        _say(f"removed {stack.agent.pin_dir} (maps, socket-LB links) and {stack.agent.host_device}")
    deleted, kept = remove_leftover_netns()
    for name in deleted:
        _say(f"deleted netns {name}")
    for name, owner in kept.items():
        _say(f"kept netns {name}: {owner} still runs")
    shutil.rmtree(SHARED_RUN, ignore_errors=True)
    _say(f"purged {SHARED_RUN}")
    return 0


def agents_using(pin_dir: pathlib.Path, proc: pathlib.Path = pathlib.Path("/proc")) -> list[int]:
    """Pids of the running ``cilia-agent serve`` processes (any checkout's) whose
    ``--bpf-pin-dir`` (alias ``--bpf-root``; the agent's default when absent,
    ``/sys/fs/bpf/cilia``) is ``pin_dir``, read from ``/proc/<pid>/cmdline``; sorted."""
    want = os.path.normpath(pin_dir)
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        starts = [i for i, a in enumerate(argv) if os.path.basename(a) == "cilia-agent"]
        if not starts or argv[starts[0] + 1 : starts[0] + 2] != ["serve"]:
            continue
        used = str(DEFAULT_PIN_DIR)
        args = argv[starts[0] + 2 :]
        for i, arg in enumerate(args):
            flag, eq, value = arg.partition("=")
            if flag in ("--bpf-pin-dir", "--bpf-root"):
                used = value if eq else (args[i + 1] if i + 1 < len(args) else used)
        if os.path.normpath(used) == want:
            found.append(int(entry.name))
    return sorted(found)


def remove_leftover_netns(
    only: Collection[str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Delete the :data:`LEFTOVER_NETNS` namespaces nobody runs any more (of ``only`` when
    given, a test's own names); returns the names deleted and, per name kept, who still
    owns it.

    A namespace is kept while its owner runs (:func:`cilia_testkit.netns.netns_owner`: the
    process that made it, e.g. a test run, the demo or a cluster's supervisor) or, for a
    cluster's (``cilia-cl<slot>-``), while a Stack holds that slot (its ``flock``).
    """
    deleted: list[str] = []
    kept: dict[str, str] = {}
    for name in list_netns("cilia-"):
        match = LEFTOVER_NETNS.match(name)
        if not match or (only is not None and name not in only):
            continue
        owner = netns_owner(name)
        if owner is not None:
            kept[name] = f"owner pid {owner}"
        elif match.group(2) is not None and _slot_held(int(match.group(2))):
            kept[name] = f"the holder of stack slot {match.group(2)}"
        else:
            delete_netns(name)
            deleted.append(name)
    return deleted, kept


def _slot_held(slot: int) -> bool:
    """Whether a running Stack holds ``slot`` (its lock file is ``flock``-ed)."""
    try:
        fd = os.open(SLOT_DIR / f"{slot}.lock", os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock taken here
    return False


def _seconds(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError("timeouts must be whole seconds")
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the command; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="scripts/stack.sh",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=("up", "down", "status", "purge"))
    parser.add_argument("components", nargs="*", metavar="COMPONENT", help=" ".join(COMPONENTS))
    parser.add_argument(
        "--timeout", type=_seconds, default=_seconds(os.environ.get("CILIA_STACK_TIMEOUT", "90"))
    )
    parser.add_argument(
        "--stop-timeout",
        type=_seconds,
        default=_seconds(os.environ.get("CILIA_STACK_STOP_TIMEOUT", "10")),
    )
    parser.add_argument(
        "--fresh", action="store_true", default=os.environ.get("CILIA_STACK_FRESH") == "1"
    )
    args = parser.parse_args(argv)
    unknown = [c for c in args.components if c not in COMPONENTS]
    if unknown:
        parser.error(f"unknown component {unknown[0]!r} (choose from {', '.join(COMPONENTS)})")
    selected = args.components or list(COMPONENTS)
    log_lines = int(os.environ.get("CILIA_STACK_LOG_LINES", "40"))
    stack = shared_stack(float(args.timeout))
    if args.command == "up":
        return up(stack, selected, fresh=args.fresh, log_lines=log_lines)
    if args.command == "down":
        return down(stack, selected, stop_timeout=args.stop_timeout)
    if args.command == "status":
        return status(stack)
    return purge(stack, stop_timeout=args.stop_timeout)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `scripts/stack.sh status | head`
        sys.exit(0)
