"""One agent of a :class:`cilia_testkit.stack.Stack`: :class:`Agent`, the argv of a
``cilia-agent serve`` with every path, device, pin dir and listener of its own, started on the
host or inside a named network namespace, and its readiness."""

from __future__ import annotations

import pathlib
import shutil
import socket
import subprocess
from typing import TYPE_CHECKING, Any

from cilia_testkit import VENV_BIN
from cilia_testkit.bpfmaps import DEFAULT_PIN_DIR
from cilia_testkit.cni import load_conflist
from cilia_testkit.host import sh
from cilia_testkit.netns import NETNS_DIR
from cilia_testkit.stackslots import _listen_spec

if TYPE_CHECKING:
    from cilia_testkit.stack import Stack


class Agent:
    """One ``cilia-agent serve`` of a :class:`Stack` with every path and name of its own.

    Args:
        stack: the stack it belongs to.
        index: 0, 1 … within the stack.
        node_name: ``--node-name`` (default: the host name for agent 0, ``<host>-<index>``
            after).
        netns: a named network namespace (``ip netns``) to run the agent in, as the node of a
            :class:`~cilia_testkit.cluster.Cluster`; "" = the caller's (the host's).

    The agent of a netns is started through ``nsenter --net=/var/run/netns/<netns>``, not
    ``ip netns exec``: the latter also gives the command a mount namespace with a fresh
    ``/sys`` (hiding the host's bpffs), so the agent would mount a bpffs instance of its own
    whose pins die with it, and neither a restarted agent nor ``bpftool`` on the host would
    find its maps. ``nsenter`` execs the agent (same pid) with only the network namespace
    changed; ``/proc/sys/net`` (``ip_forward``) and netlink then act on the node's netns.

    Attributes:
        index: 0, 1 … within the stack.
        node_name: ``--node-name``.
        netns: the network namespace it runs in ("" = the host's).
        dir: its directory in the run dir (sockets, ``state/``, ``net.d/``, ``del-queue/``).
        socket, hubble_socket, state_dir, conf_dir, conflist_path, del_queue_dir: its paths.
        pin_dir: ``--bpf-pin-dir``; host_device: ``--host-device-name``.
        process: the :class:`Process`.
    """

    def __init__(
        self, stack: Stack, index: int, *, node_name: str | None = None, netns: str = ""
    ) -> None:
        self.stack = stack
        self.index = index
        host = socket.gethostname()
        self.node_name = node_name or (host if index == 0 else f"{host}-{index}")
        self.netns = netns
        self.dir = stack.run_dir / f"agent{index}"
        self.socket = self.dir / "cilia.sock"
        self.hubble_socket = self.dir / "hubble.sock"
        self.state_dir = self.dir / "state"
        self.conf_dir = self.dir / "net.d"
        self.conflist_path = self.conf_dir / "05-cilia.conflist"
        self.del_queue_dir = self.dir / "del-queue"
        self.pin_dir = pathlib.Path(f"/sys/fs/bpf/cilia-tk{stack.slot}-a{index}")
        self.host_device = f"cilia_t{stack.slot}a{index}"
        self.hubble_address = ""
        self.metrics_address = "127.0.0.1:0"
        if stack.shared:  # the make-up stack's documented paths and ports (README)
            run = stack.run_dir
            self.dir = run
            self.socket, self.hubble_socket = run / "cilia.sock", run / "hubble.sock"
            self.state_dir = run / "agent" / "state"
            self.conf_dir = run / "cni" / "net.d"
            self.conflist_path = self.conf_dir / "05-cilia.conflist"
            self.del_queue_dir = run / "del-queue"
            self.pin_dir = DEFAULT_PIN_DIR
            self.host_device = "cilia_host"
            self.hubble_address, self.metrics_address = ":4244", ":9962"
        name = "agent" if index == 0 else f"agent{index}"
        self.process = stack.process(name, "cilia-agent")
        self.extra_args: tuple[str, ...] = ()

    def argv(self, *extra: str) -> list[str]:
        """The ``cilia-agent serve`` command line (``extra`` flags appended)."""
        s = self.stack
        if not self.hubble_address:
            self.hubble_address = _listen_spec(
                "agent", "hubble-tcp", s.slot, self.hubble_socket, self.index
            )
        enter = ["nsenter", f"--net={NETNS_DIR / self.netns}", "--"] if self.netns else []
        return [
            *enter,
            str(VENV_BIN / "cilia-agent"),
            "serve",
            "--node-name",
            self.node_name,
            "--operator",
            s.operator_address,
            "--state-dir",
            str(self.state_dir),
            "--socket",
            str(self.socket),
            "--hubble-socket",
            str(self.hubble_socket),
            "--hubble-listen-address",
            self.hubble_address if s.hubble_tcp else "",
            "--cni-conf-dir",
            str(self.conf_dir),
            "--cni-conf-name",
            self.conflist_path.name,
            "--cni-del-queue-dir",
            str(self.del_queue_dir),
            "--prometheus-serve-addr",
            self.metrics_address,
            "--bpf-pin-dir",
            str(self.pin_dir),
            "--host-device-name",
            self.host_device,
            "--log-level",
            "info",
            *s.client_tls_args(f"node-{self.node_name}"),
            *s.hubble_tls_args(self.node_name),
            # a Stack's agents share the host's netns: NodePort programs there would go on
            # the machine's own default-route device; a test wanting them passes
            # --enable-node-port=true in agent_args (later flags win)
            "--enable-node-port=false",
            # ... and masquerade would write the host's nat table, which several stacks
            # share (each agent rebuilds CILIA_POST_nat with its own CIDRs); the Cluster's
            # agents, each in a netns of its own, pass --enable-ipv4-masquerade=true
            "--enable-ipv4-masquerade=false",
            *s.agent_args,
            *extra,
        ]

    def start(self, *extra: str, timeout: float | None = None) -> None:
        """Start (``extra`` flags appended; kept for restarts) and wait until ready: the
        conflist is written (a conflist of an earlier run is removed first).

        Raises:
            StackError: it exited or was not ready in time (log tail in the message).
        """
        self.launch(*extra)
        self.wait_ready(timeout)

    def launch(self, *extra: str) -> None:
        """Start without waiting (see :meth:`wait_ready`); ``extra`` as for :meth:`start`."""
        if extra:
            self.extra_args = extra
        for d in (self.state_dir, self.conf_dir, self.del_queue_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.conflist_path.unlink(missing_ok=True)
        self.process.start(self.argv(*self.extra_args))
        self.stack.record(self.process)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the conflist is written.

        Raises:
            StackError: it exited or ``timeout`` (default the stack's) s passed.
        """
        self.process.wait_ready(
            self.conflist_path.exists, self.stack.ready_seconds if timeout is None else timeout
        )

    def stop(self) -> None:
        """SIGTERM (then SIGKILL); idempotent."""
        self.process.stop()

    def kill(self) -> int:
        """SIGKILL and wait until gone; returns the pid (see :meth:`Process.kill`)."""
        return self.process.kill()

    def restart(self, timeout: float | None = None) -> None:
        """Stop and start again with the same flags; wait until ready."""
        self.stop()
        self.start(timeout=timeout)

    @property
    def pid(self) -> int | None:
        """The running agent's pid, else None."""
        return self.process.pid

    def conflist(self) -> dict[str, Any]:
        """The conflist the agent wrote (:func:`cilia_testkit.cni.load_conflist`)."""
        return load_conflist(self.conflist_path)

    def cli(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """``cilia-agent ARGV --socket <its socket>``; never raises on the exit status."""
        return subprocess.run(
            [str(VENV_BIN / "cilia-agent"), *argv, "--socket", str(self.socket)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def endpoint_list(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """``cilia-agent endpoint list ARGV`` with this agent's socket and ``--bpf-pin-dir``
        (the enforcement columns come from its pinned maps); never raises on exit status."""
        return self.cli(
            "endpoint", "list", *argv, "--bpf-pin-dir", str(self.pin_dir), timeout=timeout
        )

    def state_files(self, kind: str = "endpoints") -> list[pathlib.Path]:
        """Files under ``state_dir/kind`` (``[]`` when absent), sorted."""
        directory = self.state_dir / kind
        if not directory.is_dir():
            return []
        return sorted(p for p in directory.iterdir() if p.is_file())

    def del_queue_files(self) -> list[pathlib.Path]:
        """Queued DEL files waiting for the agent's replay (``[]`` when none)."""
        if not self.del_queue_dir.is_dir():
            return []
        return sorted(
            p for p in self.del_queue_dir.iterdir() if p.is_file() and not p.name.startswith(".")
        )

    def remove_leftovers(self) -> None:
        """Remove its BPF pins and host device (the kernel keeps both after the agent exits;
        the device of an agent in a netns goes with that netns)."""
        shutil.rmtree(self.pin_dir, ignore_errors=True)
        if self.netns:
            if (NETNS_DIR / self.netns).exists():
                sh("ip", "-n", self.netns, "link", "del", self.host_device, check=False)
        elif pathlib.Path(f"/sys/class/net/{self.host_device}").exists():
            sh("ip", "link", "del", self.host_device, check=False)
