"""KubeMock: an in-memory Kubernetes API server over real HTTP, for tests.

What it implements (the protocol the official ``kubernetes`` client speaks):

- one global, strictly increasing ``resourceVersion`` (decimal strings ``"1"``, ``"2"``...)
  bumped by every write of any object;
- create ``POST`` (201; 409 ``AlreadyExists``; ``generateName``), get (404 ``NotFound``),
  list (``metadata.resourceVersion`` = the current global version),
  replace ``PUT`` (409 ``Conflict`` when ``metadata.resourceVersion`` is set and stale;
  empty = unconditional), ``PATCH`` (merge, strategic-merge simple cases, JSON patch;
  a ``metadata.resourceVersion`` in a merge patch is a precondition), delete (200 with
  the last state; ``preconditions.resourceVersion``/``uid`` → 409), ``/status``
  subresources for the types that have one;
- deletion with finalizers (``deletionTimestamp`` set, object kept until the last
  finalizer is removed) and, for pods, an optional termination delay
  (``pod_termination_delay`` seconds: the pod is first MODIFIED with a
  ``deletionTimestamp``, then DELETED; ``gracePeriodSeconds=0`` deletes at once);
- watch (``?watch=true``): without ``resourceVersion`` (or ``"0"``) synthetic ``ADDED``
  events for the current objects then every change; with ``resourceVersion=N`` every
  change after N in order, or -- when the history after N was trimmed
  (``event_history``, or :meth:`KubeMock.compact`) -- an ``ERROR`` event carrying a
  ``Status`` with ``code: 410`` / ``reason: Expired`` (what the real server sends; the
  official client's ``Watch.stream`` raises ``ApiException(status=410)``).
  ``timeoutSeconds`` ends the stream; ``allowWatchBookmarks=true`` adds ``BOOKMARK``
  events every ``bookmark_interval`` seconds;
- ``labelSelector`` and ``fieldSelector`` on list and watch (a watched object that
  starts/stops matching is reported ADDED/DELETED, as the real server does);
- discovery: ``/version``, ``/api``, ``/api/v1``, ``/apis``, ``/apis/G``, ``/apis/G/V``;
  creating a ``CustomResourceDefinition`` serves its kind at once.

Not implemented: authentication, admission/validation of object bodies, ``limit`` /
``continue`` (lists are returned whole), server-side apply, ``deletecollection``,
namespace existence checks, garbage collection by ownerReferences, watch caches per
version (a list's resourceVersion is always the latest).

Source: Kubernetes API concepts (resourceVersion, watch, 410 Gone) -- semantics only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import datetime as _dt
import json
import secrets
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from .patch import PatchError, json_patch, merge_patch, strategic_merge_patch
from .resources import DEFAULT_TYPES, ResourceType, types_from_crd
from .selectors import SelectorError, field_selector, label_selector

Obj = dict[str, Any]
T = TypeVar("T")
_GKey = tuple[str, str]  # (group, plural)
_OKey = tuple[str, str, str, str]  # (group, plural, namespace, name)


class ApiError(Exception):
    """An API failure answered as a ``Status`` object.

    Attributes: code (HTTP status), reason (``NotFound``, ``AlreadyExists``,
    ``Conflict``, ``BadRequest``, ``Invalid``, ``Expired``, ``MethodNotAllowed``...).
    """

    def __init__(
        self, code: int, reason: str, message: str, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.details = details or {}

    def status(self) -> Obj:
        """The ``v1.Status`` body."""
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": self.details,
            "code": self.code,
        }


@dataclass(frozen=True)
class _Event:
    rv: int
    gkey: _GKey
    type: str
    obj: Obj
    old: Obj | None


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _meta(obj: Obj) -> dict[str, Any]:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        meta = obj["metadata"] = {}
    return meta


def _body_of(obj: Obj) -> Obj:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "kind", "apiVersion")}


class KubeMock:
    """The mock API server. Start it in a background thread with :meth:`start`.

    Args:
        event_history: change events kept (all kinds together) for watches from a
            resourceVersion; an older start gets 410 Expired (>= 1).
        pod_termination_delay: seconds a deleted pod stays with a ``deletionTimestamp``
            before it is removed (0 = removed at once; ``gracePeriodSeconds=0`` always
            removes at once).
        bookmark_interval: seconds between ``BOOKMARK`` events on watches that ask for
            them (> 0).
        types: served resource types (default: :data:`~cilia_kubemock.resources.DEFAULT_TYPES`).
        host: address to listen on.
        port: TCP port, 0 = a free one.

    Attributes (after start): url (``http://127.0.0.1:PORT``), port.
    """

    def __init__(
        self,
        *,
        event_history: int = 1000,
        pod_termination_delay: float = 0.0,
        bookmark_interval: float = 1.0,
        types: Iterable[ResourceType] = DEFAULT_TYPES,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if event_history < 1:
            raise ValueError(f"event_history must be >= 1, got {event_history}")
        if pod_termination_delay < 0 or bookmark_interval <= 0:
            raise ValueError("pod_termination_delay must be >= 0 and bookmark_interval > 0")
        self.event_history = event_history
        self.pod_termination_delay = pod_termination_delay
        self.bookmark_interval = bookmark_interval
        self.host, self.port = host, port
        self.url = ""
        self._types: dict[tuple[str, str, str], ResourceType] = {}
        for t in types:
            self.add_type(t)
        self._objects: dict[_OKey, Obj] = {}
        self._rv = 0
        self._events: collections.deque[_Event] = collections.deque()
        self._trimmed_rv = 0
        self._changed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._stopping: asyncio.Event | None = None
        self._pending_pods: set[_OKey] = set()
        self.requests: list[tuple[str, str]] = []
        """(method, path?query) of every request served, in order (for assertions)."""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> str:
        """Serve in a daemon thread with its own event loop; returns the base URL."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self.start_async())
            except BaseException as exc:  # reported to the starting thread
                failure.append(exc)
                ready.set()
                return
            ready.set()
            assert self._stopping is not None
            loop.run_until_complete(self._stopping.wait())
            loop.run_until_complete(self._shutdown())
            loop.close()

        self._thread = threading.Thread(target=run, name="kubemock", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        return self.url

    async def start_async(self) -> str:
        """Serve on the running event loop (for async callers); returns the base URL."""
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._stopping = asyncio.Event()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server
        assert server is not None
        self.port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    async def _shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def stop_async(self) -> None:
        """Stop serving (async counterpart of :meth:`stop`, same loop as start_async)."""
        if self._stopping is not None:
            self._stopping.set()
        if self._thread is None:
            await self._shutdown()

    def stop(self) -> None:
        """Stop the server thread; open watches end."""
        if self._loop is not None and self._stopping is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> KubeMock:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ types

    def add_type(self, rtype: ResourceType) -> None:
        """Serve another resource type (e.g. a test CRD); replaces one of the same G/V/plural."""
        self._types[(rtype.group, rtype.version, rtype.plural)] = rtype

    def types(self) -> list[ResourceType]:
        """Every served type."""
        return list(self._types.values())

    def _type_of_kind(self, kind: str, api_version: str = "") -> ResourceType:
        for t in self._types.values():
            if t.kind == kind and (not api_version or t.api_version == api_version):
                return t
        raise KeyError(f"kind {kind!r} {api_version} is not served by the mock")

    # ------------------------------------------------------------------ thread-safe test API

    def _call(self, fn: Callable[[], T]) -> T:
        loop = self._loop
        if loop is None:
            return fn()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            return fn()

        async def call() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout=10)

    def resource_version(self) -> str:
        """The current global resourceVersion."""
        return self._call(lambda: str(self._rv))

    def objects(self, kind: str, namespace: str | None = None, api_version: str = "") -> list[Obj]:
        """Copies of the stored objects of ``kind`` (all namespaces when None)."""
        t = self._type_of_kind(kind, api_version)
        return self._call(lambda: [copy.deepcopy(o) for o in self._select(t, namespace)])

    def get_object(self, kind: str, name: str, namespace: str = "", api_version: str = "") -> Obj:
        """A copy of one stored object.

        Raises:
            ApiError: 404 when absent.
        """
        t = self._type_of_kind(kind, api_version)
        return self._call(lambda: copy.deepcopy(self._get(t, namespace, name)))

    def put_object(self, obj: Obj) -> Obj:
        """Create ``obj`` or replace it unconditionally (as a controller would); returns it.

        The type is found from ``kind`` (and ``apiVersion``). Emits ADDED or MODIFIED.
        """
        t = self._type_of_kind(str(obj.get("kind")), str(obj.get("apiVersion") or ""))
        ns = str(_meta(obj).get("namespace") or "")
        name = str(_meta(obj).get("name") or "")

        def put() -> Obj:
            body = copy.deepcopy(obj)
            _meta(body).pop("resourceVersion", None)
            if (t.group, t.plural, ns, name) in self._objects:
                return self._update(t, ns, name, body, subresource="", raw=True)
            return self._create(t, ns, body, raw=True)

        return self._call(put)

    def delete_object(
        self, kind: str, name: str, namespace: str = "", api_version: str = ""
    ) -> Obj:
        """Delete at once (no finalizers, no termination delay); returns the last state."""
        t = self._type_of_kind(kind, api_version)
        return self._call(lambda: self._remove(t, namespace, name))

    def compact(self) -> str:
        """Drop the whole watch history (as etcd compaction does); returns the version
        from which watches still work. Watches from any older version get 410."""

        def run() -> str:
            self._events.clear()
            self._trimmed_rv = self._rv
            self._notify()
            return str(self._rv)

        return self._call(run)

    # ------------------------------------------------------------------ storage core

    def _select(self, t: ResourceType, namespace: str | None) -> list[Obj]:
        out = [
            obj
            for (g, p, ns, _), obj in self._objects.items()
            if g == t.group and p == t.plural and (namespace is None or ns == namespace)
        ]
        out.sort(key=lambda o: (_meta(o).get("namespace", ""), _meta(o)["name"]))
        return [self._served(t, o) for o in out]

    def _served(self, t: ResourceType, obj: Obj) -> Obj:
        if obj.get("apiVersion") == t.api_version:
            return obj
        out = dict(obj)
        out["apiVersion"] = t.api_version
        return out

    def _get(self, t: ResourceType, ns: str, name: str) -> Obj:
        obj = self._objects.get((t.group, t.plural, ns, name))
        if obj is None:
            raise self._not_found(t, name)
        return self._served(t, obj)

    def _not_found(self, t: ResourceType, name: str) -> ApiError:
        what = f"{t.plural}.{t.group}" if t.group else t.plural
        return ApiError(
            404,
            "NotFound",
            f'{what} "{name}" not found',
            {"name": name, "group": t.group, "kind": t.plural},
        )

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    def _record(self, t: ResourceType, etype: str, obj: Obj, old: Obj | None) -> None:
        self._events.append(_Event(self._rv, (t.group, t.plural), etype, obj, old))
        while len(self._events) > self.event_history:
            self._trimmed_rv = self._events.popleft().rv
        self._notify()

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _create(self, t: ResourceType, ns: str, body: Obj, raw: bool = False) -> Obj:
        meta = _meta(body)
        if t.status_subresource and not raw:
            body.pop("status", None)  # ignored on create, as the real server does
        if t.namespaced:
            if meta.get("namespace") and meta["namespace"] != ns:
                raise ApiError(
                    400,
                    "BadRequest",
                    f"the namespace of the provided object ({meta['namespace']}) does not "
                    f"match the namespace sent on the request ({ns})",
                )
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{secrets.token_hex(3)[:5]}"
        name = meta.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(
                422, "Invalid", "metadata.name: Required value: name or generateName is required"
            )
        key = (t.group, t.plural, ns if t.namespaced else "", name)
        if key in self._objects:
            what = f"{t.plural}.{t.group}" if t.group else t.plural
            raise ApiError(
                409,
                "AlreadyExists",
                f'{what} "{name}" already exists',
                {"name": name, "group": t.group, "kind": t.plural},
            )
        if meta.get("resourceVersion"):
            raise ApiError(
                422, "Invalid", "metadata.resourceVersion: Invalid value: must not be set on create"
            )
        if t.kind == "CustomResourceDefinition":
            try:
                for crd_type in types_from_crd(body):
                    self.add_type(crd_type)
            except ValueError as exc:
                raise ApiError(422, "Invalid", f"CustomResourceDefinition: {exc}") from None
        body["apiVersion"], body["kind"] = t.api_version, t.kind
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["generation"] = 1
        meta.pop("deletionTimestamp", None)
        meta["resourceVersion"] = self._next_rv()
        self._objects[key] = body
        self._record(t, "ADDED", copy.deepcopy(body), None)
        return copy.deepcopy(body)

    def _check_precondition(self, t: ResourceType, current: Obj, expected: str) -> None:
        cur = str(_meta(current)["resourceVersion"])
        if expected and expected != cur:
            what = f"{t.plural}.{t.group}" if t.group else t.plural
            name = _meta(current)["name"]
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {what} "{name}": the object has been '
                "modified; please apply your changes to the latest version and try again",
                {"name": name, "group": t.group, "kind": t.plural},
            )

    def _update(
        self,
        t: ResourceType,
        ns: str,
        name: str,
        body: Obj,
        subresource: str,
        raw: bool = False,
    ) -> Obj:
        key = (t.group, t.plural, ns if t.namespaced else "", name)
        current = self._objects.get(key)
        if current is None:
            raise self._not_found(t, name)
        meta = _meta(body)
        if meta.get("name") not in (None, name):
            raise ApiError(
                400,
                "BadRequest",
                f"the name of the object ({meta.get('name')}) does not match the name on "
                f"the URL ({name})",
            )
        self._check_precondition(t, current, str(meta.get("resourceVersion") or ""))
        cur_meta = _meta(current)
        if subresource == "status":
            new = copy.deepcopy(current)
            if "status" in body:
                new["status"] = copy.deepcopy(body["status"])
            else:
                new.pop("status", None)
        else:
            new = copy.deepcopy(body)
            new_meta = _meta(new)
            if t.status_subresource and not raw:
                if "status" in current:
                    new["status"] = copy.deepcopy(current["status"])
                else:
                    new.pop("status", None)
            for fixed in ("uid", "creationTimestamp", "generation", "deletionTimestamp",
                          "deletionGracePeriodSeconds"):  # fmt: skip
                if fixed in cur_meta:
                    new_meta[fixed] = cur_meta[fixed]
                else:
                    new_meta.pop(fixed, None)
            new_meta["name"] = name
            if t.namespaced:
                new_meta["namespace"] = ns
            else:
                new_meta.pop("namespace", None)
            if _body_of(new) != _body_of(current):
                new_meta["generation"] = int(cur_meta.get("generation", 1)) + 1
        new["apiVersion"], new["kind"] = t.api_version, t.kind
        _meta(new)["resourceVersion"] = self._next_rv()
        # last finalizer removed from a terminating object: it goes away now
        # (unless it is a pod still in its termination delay)
        terminating = _meta(new).get("deletionTimestamp") and not _meta(new).get("finalizers")
        if terminating and key not in self._pending_pods:
            self._objects.pop(key)
            self._record(t, "DELETED", copy.deepcopy(new), copy.deepcopy(current))
            return copy.deepcopy(new)
        self._objects[key] = new
        self._record(t, "MODIFIED", copy.deepcopy(new), copy.deepcopy(current))
        return copy.deepcopy(new)

    def _patch(
        self, t: ResourceType, ns: str, name: str, ctype: str, patch: Any, subresource: str
    ) -> Obj:
        current = self._objects.get((t.group, t.plural, ns if t.namespaced else "", name))
        if current is None:
            raise self._not_found(t, name)
        try:
            if ctype == "application/json-patch+json":
                new = json_patch(current, patch)
            elif ctype == "application/merge-patch+json":
                new = merge_patch(current, patch)
            elif ctype == "application/strategic-merge-patch+json":
                if "." in t.group and not t.group.endswith(".k8s.io"):  # a custom resource
                    raise ApiError(
                        415,
                        "UnsupportedMediaType",
                        "strategic merge patch is not supported for custom resources; "
                        "use application/merge-patch+json",
                    )
                new = strategic_merge_patch(current, patch)
            else:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    f"the body of the request was in an unknown format: {ctype}",
                )
        except PatchError as exc:
            raise ApiError(422, "Invalid", str(exc)) from None
        if not isinstance(new, dict):
            raise ApiError(422, "Invalid", "the patch result is not an object")
        # resourceVersion in the patch is a precondition; absent means "current".
        patched_rv = ""
        if isinstance(patch, dict):
            patched_rv = str(((patch.get("metadata") or {}).get("resourceVersion")) or "")
        _meta(new)["resourceVersion"] = patched_rv or _meta(current)["resourceVersion"]
        if ctype == "application/json-patch+json":
            _meta(new)["resourceVersion"] = _meta(current)["resourceVersion"]
        if subresource != "status" and t.status_subresource:
            new_status = new.get("status")
            if new_status != current.get("status"):
                new["status"] = copy.deepcopy(current.get("status"))
                if new["status"] is None:
                    new.pop("status")
        return self._update(t, ns, name, new, subresource)

    def _delete(self, t: ResourceType, ns: str, name: str, options: Obj) -> Obj:
        key = (t.group, t.plural, ns if t.namespaced else "", name)
        current = self._objects.get(key)
        if current is None:
            raise self._not_found(t, name)
        pre = options.get("preconditions") or {}
        self._check_precondition(t, current, str(pre.get("resourceVersion") or ""))
        if pre.get("uid") and pre["uid"] != _meta(current).get("uid"):
            raise ApiError(
                409,
                "Conflict",
                f"Precondition failed: UID in precondition: {pre['uid']}, UID in object "
                f"meta: {_meta(current).get('uid')}",
            )
        meta = _meta(current)
        grace = options.get("gracePeriodSeconds")
        is_pod = t.group == "" and t.plural == "pods"
        delay = self.pod_termination_delay if is_pod and grace != 0 else 0.0
        if meta.get("finalizers") or delay > 0:
            if meta.get("deletionTimestamp"):
                if grace == 0 and not meta.get("finalizers"):
                    return self._remove(t, ns, name)
                return copy.deepcopy(self._served(t, current))
            new = copy.deepcopy(current)
            new_meta = _meta(new)
            new_meta["deletionTimestamp"] = _now()
            new_meta["deletionGracePeriodSeconds"] = int(grace if grace is not None else 30)
            new_meta["resourceVersion"] = self._next_rv()
            self._objects[key] = new
            self._record(t, "MODIFIED", copy.deepcopy(new), copy.deepcopy(current))
            if delay > 0:
                self._pending_pods.add(key)
                uid = str(new_meta.get("uid"))
                assert self._loop is not None
                self._loop.call_later(delay, self._finish_pod, t, key, uid)
            return copy.deepcopy(new)
        return self._remove(t, ns, name)

    def _finish_pod(self, t: ResourceType, key: _OKey, uid: str) -> None:
        self._pending_pods.discard(key)
        current = self._objects.get(key)
        if current is None or _meta(current).get("uid") != uid:
            return
        if _meta(current).get("finalizers"):
            return
        self._remove(t, key[2], key[3])

    def _remove(self, t: ResourceType, ns: str, name: str) -> Obj:
        key = (t.group, t.plural, ns if t.namespaced else "", name)
        current = self._objects.pop(key, None)
        if current is None:
            raise self._not_found(t, name)
        last = copy.deepcopy(current)
        _meta(last)["resourceVersion"] = self._next_rv()
        self._record(t, "DELETED", copy.deepcopy(last), copy.deepcopy(current))
        return self._served(t, last)

    # ------------------------------------------------------------------ HTTP

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path_qs))
        try:
            return await self._route(request)
        except ApiError as exc:
            return web.json_response(exc.status(), status=exc.code)
        except SelectorError as exc:
            return web.json_response(ApiError(400, "BadRequest", str(exc)).status(), status=400)

    async def _route(self, request: web.Request) -> web.StreamResponse:
        parts = [p for p in request.path.split("/") if p]
        if not parts:
            return web.json_response({"paths": ["/api", "/api/v1", "/apis", "/version"]})
        if parts == ["version"]:
            return web.json_response(
                {
                    "major": "1",
                    "minor": "31",
                    "gitVersion": "v1.31.0-cilia-kubemock",
                    "gitCommit": "0000000000000000000000000000000000000000",
                    "gitTreeState": "clean",
                    "buildDate": "2026-01-01T00:00:00Z",
                    "goVersion": "go1.22",
                    "compiler": "gc",
                    "platform": "linux/amd64",
                }
            )
        if parts[0] in ("healthz", "readyz", "livez"):
            return web.Response(text="ok")
        if parts[0] == "api":
            if len(parts) == 1:
                return web.json_response(
                    {
                        "kind": "APIVersions",
                        "versions": ["v1"],
                        "serverAddressByClientCIDRs": [
                            {"clientCIDR": "0.0.0.0/0", "serverAddress": f"{self.host}:{self.port}"}
                        ],
                    }
                )
            if parts[1] != "v1":
                raise ApiError(404, "NotFound", f"the server could not find {request.path}")
            group, version, rest = "", "v1", parts[2:]
        elif parts[0] == "apis":
            if len(parts) == 1:
                return web.json_response(self._group_list())
            if len(parts) == 2:
                groups = {g["name"]: g for g in self._group_list()["groups"]}
                if parts[1] not in groups:
                    raise ApiError(404, "NotFound", f"the server could not find {request.path}")
                return web.json_response(
                    {"kind": "APIGroup", "apiVersion": "v1", **groups[parts[1]]}
                )
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise ApiError(404, "NotFound", f"the server could not find {request.path}")
        if not rest:
            return web.json_response(self._resource_list(group, version, request.path))
        ns: str | None = None
        if (
            rest[0] == "namespaces"
            and len(rest) >= 3
            and (t3 := self._types.get((group, version, rest[2]))) is not None
            and t3.namespaced
        ):
            ns, rest = rest[1], rest[2:]
        if len(rest) > 3:
            raise ApiError(404, "NotFound", f"the server could not find {request.path}")
        t = self._types.get((group, version, rest[0]))
        if t is None:
            raise ApiError(
                404,
                "NotFound",
                f"the server could not find the requested resource ({request.path})",
            )
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else ""
        if sub and not (sub == "status" and t.status_subresource):
            raise ApiError(404, "NotFound", f"the server could not find {request.path}")
        if t.namespaced and name is not None and ns is None:
            raise ApiError(404, "NotFound", f"the server could not find {request.path}")
        if not t.namespaced and ns is not None:
            raise ApiError(404, "NotFound", f"the server could not find {request.path}")
        method = request.method
        if name is None:
            if method == "GET":
                q = request.query
                if q.get("watch") in ("true", "1"):
                    return await self._watch(request, t, ns)
                return web.json_response(self._list(t, ns, q))
            if method == "POST":
                body = await self._json(request)
                if t.namespaced and ns is None:
                    raise ApiError(404, "NotFound", f"the server could not find {request.path}")
                created = self._create(t, ns or "", body)
                return web.json_response(created, status=201)
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on a collection")
        key_ns = ns or ""
        if method == "GET":
            return web.json_response(copy.deepcopy(self._get(t, key_ns, name)))
        if method == "PUT":
            body = await self._json(request)
            return web.json_response(self._update(t, key_ns, name, body, sub))
        if method == "PATCH":
            ctype = request.content_type
            patch = json.loads(await request.text() or "null")
            return web.json_response(self._patch(t, key_ns, name, ctype, patch, sub))
        if method == "DELETE" and not sub:
            text = await request.text()
            options = json.loads(text) if text.strip() else {}
            if "gracePeriodSeconds" in request.query:
                options["gracePeriodSeconds"] = int(request.query["gracePeriodSeconds"])
            return web.json_response(self._delete(t, key_ns, name, options))
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported here")

    async def _json(self, request: web.Request) -> Obj:
        try:
            body = json.loads(await request.text())
        except ValueError as exc:
            raise ApiError(400, "BadRequest", f"invalid JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body must be a JSON object")
        return body

    def _group_list(self) -> Obj:
        groups: dict[str, list[str]] = {}
        for t in self._types.values():
            if t.group and t.version not in groups.setdefault(t.group, []):
                groups[t.group].append(t.version)
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [
                {
                    "name": g,
                    "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
                    "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]},
                }
                for g, vs in sorted(groups.items())
            ],
        }

    def _resource_list(self, group: str, version: str, path: str) -> Obj:
        served = [t for t in self._types.values() if t.group == group and t.version == version]
        if not served:
            raise ApiError(404, "NotFound", f"the server could not find {path}")
        verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
        resources: list[Obj] = []
        for t in served:
            resources.append(
                {
                    "name": t.plural,
                    "singularName": t.singular,
                    "namespaced": t.namespaced,
                    "kind": t.kind,
                    "verbs": verbs,
                    "shortNames": list(t.short_names),
                }
            )
            if t.status_subresource:
                resources.append(
                    {
                        "name": f"{t.plural}/status",
                        "singularName": "",
                        "namespaced": t.namespaced,
                        "kind": t.kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": resources,
        }

    def _matcher(self, q: Any) -> Callable[[Obj], bool]:
        lsel = label_selector(q.get("labelSelector", ""))
        fsel = field_selector(q.get("fieldSelector", ""))
        return lambda obj: lsel(obj) and fsel(obj)

    def _list(self, t: ResourceType, ns: str | None, q: Any) -> Obj:
        match = self._matcher(q)
        items = [copy.deepcopy(o) for o in self._select(t, ns) if match(o)]
        return {
            "kind": f"{t.kind}List",
            "apiVersion": t.api_version,
            "metadata": {"resourceVersion": str(self._rv)},
            "items": items,
        }

    async def _watch(
        self, request: web.Request, t: ResourceType, ns: str | None
    ) -> web.StreamResponse:
        q = request.query
        match = self._matcher(q)
        timeout = float(q["timeoutSeconds"]) if q.get("timeoutSeconds") else None
        bookmarks = q.get("allowWatchBookmarks") in ("true", "1")
        since = q.get("resourceVersion", "")
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        gkey = (t.group, t.plural)

        def in_scope(obj: Obj | None) -> bool:
            if obj is None:
                return False
            if ns is not None and _meta(obj).get("namespace", "") != ns:
                return False
            return match(obj)

        async def send(etype: str, obj: Obj) -> None:
            line = json.dumps({"type": etype, "object": self._served(t, obj)}) + "\n"
            await resp.write(line.encode())

        try:
            if since in ("", "0"):
                last = self._rv
                for obj in [copy.deepcopy(o) for o in self._select(t, ns) if match(o)]:
                    await send("ADDED", obj)
            else:
                try:
                    last = int(since)
                except ValueError:
                    raise ApiError(
                        400, "BadRequest", f"invalid resourceVersion {since!r}"
                    ) from None
            next_bookmark = loop.time() + self.bookmark_interval
            while True:
                if last < self._trimmed_rv:
                    gone = ApiError(
                        410,
                        "Expired",
                        f"too old resource version: {last} ({self._trimmed_rv + 1})",
                    )
                    await resp.write(
                        (json.dumps({"type": "ERROR", "object": gone.status()}) + "\n").encode()
                    )
                    break
                waiter = self._changed
                assert waiter is not None
                pending = [e for e in self._events if e.rv > last]
                for ev in pending:
                    last = ev.rv
                    if ev.gkey != gkey:
                        continue
                    now_in, was_in = in_scope(ev.obj), in_scope(ev.old)
                    if ev.type == "ADDED" and now_in:
                        await send("ADDED", ev.obj)
                    elif ev.type == "DELETED" and (was_in or now_in):
                        await send("DELETED", ev.obj)
                    elif ev.type == "MODIFIED":
                        if now_in and was_in:
                            await send("MODIFIED", ev.obj)
                        elif now_in:
                            await send("ADDED", ev.obj)
                        elif was_in:
                            await send("DELETED", ev.obj)
                if pending:
                    continue
                now = loop.time()
                if deadline is not None and now >= deadline:
                    break
                if bookmarks and now >= next_bookmark:
                    mark = {
                        "kind": t.kind,
                        "apiVersion": t.api_version,
                        "metadata": {"resourceVersion": str(last)},
                    }
                    await resp.write(
                        (json.dumps({"type": "BOOKMARK", "object": mark}) + "\n").encode()
                    )
                    next_bookmark = now + self.bookmark_interval
                wait = self.bookmark_interval if bookmarks else 3600.0
                if deadline is not None:
                    wait = min(wait, deadline - now)
                stopping = self._stopping
                assert stopping is not None
                if stopping.is_set():
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(_first(waiter, stopping), timeout=max(wait, 0.0))
        except (ConnectionResetError, asyncio.CancelledError):
            return resp
        except ApiError as exc:
            await resp.write(
                (json.dumps({"type": "ERROR", "object": exc.status()}) + "\n").encode()
            )
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp


async def _first(*events: asyncio.Event) -> None:
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
