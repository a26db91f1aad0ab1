"""Persistent agent state: one JSON file per endpoint plus one node file.

Layout under ``--state-dir``::

    node.json                     NodeState (router IP, last allocation)
    endpoints/<key-hash>.json     one EndpointRecord per attachment

Every write is atomic (temporary file in the same directory, ``fsync``,
``rename``), so a crash leaves either the old or the new file, never a torn one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cilia_agent.node.state import NodeState

log = logging.getLogger(__name__)

EndpointStateName = Literal["creating", "ready", "disconnecting"]

NODE_FILE = "node.json"
ENDPOINTS_DIR = "endpoints"


class StateError(Exception):
    """A state file could not be read or written (path and reason in the message)."""


def attachment_hash(container_id: str, ifname: str) -> str:
    """Return sha256 hex of ``container_id + "/" + ifname`` (the attachment key)."""
    return hashlib.sha256(f"{container_id}/{ifname}".encode()).hexdigest()


class EndpointRecord(BaseModel):
    """One endpoint (pod attachment) as persisted and as listed by the debug API.

    ``state`` is ``creating`` while the datapath is being plumbed, ``ready``
    once Add succeeded, ``disconnecting`` while Del runs (upstream endpoint
    states, reference: cilium-upstream.md §8). ``identity`` is the security identity the
    operator allocated for the endpoint's filtered labels (0 = none: BPF disabled).
    ``ipv4`` is the bare address (no prefix); ``pool`` is "" for chained endpoints.
    """

    model_config = ConfigDict(extra="ignore")

    id: int = Field(ge=1)
    container_id: str
    ifname: str
    netns: str
    ipv4: str
    pool: str
    host_ifname: str
    host_mac: str = ""
    container_mac: str = ""
    mtu: int = 1500
    labels: dict[str, str] = Field(default_factory=dict)
    pod_namespace: str = ""
    pod_name: str = ""
    identity: int = Field(default=0, ge=0)
    state: EndpointStateName = "creating"
    chained: bool = False
    """Chained attachment (generic-veth): the interface and the address belong to the
    previous plugin; Del detaches the datapath but neither deletes the veth nor
    releases the address."""
    prev_result: str = ""
    """Chained only: the previous plugin's CNI result (JSON), passed through in Add."""
    created_at_ms: int = Field(default=0, ge=0)
    """When the Add started (Unix ms; 0 in files of older agents). A queued DEL older
    than this belongs to an earlier attachment of the same key and is skipped."""

    @property
    def key(self) -> tuple[str, str]:
        """The attachment key ``(container_id, ifname)``."""
        return (self.container_id, self.ifname)


def atomic_write(
    path: pathlib.Path, data: bytes, mode: int = 0o600, *, durable: bool = False
) -> None:
    """Write ``data`` to ``path`` atomically (tmp file, rename).

    The rename makes the write atomic against a crash of the process: readers
    see the old or the new content, never a torn file. With ``durable`` the
    file and its directory are also ``fsync``-ed, so the write survives a power
    loss (the state dir normally lives on tmpfs under /var/run, where pods'
    network namespaces do not survive a reboot either; see ``--state-fsync``).

    Raises:
        StateError: the file could not be written.
    """
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            os.write(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        if durable:
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StateError(f"cannot write {path}: {exc.strerror or exc}") from exc


class StateStore:
    """Reads and writes the agent's state files under ``root``.

    Args:
        root: the ``--state-dir`` (created with mode 0700 when missing).
        durable: fsync every write (``--state-fsync``), see :func:`atomic_write`.

    Raises:
        StateError: ``root`` cannot be created.
    """

    def __init__(self, root: pathlib.Path, *, durable: bool = False) -> None:
        self.root = root
        self.durable = durable
        self.endpoints_dir = root / ENDPOINTS_DIR
        try:
            self.endpoints_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise StateError(f"cannot create state dir {self.endpoints_dir}: {exc}") from exc

    def endpoint_path(self, container_id: str, ifname: str) -> pathlib.Path:
        """Path of the state file of attachment ``(container_id, ifname)``."""
        return self.endpoints_dir / f"{attachment_hash(container_id, ifname)[:32]}.json"

    def write_endpoint(self, record: EndpointRecord) -> None:
        """Persist ``record`` atomically. Raises StateError."""
        atomic_write(
            self.endpoint_path(record.container_id, record.ifname),
            record.model_dump_json(indent=1).encode(),
            durable=self.durable,
        )

    def remove_endpoint(self, container_id: str, ifname: str) -> None:
        """Remove the state file of an attachment; absent files are fine."""
        self.endpoint_path(container_id, ifname).unlink(missing_ok=True)

    def load_endpoints(self) -> tuple[list[EndpointRecord], list[pathlib.Path]]:
        """Return ``(records, unreadable_paths)`` of every endpoint state file.

        Unreadable or invalid files are returned, not raised, so one bad file
        never blocks a restore; leftover temporary files are removed.
        """
        records: list[EndpointRecord] = []
        bad: list[pathlib.Path] = []
        for path in sorted(self.endpoints_dir.iterdir()):
            if path.name.startswith("."):
                path.unlink(missing_ok=True)
                continue
            if path.suffix != ".json":
                continue
            try:
                records.append(EndpointRecord.model_validate_json(path.read_bytes()))
            except (OSError, ValidationError, ValueError) as exc:
                log.warning(
                    "unreadable endpoint state file", extra={"path": str(path), "reason": str(exc)}
                )
                bad.append(path)
        return records, bad

    def write_node(self, state: NodeState) -> None:
        """Persist the node state atomically. Raises StateError."""
        atomic_write(
            self.root / NODE_FILE, state.model_dump_json(indent=1).encode(), durable=self.durable
        )

    def load_node(self) -> NodeState:
        """Return the persisted node state, or an empty one when absent.

        Raises:
            StateError: the file exists but is not valid node state.
        """
        path = self.root / NODE_FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return NodeState()
        except OSError as exc:
            raise StateError(f"cannot read {path}: {exc}") from exc
        try:
            return NodeState.model_validate(json.loads(raw))
        except (ValueError, ValidationError) as exc:
            raise StateError(f"invalid node state {path}: {exc}") from exc
