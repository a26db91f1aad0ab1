"""The local stack — redis, cilia-operator, cilia-agent(s), cilia-relay — for tests, benches
and the demo. The ONE place that starts an agent process for them.

A :class:`Stack` owns everything it starts, so two stacks run side by side on one host:

- a run dir (``tempfile.mkdtemp`` unless given) with each component's log
  (``<component>.log``, a ``# <UTC time> <argv>`` header per start), redis' unix socket and
  data, and per agent ``agent<i>/``: API and Hubble unix sockets, ``state/``, ``net.d/``
  (the CNI conf dir), ``del-queue/``;
- per agent a BPF pin dir ``/sys/fs/bpf/cilia-tk<slot>-a<i>`` (``--bpf-pin-dir``), a host
  device ``cilia_t<slot>a<i>`` (``--host-device-name``) and, per stack, a pod pool
  ``10.<210+slot>.0.0/16`` (unless given);
- TCP listeners bound by the servers themselves on port 0 (``127.0.0.1:0``), read back from
  the ``"listening"`` JSON log line each service writes per listener
  (``cilia_common.runtime.announce_listening``: ``{"msg": "listening", "listener": …,
  "address": …}``). :func:`read_listeners` also understands the operator's older
  ``"operator serving"`` line. Listeners whose service does not announce its bound port yet
  are switched in ONE place, :func:`_listen_spec`: the relay then listens on unix sockets in
  the run dir, and the agent's Hubble TCP server (which the agent advertises to the relay
  as ``<node IP>:<configured port>``, so port 0 cannot work before it advertises the bound
  one) on a port of the stack's slot.

The slot (0..:data:`SLOTS`-1) is an ``flock``-held file under :data:`SLOT_DIR` (released by
the kernel when the holder dies); it numbers what must be unique per host (device names, pin
dirs, pool CIDR, the interim ports). Each started process is recorded per slot, so the next
holder of a slot kills what a killed test run left behind (:func:`_kill_orphans`) before it
removes that slot's pins and devices.

``Stack(shared=True)`` is the ``make up`` stack instead (``scripts/stack.sh`` through
:mod:`cilia_testkit.stackctl`): run dir ``.run/``, the README's fixed addresses
(:data:`SHARED_OPERATOR` …), the agent's default pin dir and ``cilia_host``, pid files so that
a later command finds the processes an earlier one started; its pins, device and run dir stay.

What two stacks still share on one host: the iptables chain ``CILIA_FORWARD`` and its jump
from FORWARD (each agent installs the same two ``lxc+`` rules and repairs them; neither
removes them on exit, so they coexist) and the host's routing table (disjoint pool CIDRs).
Their agents run with ``--enable-ipv4-masquerade=false`` (the nat chain ``CILIA_POST_nat``
would be one per host, rebuilt by each agent with its own CIDRs).
Processes start in their own session (``start_new_session``; no ``preexec_fn``) and are
stopped with SIGTERM, then SIGKILL, and reaped.
"""

from __future__ import annotations

import contextlib
import pathlib
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from types import TracebackType
from typing import Self

from cilia_testkit import ROOT, VENV_BIN
from cilia_testkit._process import Process, StackError
from cilia_testkit.host import sh
from cilia_testkit.redis import server_argv
from cilia_testkit.stackagent import Agent
from cilia_testkit.stackslots import (
    ANNOUNCED,
    MAX_AGENTS,
    READY_SECONDS,
    SHARED_AGENT_SOCKET,
    SHARED_CONFLIST,
    SHARED_OPERATOR,
    SHARED_POOL,
    SHARED_REDIS_PORT,
    SHARED_RELAY,
    SHARED_RELAY_HEALTH,
    SHARED_RUN,
    SLOT_DIR,
    SLOT_PORT_BASE,
    SLOTS,
    _kill_orphans,
    _listen_spec,
    _logged,
    _slot,
    read_listeners,
)


class Stack:
    """Redis, operator, ``agents`` agents and (optionally) the relay, started in that order
    by :meth:`start` / ``with Stack(...) as stack`` and stopped in reverse by :meth:`stop`.

    Args:
        name: names the run dir (``cilia-<name>-…``) in messages and logs.
        run_dir: where logs, sockets and state go (default: a new temporary directory,
            removed by :meth:`stop` unless ``keep_run_dir``).
        pool_cidr: the operator's ``default`` pool (default ``10.<210+slot>.0.0/16``).
        mask_size: per-node block size of that pool.
        auto_pool: pass that pool as ``--auto-create-cilium-pod-ip-pools`` (False: the
            operator flags, e.g. ``--ipam cluster-pool``, come from the caller only).
        agents: how many agents (0 = operator only).
        relay: start cilia-relay, peering with agent 0's Hubble socket.
        hubble_tcp: give each agent a Hubble TCP server (the relay needs it to reach peers).
        operator_args, agent_args: extra flags for every start of those components.
        operator_host: the address the operator's gRPC server binds (port 0, read back);
            a :class:`~cilia_testkit.cluster.Cluster` gives its LAN bridge address so that
            agents in node namespaces reach it.
        ready_seconds: per component start timeout.
        tls: mutual TLS between agents/CLI and operator: :meth:`prepare` runs
            ``cilia-operator certs generate`` into ``<run dir>/tls`` (a CA, the operator's
            server pair, ``node-<node>.crt/.key`` per agent, ``admin.crt/.key``), the
            operator gets ``--tls-*`` and each agent ``--tls-operator-*`` flags, and
            :meth:`operator_cli` uses the admin pair. False: the operator runs with
            ``--disable-tls`` (plaintext, as before TLS existed).
        hubble_tls: Hubble over TLS: the same ``certs generate`` also writes Hubble's pairs
            (``--hubble-cluster default``): each agent's Hubble TCP server gets
            ``--hubble-tls-*`` (mutual), the relay dials agents with its client pair and
            serves its observer API with TLS (``*.hubble-relay.cilium.io``). False: agents
            get ``--hubble-disable-tls`` and the relay ``--disable-server-tls``.
        relay_args: extra flags of the relay.

    Raises (from :meth:`start`):
        StackError: a component failed to start or get ready; what started is stopped.
    """

    def __init__(
        self,
        name: str = "stack",
        *,
        run_dir: pathlib.Path | None = None,
        pool_cidr: str | None = None,
        mask_size: int = 24,
        auto_pool: bool = True,
        agents: int = 1,
        relay: bool = True,
        hubble_tcp: bool = True,
        operator_args: Sequence[str] = (),
        agent_args: Sequence[str] = (),
        ready_seconds: float = READY_SECONDS,
        keep_run_dir: bool = False,
        shared: bool = False,
        operator_host: str = "127.0.0.1",
        tls: bool = False,
        hubble_tls: bool = False,
        relay_args: Sequence[str] = (),
    ) -> None:
        self.tls = tls
        self.hubble_tls = hubble_tls
        self.relay_args = tuple(relay_args)
        self.tls_dir = pathlib.Path()
        self.name = name
        self.operator_host = operator_host
        self.shared = shared
        self._given_run_dir = run_dir
        self._pool_cidr = pool_cidr
        self.mask_size = mask_size
        self.auto_pool = auto_pool
        self.agent_count = agents
        self.with_relay = relay
        self.hubble_tcp = hubble_tcp
        self.operator_args = tuple(operator_args)
        self.agent_args = tuple(agent_args)
        self.ready_seconds = ready_seconds
        self.keep_run_dir = keep_run_dir
        self._exit = contextlib.ExitStack()
        self._prepared = False
        self.slot = -1
        self.run_dir = pathlib.Path()
        self.agents: list[Agent] = []
        self.redis = self.process("redis", "redis-server")
        self.operator = self.process("operator", "cilia-operator")
        self.relay = self.process("relay", "cilia-relay")
        self.operator_address = ""
        self.operator_metrics = ""
        self.relay_address = ""
        self.relay_health_address = ""
        self.started = False

    # -- properties -----------------------------------------------------------------------

    @property
    def pool_cidr(self) -> str:
        """The ``default`` pool's CIDR (known once the slot is held)."""
        return self._pool_cidr or f"10.{210 + self.slot}.0.0/16"

    @property
    def agent(self) -> Agent:
        """Agent 0."""
        return self.agents[0]

    @property
    def redis_socket(self) -> pathlib.Path:
        """redis' unix socket in the run dir."""
        return self.run_dir / "redis.sock"

    @property
    def redis_url(self) -> str:
        """The operator's ``--store`` URL (unix socket, db 0; the shared stack's TCP port)."""
        if self.shared:
            return f"redis://127.0.0.1:{SHARED_REDIS_PORT}/0"
        return f"unix://{self.redis_socket}?db=0"

    def process(self, name: str, binary: str) -> Process:
        """A :class:`Process` for component ``name`` logging to ``<run dir>/<name>.log``
        (the shared stack's also with ``<run dir>/<name>.pid``)."""
        return Process(
            name,
            self.run_dir / f"{name}.log",
            pidfile=self.run_dir / f"{name}.pid" if self.shared else None,
            binary=binary,
        )

    def components(self) -> dict[str, Process]:
        """Component name → :class:`Process` (``redis``, ``operator``, ``agent``…, ``relay``)."""
        out = {"redis": self.redis, "operator": self.operator}
        out.update({a.process.name: a.process for a in self.agents})
        if self.with_relay:
            out["relay"] = self.relay
        return out

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def prepare(self) -> Self:
        """Take a slot, make the run dir, name the agents and remove their leftovers (pins,
        devices of a killed earlier stack of this slot); starts nothing. :meth:`start` calls
        it; call it yourself to start components one by one (``start_redis`` …).

        Raises:
            StackError: no free slot.
        """
        if self._prepared:
            return self
        if self.shared:
            self.run_dir = SHARED_RUN  # created by the first start (`status` leaves no trace)
            # fixed, so known before (and without) starting them in this process
            self.operator_address, self.operator_metrics = SHARED_OPERATOR, "127.0.0.1:9963"
            self.relay_address, self.relay_health_address = SHARED_RELAY, SHARED_RELAY_HEALTH
        else:
            self.slot = self._exit.enter_context(_slot())
            if self._given_run_dir is None:
                self.run_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"cilia-{self.name}-"))
            else:
                self.run_dir = self._given_run_dir
                self.run_dir.mkdir(parents=True, exist_ok=True)
        self.redis = self.process("redis", "redis-server")
        self.operator = self.process("operator", "cilia-operator")
        self.relay = self.process("relay", "cilia-relay")
        self.agents = [Agent(self, i) for i in range(self.agent_count)]
        if self.tls or self.hubble_tls:
            self.tls_dir = self.run_dir / "tls"
            self.issue_certs()
        if not self.shared:
            _kill_orphans(self.slot)
            for agent in self.agents:
                agent.remove_leftovers()
        self._prepared = True
        return self

    def issue_certs(self) -> None:
        """(Re)write the TLS files of every agent (and the CA, server and admin pairs; the
        CA is kept) with ``cilia-operator certs generate``.

        Raises:
            StackError: the command failed.
        """
        nodes = ",".join(a.node_name for a in self.agents)
        out = subprocess.run(
            [str(VENV_BIN / "cilia-operator"), "certs", "generate", "--dir", str(self.tls_dir),
             "--nodes", nodes, "--hosts", f"{self.operator_host},127.0.0.1,localhost",
             "--days", "2", *(["--hubble-cluster", "default"] if self.hubble_tls else [])],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        if out.returncode != 0:
            raise StackError(f"cilia-operator certs generate: {out.stderr.strip()}")

    def hubble_tls_args(self, node: str) -> list[str]:
        """An agent's ``--hubble-tls-*`` flags (``--hubble-disable-tls`` without
        :attr:`hubble_tls`)."""
        if not self.hubble_tls:
            return ["--hubble-disable-tls"]
        d = self.tls_dir
        return ["--hubble-tls-cert-file", str(d / f"hubble-{node}.crt"),
                "--hubble-tls-key-file", str(d / f"hubble-{node}.key"),
                "--hubble-tls-client-ca-files", str(d / "ca.crt")]  # fmt: skip

    def relay_tls_args(self) -> list[str]:
        """The relay's TLS flags: client pair and CA for agents, server pair for clients
        (``--disable-server-tls`` without :attr:`hubble_tls`)."""
        if not self.hubble_tls:
            return ["--disable-server-tls"]
        d = self.tls_dir
        return ["--tls-hubble-server-ca-files", str(d / "ca.crt"),
                "--tls-client-cert-file", str(d / "hubble-relay-client.crt"),
                "--tls-client-key-file", str(d / "hubble-relay-client.key"),
                "--tls-relay-server-cert-file", str(d / "hubble-relay-server.crt"),
                "--tls-relay-server-key-file", str(d / "hubble-relay-server.key")]  # fmt: skip

    def operator_tls_args(self) -> list[str]:
        """The operator's ``--tls-*`` flags ([] without TLS: ``--disable-tls``)."""
        if not self.tls:
            return ["--disable-tls"]
        d = self.tls_dir
        return ["--tls-cert-file", str(d / "server.crt"), "--tls-key-file", str(d / "server.key"),
                "--tls-client-ca-files", str(d / "ca.crt")]  # fmt: skip

    def client_tls_args(self, client: str = "admin") -> list[str]:
        """``--tls-operator-*`` flags of a client (``admin``, ``node-<node>``); [] without
        TLS."""
        if not self.tls:
            return []
        d = self.tls_dir
        return ["--tls-operator-server-ca-files", str(d / "ca.crt"),
                "--tls-operator-client-cert-file", str(d / f"{client}.crt"),
                "--tls-operator-client-key-file", str(d / f"{client}.key")]  # fmt: skip

    def record(self, process: Process) -> None:
        """Note a started process in the slot's record (:func:`_kill_orphans` reads it)."""
        if process.pid is not None and self.slot >= 0:
            with (SLOT_DIR / f"{self.slot}.pids").open("a") as f:
                f.write(f"{process.pid} {self.run_dir}\n")

    def start(self) -> Self:
        """:meth:`prepare`, then start every component in order and wait for each.

        Raises:
            StackError: a component failed (everything started so far is stopped).
        """
        self.prepare()
        try:
            self.start_redis()
            self.start_operator()
            for agent in self.agents:
                agent.start()
            if self.with_relay and self.agents:
                self.start_relay()
        except BaseException:
            self.stop()
            raise
        self.started = True
        return self

    def start_redis(self) -> None:
        """Start redis-server on the run dir's unix socket (no TCP), appendonly data in
        ``redis/``; ready when ``redis-cli -s SOCKET ping`` answers PONG."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise StackError("redis-server not found: run scripts/setup.sh")
        data = self.run_dir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        if self.shared:
            listen = ["--port", str(SHARED_REDIS_PORT), "--bind", "127.0.0.1"]
            ping = ["redis-cli", "-h", "127.0.0.1", "-p", str(SHARED_REDIS_PORT), "ping"]
        else:
            listen = ["--port", "0", "--unixsocket", str(self.redis_socket)]
            listen += ["--unixsocketperm", "700"]
            ping = ["redis-cli", "-s", str(self.redis_socket), "ping"]
        self.redis.start(server_argv(binary, listen, data, appendonly=True))
        self.record(self.redis)
        self.redis.wait_ready(
            lambda: sh(*ping, check=False).stdout.strip() == "PONG", self.ready_seconds
        )

    def start_operator(self, *extra: str) -> None:
        """Start cilia-operator (gRPC and metrics on 127.0.0.1:0 the first time; the same
        bound addresses on a restart, as agents hold them) and wait for its listeners.

        Raises:
            StackError: it exited, or its listeners were not logged in time.
        """
        if self.shared:
            listen, metrics = SHARED_OPERATOR, ":9963"
        else:
            listen = self.operator_address or _listen_spec(
                "operator", "grpc", self.slot, self.run_dir, host=self.operator_host
            )
            metrics = self.operator_metrics or _listen_spec(
                "operator", "metrics", self.slot, self.run_dir
            )
        self.operator.start(
            [
                str(VENV_BIN / "cilia-operator"),
                "serve",
                "--store",
                self.redis_url,
                "--listen",
                listen,
                "--prometheus-serve-addr",
                metrics,
                *self._pool_flags(),
                "--log-level",
                "info",
                *self.operator_tls_args(),
                *self.operator_args,
                *extra,
            ]
        )
        self.record(self.operator)
        self.operator.wait_ready(
            lambda: (
                {"grpc", "metrics"}
                <= read_listeners(self.operator.log, self.operator.offset).keys()
            ),
            self.ready_seconds,
        )
        found = read_listeners(self.operator.log, self.operator.offset)
        self.operator_address, self.operator_metrics = found["grpc"], found["metrics"]

    def _pool_flags(self) -> list[str]:
        if not self.auto_pool:
            return []
        return [
            "--auto-create-cilium-pod-ip-pools",
            f"default=ipv4-cidrs:{self.pool_cidr};ipv4-mask-size:{self.mask_size}",
            "--ipam-default-ip-pool",
            "default",
        ]

    def start_relay(self) -> None:
        """Start cilia-relay peering with agent 0's Hubble socket; ready once it logged its
        listeners (``"listening"``)."""
        if self.shared:
            observer, health = SHARED_RELAY, SHARED_RELAY_HEALTH
        else:
            observer = self.relay_address or _listen_spec(
                "relay", "observer", self.slot, self.run_dir / "relay.sock"
            )
            health = self.relay_health_address or _listen_spec(
                "relay", "health", self.slot, self.run_dir / "relay-health.sock"
            )
        self.relay.start(
            [
                str(VENV_BIN / "cilia-relay"),
                "serve",
                "--peer-service",
                f"unix:{self.agent.hubble_socket}",
                "--listen-address",
                observer,
                "--health-listen-address",
                health,
                "--log-level",
                "info",
                *self.relay_tls_args(),
                *self.relay_args,
            ]
        )
        self.record(self.relay)
        wanted = {"observer", "health"} - {listener for (c, listener) in ANNOUNCED if c == "relay"}

        def ready() -> bool:
            found = read_listeners(self.relay.log, self.relay.offset)
            if wanted == {"observer", "health"}:
                return _logged(self.relay.log, self.relay.offset, "listening")
            return {"observer", "health"} - wanted <= found.keys()

        self.relay.wait_ready(ready, self.ready_seconds)
        found = read_listeners(self.relay.log, self.relay.offset)
        self.relay_address = found.get("observer", observer)
        self.relay_health_address = found.get("health", health)

    def add_agent(self, *, node_name: str | None = None, netns: str = "") -> Agent:
        """Add one more agent (another node of this stack's operator), not started yet:
        call :meth:`Agent.start`. :meth:`stop` stops it with the others. ``node_name`` and
        ``netns`` as for :class:`Agent`.

        Raises:
            StackError: the stack already has :data:`MAX_AGENTS` agents.
        """
        if len(self.agents) >= MAX_AGENTS:
            raise StackError(f"a stack runs at most {MAX_AGENTS} agents")
        agent = Agent(self, len(self.agents), node_name=node_name, netns=netns)
        agent.remove_leftovers()
        self.agents.append(agent)
        if self.tls or self.hubble_tls:
            self.issue_certs()
        return agent

    def restart(self, component: str) -> None:
        """Stop and start ``component`` (``redis``, ``operator``, ``agent``/``agent<i>``,
        ``relay``) with the same flags and addresses; wait until ready."""
        self.stop_component(component)
        self.start_component(component)

    def start_component(self, component: str) -> None:
        """Start one stopped component again and wait until it is ready.

        Raises:
            StackError: unknown component, or it failed to start.
        """
        if component == "redis":
            self.start_redis()
        elif component == "operator":
            self.start_operator()
        elif component == "relay":
            self.start_relay()
        else:
            self._agent(component).start()

    def stop_component(self, component: str) -> None:
        """SIGTERM (then SIGKILL) one component; idempotent."""
        self._process(component).stop()

    def kill(self, component: str) -> int:
        """SIGKILL one component and wait until it is gone; returns its pid."""
        return self._process(component).kill()

    def pid(self, component: str) -> int | None:
        """The pid of a running component, else None."""
        return self._process(component).pid

    def _process(self, component: str) -> Process:
        try:
            return self.components()[component]
        except KeyError:
            raise StackError(f"no component {component!r} in this stack") from None

    def _agent(self, component: str) -> Agent:
        for agent in self.agents:
            if agent.process.name == component:
                return agent
        raise StackError(f"no agent {component!r} in this stack")

    def stop(self) -> None:
        """Stop everything in reverse order, remove agents' pins and devices, the run dir
        (unless given or ``keep_run_dir``), and release the slot. Idempotent. The shared
        stack keeps its run dir, pins and device (a restart restores from them)."""
        self.relay.stop()
        for agent in reversed(self.agents):
            agent.stop()
        self.operator.stop()
        self.redis.stop()
        if self.shared:
            return
        for agent in self.agents:
            agent.remove_leftovers()
        if self._given_run_dir is None and not self.keep_run_dir and self.run_dir.parts:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.slot >= 0:
            (SLOT_DIR / f"{self.slot}.pids").write_text("")  # all stopped: nothing to reap
        self._exit.close()
        self.slot = -1
        self._prepared = False
        self.started = False

    # -- clients --------------------------------------------------------------------------

    def operator_cli(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """``cilia-operator ARGV --server <this operator>`` (with the admin's TLS files when
        :attr:`tls`); never raises on the exit status."""
        return subprocess.run(
            [
                str(VENV_BIN / "cilia-operator"),
                *argv,
                "--server",
                self.operator_address,
                *self.client_tls_args(),
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def agent_cli(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """``cilia-agent ARGV`` against agent 0 (:meth:`Agent.cli`)."""
        return self.agent.cli(*argv, timeout=timeout)

    def logs(self, lines: int = 20) -> str:
        """The tail of every component's log of its latest start, for assertion messages."""
        return "\n".join(p.tail(lines) for p in self.components().values())

    def describe(self) -> str:
        """One line: run dir, pool, operator and relay addresses, agents' sockets and pins."""
        agents = ", ".join(f"{a.node_name}: {a.socket} pins {a.pin_dir}" for a in self.agents)
        return (
            f"run dir {self.run_dir}, pool {self.pool_cidr}, operator {self.operator_address}, "
            f"relay {self.relay_address or '-'}, agents [{agents}]"
        )


# ---------------------------------------------------------------------------------------
# The user's stack of ``scripts/stack.sh`` / ``make up``: fixed ports, ``.run/``.


def stack_sh(
    *argv: str, check: bool = True, timeout: float = 180.0
) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/stack.sh ARGV`` (the ``make up`` stack); stdout/stderr captured as text.

    Raises:
        subprocess.CalledProcessError: it failed and ``check`` (stderr has the log tail).
    """
    return subprocess.run(
        [str(ROOT / "scripts" / "stack.sh"), *argv],
        capture_output=True,
        text=True,
        check=check,
        timeout=timeout,
    )


__all__ = [
    "ANNOUNCED",
    "MAX_AGENTS",
    "READY_SECONDS",
    "SHARED_AGENT_SOCKET",
    "SHARED_CONFLIST",
    "SHARED_OPERATOR",
    "SHARED_POOL",
    "SHARED_REDIS_PORT",
    "SHARED_RELAY",
    "SHARED_RELAY_HEALTH",
    "SHARED_RUN",
    "SLOTS",
    "SLOT_DIR",
    "SLOT_PORT_BASE",
    "Agent",
    "Process",
    "Stack",
    "StackError",
    "read_listeners",
    "stack_sh",
]
