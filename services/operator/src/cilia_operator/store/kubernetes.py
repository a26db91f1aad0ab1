"""Kubernetes backend of :class:`~cilia_operator.store.base.Store` (``--store kubernetes``).

Every Store kind is a Kubernetes resource (CRDs for the cilium.io / cilia.io kinds),
read and written through the API server with the official ``kubernetes`` client's
asyncio API client (``kubernetes.aio``); paths are built per kind from :data:`KINDS`.
The API server gives the same semantics as the Redis backend:

- resourceVersion: the API server's (etcd's) global revision, a decimal string;
- create → 409 ``AlreadyExists`` → :class:`AlreadyExists`; get → 404 → :class:`NotFound`;
- update = PUT with ``metadata.resourceVersion`` (stale → 409 → :class:`Conflict`, with
  ``current`` read back); empty resourceVersion = unconditional, as in Redis;
- delete with ``preconditions.resourceVersion`` (stale → :class:`Conflict`);
- watch = ``?watch=1&resourceVersion=N&allowWatchBookmarks=true`` streams, reconnected
  from the last seen version when the server ends one (``timeoutSeconds``); an ``ERROR``
  event with code 410 → :class:`Expired` (list again);
- connection failures, timeouts and 5xx → :class:`StoreUnavailable`.

Kinds whose CRD serves a ``status`` subresource (CiliumNode, CiliumNetworkPolicy, as
upstream) get ``status`` written by a second PUT to ``/status`` after a create or update
that changed it: two writes (two watch events), each with its resourceVersion
precondition; a Conflict on the second one is raised like any other (callers retry).

One difference: ``watch(kind, "0")`` (or ``""``) starts with synthetic ADDED events for
every current object (Kubernetes' "any version" watch) instead of replaying the history
from the beginning; callers list first and watch from the list's version anyway.

Source: Kubernetes API concepts (resourceVersion, watch, 410 Gone, preconditions).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
import tenacity

from .base import (
    AlreadyExists,
    Conflict,
    Expired,
    ListResult,
    NotFound,
    Resource,
    Store,
    StoreError,
    StoreUnavailable,
    WatchEvent,
    object_key,
    resource_version,
)


@dataclass(frozen=True)
class KubeKind:
    """Where a Store kind lives in the Kubernetes API.

    Attributes:
        group: API group (``""`` = core, served under ``/api/v1``); version: ``v2``;
        plural: URL name; namespaced: whether objects live in a namespace;
        status_subresource: the CRD serves ``/status`` (the API server then ignores
            ``status`` in a create or a PUT of the object): the store writes ``status``
            with a second PUT to ``/status`` (two writes, two events, not atomic).
    """

    group: str
    version: str
    plural: str
    namespaced: bool
    status_subresource: bool = False

    @property
    def api_version(self) -> str:
        """``group/version`` (``v1`` for core)."""
        return f"{self.group}/{self.version}" if self.group else self.version

    def collection(self, namespace: str = "") -> str:
        """URL path of the collection (all namespaces when ``namespace`` is empty)."""
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            return f"{base}/namespaces/{quote(namespace, safe='')}/{self.plural}"
        return f"{base}/{self.plural}"

    def item(self, name: str, namespace: str = "") -> str:
        """URL path of one object."""
        return f"{self.collection(namespace)}/{quote(name, safe='')}"


KINDS: dict[str, KubeKind] = {
    # upstream CRDs (reference: cilium-upstream.md)
    "CiliumPodIPPool": KubeKind("cilium.io", "v2alpha1", "ciliumpodippools", False),
    "CiliumNode": KubeKind("cilium.io", "v2", "ciliumnodes", False, status_subresource=True),
    "CiliumNetworkPolicy": KubeKind(
        "cilium.io", "v2", "ciliumnetworkpolicies", True, status_subresource=True
    ),
    "CiliumClusterwideNetworkPolicy": KubeKind(
        "cilium.io", "v2", "ciliumclusterwidenetworkpolicies", False, status_subresource=True
    ),
    "CiliumIdentity": KubeKind("cilium.io", "v2", "ciliumidentities", False),
    "CiliumEndpoint": KubeKind("cilium.io", "v2", "ciliumendpoints", True),
    "CiliumEndpointSlice": KubeKind("cilium.io", "v2alpha1", "ciliumendpointslices", False),
    "CiliumNodeConfig": KubeKind("cilium.io", "v2", "ciliumnodeconfigs", True),
    # builtin kinds
    "NetworkPolicy": KubeKind("networking.k8s.io", "v1", "networkpolicies", True),
    "Namespace": KubeKind("", "v1", "namespaces", False),
    "Pod": KubeKind("", "v1", "pods", True),  # read only (PodService)
    "Node": KubeKind("", "v1", "nodes", False),  # read only (--ipam kubernetes)
    "Lease": KubeKind("coordination.k8s.io", "v1", "leases", True),
    "Event": KubeKind("", "v1", "events", True),  # created only (policy.reporter)
    # Services: the API server allocates ClusterIPs (ServiceCIDRs), kube-controller-manager
    # keeps the EndpointSlices; the operator reads them (ServiceService)
    "Service": KubeKind("", "v1", "services", True),
    "EndpointSlice": KubeKind("discovery.k8s.io", "v1", "endpointslices", True),
    "ServiceCIDR": KubeKind("networking.k8s.io", "v1", "servicecidrs", False),
    # Cilia's own bookkeeping kinds (CRDs in deploy/helm/cilia/files/crds)
    "CiliaIdentityKey": KubeKind("cilia.io", "v1alpha1", "ciliaidentitykeys", False),
    "CiliaIPAMBlock": KubeKind("cilia.io", "v1alpha1", "ciliaipamblocks", False),
    "CiliaServiceAliasUse": KubeKind("cilia.io", "v1alpha1", "ciliaservicealiasuses", False),
    # written by `servicecidr migrate --kubernetes` (its progress), read by nothing else
    "CiliaServiceCIDRMigration": KubeKind(
        "cilia.io", "v1alpha1", "ciliaservicecidrmigrations", False
    ),
}
"""Store kind -> Kubernetes resource. Extend per store with ``KubernetesStore(kinds=...)``."""


class _TooManyRequests(Exception):
    """HTTP 429 from the API server; ``retry_after``: its Retry-After header (seconds)."""

    def __init__(self, message: str, retry_after: str) -> None:
        super().__init__(message)
        self.retry_after = retry_after


#: Seconds waited at most between two attempts after a 429, whatever Retry-After says.
MAX_RETRY_AFTER = 5.0
#: Reads and writes an update without resourceVersion (unconditional) or a delete makes at most
#: when other writes land between its read and its write. The API server refuses a custom
#: resource's PUT without resourceVersion ("must be specified for an update") and answers a
#: custom resource's DELETE with a Status, not the object, so both read the object first and
#: write with its version as the precondition.
READ_WRITE_ATTEMPTS = 5


def _retry_after(state: tenacity.RetryCallState) -> float:
    """Wait of the next attempt: the last 429's Retry-After (1 s when absent or not a
    number), capped at :data:`MAX_RETRY_AFTER`."""
    exc = state.outcome.exception() if state.outcome is not None else None
    try:
        wait = float(getattr(exc, "retry_after", "") or 1.0)
    except ValueError:
        wait = 1.0
    return max(0.0, min(wait, MAX_RETRY_AFTER))


def _status_message(body: bytes) -> tuple[str, str]:
    try:
        status = json.loads(body)
        return str(status.get("reason") or ""), str(status.get("message") or "")
    except ValueError:
        return "", body.decode(errors="replace")[:200]


class KubernetesStore(Store):
    """Store backed by a Kubernetes API server.

    Args:
        kubeconfig: path of a kubeconfig file; ``""`` = in-cluster config when
            ``KUBERNETES_SERVICE_HOST`` is set, else the default kubeconfig
            (``$KUBECONFIG`` / ``~/.kube/config``).
        context: kubeconfig context (``""`` = current).
        configuration: a ready ``kubernetes.aio.client.Configuration`` (tests); wins over
            ``kubeconfig``.
        request_timeout: seconds for one request (> 0).
        watch_timeout: seconds one watch request lasts on the server (``timeoutSeconds``)
            before it is reopened from the last seen version (>= 1).
        kinds: extra/overriding kind mappings on top of :data:`KINDS`.
        api_server: ``--k8s-api-server``: replaces the server of the loaded configuration
            (in-cluster config reads ``KUBERNETES_SERVICE_HOST``/``_PORT``, which the chart
            sets to ``k8sServiceHost``/``k8sServicePort``: no ClusterIP is needed); alone it
            is used without credentials.

    Raises (from every method):
        StoreUnavailable: the API server cannot be reached, times out, or answers 5xx.
        StoreError: any other refusal (403, 422...) with the server's message.
        ValueError: a kind with no mapping (the message names it).
    """

    def __init__(
        self,
        *,
        kubeconfig: str = "",
        context: str = "",
        configuration: Any = None,
        request_timeout: float = 10.0,
        watch_timeout: int = 300,
        kinds: dict[str, KubeKind] | None = None,
        api_server: str = "",
    ) -> None:
        self.api_server = api_server.rstrip("/")
        if request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0, got {request_timeout}")
        if watch_timeout < 1:
            raise ValueError(f"watch_timeout must be >= 1, got {watch_timeout}")
        self.kubeconfig, self.context = kubeconfig, context
        self.request_timeout = request_timeout
        self.watch_timeout = watch_timeout
        self.kinds = {**KINDS, **(kinds or {})}
        self._configuration = configuration
        self._client: Any = None
        self._lock = asyncio.Lock()
        self.url = ""

    # ------------------------------------------------------------------ plumbing

    async def _api(self) -> Any:
        if self._client is not None:
            return self._client
        async with self._lock:
            if self._client is not None:
                return self._client
            from kubernetes.aio import client
            from kubernetes.aio import config as _config

            config: Any = _config
            cfg = self._configuration
            if cfg is None:
                cfg = client.Configuration()
                try:
                    if not self.kubeconfig and os.environ.get("KUBERNETES_SERVICE_HOST"):
                        config.load_incluster_config(client_configuration=cfg)
                    elif not self.kubeconfig and self.api_server:
                        pass  # --k8s-api-server alone: that URL, no credentials
                    else:
                        await config.load_kube_config(
                            config_file=self.kubeconfig or None,
                            context=self.context or None,
                            client_configuration=cfg,
                            persist_config=False,
                        )
                except Exception as exc:
                    where = self.kubeconfig or "in-cluster/default kubeconfig"
                    raise StoreUnavailable(f"kubernetes store: cannot load {where}: {exc}") from exc
            if self.api_server and self._configuration is None:
                cfg.host = self.api_server
            self.url = str(cfg.host)
            self._client = client.ApiClient(cfg)
            return self._client

    def _kind(self, kind: str) -> KubeKind:
        try:
            return self.kinds[kind]
        except KeyError:
            raise ValueError(
                f"kind {kind!r} has no Kubernetes resource mapping (known: {', '.join(sorted(self.kinds))})"
            ) from None

    async def _request(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        stream: bool = False,
    ) -> tuple[int, Any]:
        """One HTTP request. Returns (status, parsed JSON) or (status, raw response) when
        ``stream``. Connection errors and 5xx raise StoreUnavailable.

        429 Too Many Requests (API priority and fairness, or a resource whose storage is
        still initialising right after its CRD was created) is retried after the server's
        ``Retry-After`` seconds (1 when absent, at most 5), for at most
        ``request_timeout`` seconds in all; then StoreUnavailable (tenacity's retry
        loop, as the official client's ``Retry`` does for its synchronous calls)."""
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(_TooManyRequests),
            wait=_retry_after,
            stop=tenacity.stop_after_delay(self.request_timeout),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._request_once(
                        method, path, query=query, body=body, content_type=content_type,
                        stream=stream,
                    )  # fmt: skip
        except _TooManyRequests as exc:
            raise StoreUnavailable(
                f"kubernetes store {self.url}: {method} {path}: 429 for "
                f"{self.request_timeout:g}s: {exc}"
            ) from None
        raise AssertionError("unreachable")  # pragma: no cover

    async def _request_once(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, str] | None,
        body: Any,
        content_type: str,
        stream: bool,
    ) -> tuple[int, Any]:
        """One attempt of :meth:`_request` (429 raises :class:`_TooManyRequests`)."""
        api = await self._api()
        timeout: Any = self.request_timeout
        if stream:
            timeout = aiohttp.ClientTimeout(
                total=None, connect=self.request_timeout, sock_read=self.watch_timeout + 30
            )
        try:
            method, url, headers, payload, _ = await api.param_serialize(
                method,
                path,
                query_params=list((query or {}).items()),
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                body=body,
                auth_settings=["BearerToken"],
            )
            response = await api.call_api(
                method, url, header_params=headers, body=payload, _request_timeout=timeout
            )
            if stream and response.status == 200:
                return response.status, response
            raw = await response.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise StoreUnavailable(
                f"kubernetes store {self.url}: {method} {path}: {exc!r}"
            ) from exc
        if response.status == 429:
            _, message = _status_message(raw)
            raise _TooManyRequests(message, response.headers.get("Retry-After", ""))
        if response.status >= 500:
            reason, message = _status_message(raw)
            raise StoreUnavailable(
                f"kubernetes store {self.url}: {method} {path}: {response.status} {reason} {message}"
            )
        try:
            return response.status, json.loads(raw) if raw else None
        except ValueError:
            return response.status, raw

    def _fail(self, status: int, body: Any, what: str) -> StoreError:
        reason = message = ""
        if isinstance(body, dict):
            reason, message = str(body.get("reason") or ""), str(body.get("message") or "")
        return StoreError(f"kubernetes store: {what}: HTTP {status} {reason}: {message}".rstrip())

    def _normalise(self, info: KubeKind, kind: str, obj: Resource) -> Resource:
        obj.setdefault("apiVersion", info.api_version)
        obj.setdefault("kind", kind)
        return obj

    async def ping(self) -> None:
        """Check that the API server answers (``GET /version``).

        Raises:
            StoreUnavailable: it does not.
        """
        status, _ = await self._request("GET", "/version")
        if status != 200:
            raise StoreUnavailable(f"kubernetes store {self.url}: /version answered {status}")

    # ------------------------------------------------------------------ Store API

    async def get(self, kind: str, name: str, namespace: str = "") -> Resource:
        info = self._kind(kind)
        status, body = await self._request("GET", info.item(name, namespace))
        if status == 404:
            raise NotFound(kind, namespace, name)
        if status != 200:
            raise self._fail(status, body, f"get {kind} {name}")
        return self._normalise(info, kind, body)

    async def list(self, kind: str) -> ListResult:
        info = self._kind(kind)
        status, body = await self._request("GET", info.collection())
        if status != 200:
            raise self._fail(status, body, f"list {kind}")
        items = [self._normalise(info, kind, o) for o in body.get("items") or []]
        items.sort(key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))
        return ListResult(items=items, resource_version=str(body["metadata"]["resourceVersion"]))

    async def create(self, obj: Resource) -> Resource:
        kind, namespace, name = object_key(obj)
        info = self._kind(kind)
        body = json.loads(json.dumps(obj))
        body["apiVersion"], body["kind"] = info.api_version, kind
        meta = body["metadata"]
        meta.pop("resourceVersion", None)
        if not namespace:
            meta.pop("namespace", None)
        status, stored = await self._request("POST", info.collection(namespace), body=body)
        if status == 409:
            raise AlreadyExists(kind, namespace, name)
        if status not in (200, 201):
            raise self._fail(status, stored, f"create {kind} {name}")
        return await self._write_status(info, kind, obj, self._normalise(info, kind, stored))

    async def _write_status(
        self, info: KubeKind, kind: str, wanted: Resource, stored: Resource
    ) -> Resource:
        """Second write for kinds with a status subresource, when status differs."""
        if not info.status_subresource or wanted.get("status") == stored.get("status"):
            return stored
        _, namespace, name = object_key(stored)
        body = json.loads(json.dumps(stored))
        if "status" in wanted:
            body["status"] = json.loads(json.dumps(wanted["status"]))
        else:
            body.pop("status", None)
        path = info.item(name, namespace) + "/status"
        status, result = await self._request("PUT", path, body=body)
        if status == 404:
            raise NotFound(kind, namespace, name)
        if status == 409:
            current = await self._current_version(kind, name, namespace)
            raise Conflict(kind, namespace, name, resource_version(stored), current)
        if status != 200:
            raise self._fail(status, result, f"update status of {kind} {name}")
        return self._normalise(info, kind, result)

    async def _current_version(self, kind: str, name: str, namespace: str) -> str:
        try:
            return resource_version(await self.get(kind, name, namespace))
        except StoreError:
            return ""

    async def update(self, obj: Resource) -> Resource:
        expected = resource_version(obj)
        if expected:
            return await self._replace(obj, expected)
        kind, namespace, name = object_key(obj)
        for _ in range(READ_WRITE_ATTEMPTS):  # unconditional: at the version read just before
            current = resource_version(await self.get(kind, name, namespace))
            try:
                return await self._replace(obj, current)
            except Conflict:
                continue
        raise Conflict(
            kind, namespace, name, "", await self._current_version(kind, name, namespace)
        )

    async def _replace(self, obj: Resource, expected: str) -> Resource:
        """PUT ``obj`` if the stored version is ``expected`` (then its status, see
        :meth:`_write_status`); raises NotFound, Conflict."""
        kind, namespace, name = object_key(obj)
        info = self._kind(kind)
        body = json.loads(json.dumps(obj))
        body["apiVersion"], body["kind"] = info.api_version, kind
        body["metadata"]["resourceVersion"] = expected
        status, stored = await self._request("PUT", info.item(name, namespace), body=body)
        if status == 404:
            raise NotFound(kind, namespace, name)
        if status == 409:
            current = await self._current_version(kind, name, namespace)
            raise Conflict(kind, namespace, name, expected, current)
        if status != 200:
            raise self._fail(status, stored, f"update {kind} {name}")
        return await self._write_status(info, kind, obj, self._normalise(info, kind, stored))

    async def delete(
        self, kind: str, name: str, namespace: str = "", resource_version: str = ""
    ) -> Resource:
        # The object is read first and deleted with its version as the precondition: the API
        # server answers a custom resource's DELETE with a Status, so the last state returned
        # is the one read, and the precondition makes sure it is the one deleted.
        info = self._kind(kind)
        for _ in range(READ_WRITE_ATTEMPTS):
            last = await self.get(kind, name, namespace)
            version = str(last["metadata"].get("resourceVersion") or "")
            if resource_version and version != resource_version:
                raise Conflict(kind, namespace, name, resource_version, version)
            options: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1"}
            if version:
                options["preconditions"] = {"resourceVersion": version}
            status, body = await self._request("DELETE", info.item(name, namespace), body=options)
            if status == 404:
                raise NotFound(kind, namespace, name)
            if status == 409 and not resource_version:
                continue  # written in between: read it again
            if status == 409:
                current = await self._current_version(kind, name, namespace)
                raise Conflict(kind, namespace, name, resource_version, current)
            if status not in (200, 202):
                raise self._fail(status, body, f"delete {kind} {name}")
            if isinstance(body, dict) and body.get("kind") == "Status":
                return last
            return self._normalise(info, kind, body)
        raise Conflict(
            kind, namespace, name, "", await self._current_version(kind, name, namespace)
        )

    async def watch(self, kind: str, since: str) -> AsyncIterator[WatchEvent]:
        info = self._kind(kind)
        last = since or "0"
        while True:
            query = {
                "watch": "1",
                "resourceVersion": last,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": str(self.watch_timeout),
            }
            status, response = await self._request(
                "GET", info.collection(), query=query, stream=True
            )
            if status == 410:
                raise Expired(kind, last, "")
            if status != 200:
                raise self._fail(status, response, f"watch {kind}")
            try:
                while True:
                    try:
                        line = await response.response.content.readline()
                    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                        raise StoreUnavailable(
                            f"kubernetes store {self.url}: watch {kind}: {exc!r}"
                        ) from exc
                    if not line:
                        break  # the server ended this watch: reopen from `last`
                    event = json.loads(line)
                    etype, obj = event.get("type"), event.get("object") or {}
                    if etype == "ERROR":
                        if obj.get("code") == 410:
                            raise Expired(kind, last, "")
                        raise StoreError(
                            f"kubernetes store: watch {kind}: {obj.get('code')} "
                            f"{obj.get('reason')}: {obj.get('message')}"
                        )
                    rv = str((obj.get("metadata") or {}).get("resourceVersion") or last)
                    last = rv
                    if etype == "BOOKMARK":
                        continue
                    yield WatchEvent(
                        type=etype, object=self._normalise(info, kind, obj), resource_version=rv
                    )
            finally:
                response.response.release()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
