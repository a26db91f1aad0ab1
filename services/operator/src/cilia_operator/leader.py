"""Leader election: at most one operator replica runs the leader-only controllers.

Two locks, one loop (the client-go leaderelection algorithm, re-implemented):

- :class:`RedisLock` (``--store redis://...``): key ``<prefix>leader`` holding the
  leader's identity, taken with ``SET NX PX <lease>`` and renewed/released by Lua
  compare-and-set scripts, so only the holder can extend or drop it. The key's TTL is
  kept by Redis itself: a crashed leader's lock disappears ``lease_duration`` after its
  last renewal.
- :class:`KubernetesLease` (``--store kubernetes``): a ``coordination.k8s.io/v1`` Lease
  written through the Store with resourceVersion preconditions (409 = someone else won).
  A follower takes the Lease over when its record has not changed for
  ``lease_duration`` seconds of the follower's own clock (as client-go does: no clock
  comparison between nodes).

:class:`LeaderElector` tries to acquire every ``retry_period``; the leader renews every
``retry_period`` and steps down when it could not renew for ``renew_deadline`` seconds
(``renew_deadline < lease_duration``, so it stops before anyone else may start) or when
the lock shows another holder. Upstream flags and defaults: ``--leader-election-lease-
duration`` 15s, ``--leader-election-renew-deadline`` 10s, ``--leader-election-retry-
period`` 2s. Like upstream cilium-operator, a replica that lost the lease does not
compete again: :attr:`LeaderElector.lost` is set and the process exits to restart clean.

Source: k8s.io/client-go/tools/leaderelection (semantics), Redis "SET NX PX" lock pattern.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import datetime as _dt
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from .store import AlreadyExists, Conflict, NotFound, Store, StoreError

log = logging.getLogger(__name__)

Callback = Callable[[], Awaitable[None]]


def default_identity() -> str:
    """``<hostname>-<random>``: unique per process, readable in the lock."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}-{uuid.uuid4().hex[:8]}"


class Lock(abc.ABC):
    """One leader lock. Every method returns False instead of raising on store errors."""

    @abc.abstractmethod
    async def try_acquire_or_renew(self, identity: str) -> bool:
        """Take the lock (free or expired) or renew it (held by ``identity``); True if held."""

    @abc.abstractmethod
    async def release(self, identity: str) -> None:
        """Drop the lock if ``identity`` holds it (graceful stop: a follower takes over at once)."""

    @abc.abstractmethod
    async def holder(self) -> str:
        """Identity of the current holder, ``""`` when free or unknown."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections."""


_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class RedisLock(Lock):
    """Leader lock in Redis (SET NX PX + Lua compare-and-set renew/release).

    Args:
        url: the store's Redis URL; key: the lock key (``<prefix>leader``).
        lease_duration: seconds the lock lives without renewal (> 0).
        request_timeout: seconds per Redis call (> 0).
    """

    def __init__(self, url: str, key: str, lease_duration: float, request_timeout: float = 5.0):
        self.key = key
        self._ttl_ms = max(1, int(lease_duration * 1000))
        self._r: Any = aioredis.Redis.from_url(
            url,
            decode_responses=True,
            socket_connect_timeout=request_timeout,
            socket_timeout=request_timeout,
        )
        self._renew = self._r.register_script(_RENEW)
        self._release = self._r.register_script(_RELEASE)

    async def try_acquire_or_renew(self, identity: str) -> bool:
        try:
            if await self._r.set(self.key, identity, nx=True, px=self._ttl_ms):
                return True
            return bool(await self._renew(keys=[self.key], args=[identity, self._ttl_ms]))
        except redis.exceptions.RedisError as exc:
            log.warning("leader lock: redis error", extra={"error": str(exc)})
            return False

    async def release(self, identity: str) -> None:
        with contextlib.suppress(redis.exceptions.RedisError):
            await self._release(keys=[self.key], args=[identity])

    async def holder(self) -> str:
        try:
            return str(await self._r.get(self.key) or "")
        except redis.exceptions.RedisError:
            return ""

    async def close(self) -> None:
        await self._r.aclose()


def _micro_time(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, _dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class KubernetesLease(Lock):
    """Leader lock as a ``coordination.k8s.io/v1`` Lease in any :class:`Store` that maps
    the ``Lease`` kind (the Kubernetes store does).

    Args:
        store: the Store; name / namespace: the Lease object.
        lease_duration: seconds (``spec.leaseDurationSeconds``, rounded up).
    """

    def __init__(self, store: Store, name: str, namespace: str, lease_duration: float) -> None:
        self.store, self.name, self.namespace = store, name, namespace
        self.lease_duration = lease_duration
        self._observed_rv = ""
        self._observed_at = 0.0

    def _spec(self, identity: str, previous: dict[str, Any] | None) -> dict[str, Any]:
        now = time.time()
        prev = previous or {}
        same = prev.get("holderIdentity") == identity
        transitions = int(prev.get("leaseTransitions") or 0) + (0 if same or not prev else 1)
        return {
            "holderIdentity": identity,
            "leaseDurationSeconds": max(1, int(-(-self.lease_duration // 1))),
            "acquireTime": prev.get("acquireTime") if same else _micro_time(now),
            "renewTime": _micro_time(now),
            "leaseTransitions": transitions,
        }

    async def try_acquire_or_renew(self, identity: str) -> bool:
        try:
            try:
                current = await self.store.get("Lease", self.name, self.namespace)
            except NotFound:
                await self.store.create(
                    {
                        "apiVersion": "coordination.k8s.io/v1",
                        "kind": "Lease",
                        "metadata": {"name": self.name, "namespace": self.namespace},
                        "spec": self._spec(identity, None),
                    }
                )
                return True
            rv = str(current["metadata"].get("resourceVersion") or "")
            now = time.monotonic()
            if rv != self._observed_rv:
                self._observed_rv, self._observed_at = rv, now
            spec = current.get("spec") or {}
            holder = spec.get("holderIdentity") or ""
            expired = now - self._observed_at > self.lease_duration
            if holder and holder != identity and not expired:
                return False
            updated = dict(current, spec=self._spec(identity, spec))
            stored = await self.store.update(updated)
            self._observed_rv = str(stored["metadata"].get("resourceVersion") or "")
            self._observed_at = time.monotonic()
            return True
        except (AlreadyExists, Conflict):
            return False
        except StoreError as exc:
            log.warning("leader lease: store error", extra={"error": str(exc)})
            return False

    async def release(self, identity: str) -> None:
        with contextlib.suppress(StoreError):
            current = await self.store.get("Lease", self.name, self.namespace)
            spec = dict(current.get("spec") or {})
            if spec.get("holderIdentity") != identity:
                return
            spec["holderIdentity"] = ""
            await self.store.update(dict(current, spec=spec))

    async def holder(self) -> str:
        try:
            current = await self.store.get("Lease", self.name, self.namespace)
        except StoreError:
            return ""
        return str((current.get("spec") or {}).get("holderIdentity") or "")

    async def close(self) -> None:
        """Nothing to release: the Store belongs to the operator."""


class LeaderElector:
    """Runs ``on_started`` once this replica holds the lock, ``on_stopped`` when it loses
    it (or on :meth:`stop`).

    Args:
        lock: :class:`RedisLock` or :class:`KubernetesLease`.
        identity: this replica's name in the lock (default :func:`default_identity`).
        lease_duration / renew_deadline / retry_period: seconds, with
            ``0 < retry_period < renew_deadline < lease_duration``.
        on_started / on_stopped: coroutines; on_stopped runs only after on_started.

    Raises:
        ValueError: the durations are not ordered as above (message names the flags).
    """

    def __init__(
        self,
        lock: Lock,
        *,
        identity: str = "",
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
        on_started: Callback,
        on_stopped: Callback,
    ) -> None:
        validate_durations(lease_duration, renew_deadline, retry_period)
        self.lock = lock
        self.identity = identity or default_identity()
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self._on_started, self._on_stopped = on_started, on_stopped
        self._leader = False
        self._task: asyncio.Task[None] | None = None
        self.lost = asyncio.Event()
        """Set when leadership was lost (not by :meth:`stop`): the process should exit."""

    @property
    def is_leader(self) -> bool:
        """Whether this replica currently leads (leader-only controllers run)."""
        return self._leader

    def start(self) -> None:
        """Start competing in the background."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="leader-election")

    async def _run(self) -> None:
        last_renew = time.monotonic()
        while True:
            held = await self.lock.try_acquire_or_renew(self.identity)
            now = time.monotonic()
            if held:
                last_renew = now
                if not self._leader:
                    self._leader = True
                    log.info("became leader", extra={"identity": self.identity})
                    try:
                        await self._on_started()
                    except Exception as exc:
                        log.error("leader start-up failed; stepping down",
                                  extra={"identity": self.identity, "error": str(exc)})  # fmt: skip
                        self._leader = False
                        await self._on_stopped()
                        await self.lock.release(self.identity)
                        self.lost.set()
                        return
            elif self._leader:
                other = await self.lock.holder()
                if (other and other != self.identity) or now - last_renew >= self.renew_deadline:
                    log.error(
                        "leader election lost",
                        extra={"identity": self.identity, "holder": other or "unknown"},
                    )
                    self._leader = False
                    await self._on_stopped()
                    self.lost.set()
                    return
            await asyncio.sleep(self.retry_period)

    async def stop(self, release: bool = True) -> None:
        """Stop competing; run ``on_stopped`` if leading; drop the lock when ``release``
        (False simulates a crash: followers wait for the lease to expire)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self._leader:
            self._leader = False
            await self._on_stopped()
            if release:
                await self.lock.release(self.identity)
        await self.lock.close()


def validate_durations(lease_duration: float, renew_deadline: float, retry_period: float) -> None:
    """Check ``0 < retry_period < renew_deadline < lease_duration`` (client-go's rule).

    Raises:
        ValueError: naming the flags.
    """
    if not 0 < retry_period < renew_deadline < lease_duration:
        raise ValueError(
            "--leader-election-retry-period < --leader-election-renew-deadline < "
            f"--leader-election-lease-duration is required (got {retry_period}, "
            f"{renew_deadline}, {lease_duration})"
        )
