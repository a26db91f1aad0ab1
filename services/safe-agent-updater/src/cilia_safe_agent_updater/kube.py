"""Kubernetes mode: replace this node's agent pod when its generation differs, safely.

Algorithm (upstream: Deckhouse ``cni-cilium`` safe-agent-updater, main.go, restated below),
run once as an init container of the updater
DaemonSet with ``NODE_NAME``:

1. (optional) take one of ``--max-concurrent-updates`` Lease slots.
2. GET the agent DaemonSet; read annotation ``safe-agent-updater-daemonset-generation`` of its
   pod template, and its current revision (the ``controller-revision-hash`` of its newest
   ControllerRevision; :func:`current_revision`) — both missing: exit 11. With
   ``--expected-generation`` (the updater's own annotation, through the downward API) a
   different annotation exits 19 (apply in progress).
3. LIST agent pods (``--agent-selector``) with ``spec.nodeName=<node>``: none → 12, more → 13.
4. The pod's ``controller-revision-hash`` label equals the DaemonSet's current revision
   (when both exist; else: equal annotations) → exit 0 (no-op). Better than comparing the
   annotation alone: an overlay that changes the template without re-stamping the hash
   still rolls the agents.
5. Every image of the agent pod template must be in ``Node.status.images`` (the prepull init
   containers ran), polled ``--image-check-attempts`` times → else 14.
6. DELETE the pod (precondition: its uid).
7. Poll until exactly one agent pod without ``deletionTimestamp`` and with a new uid is on the
   node → else 15.
8. Poll that pod until condition ``Ready=True`` → else 16.
9. Poll the agent's gRPC health (``--agent-health-address``) until SERVING → else 17.

Better than upstream: API calls are retried by the client itself (urllib3 ``Retry`` installed
as ``Configuration.retries``: connection errors, 429 and 5xx, honouring Retry-After), a failed
GET while polling counts as one unsuccessful attempt instead of a nil dereference, every step
is a JSON log line and a core/v1 Event, every failure has its own exit code
(:class:`~cilia_safe_agent_updater.exitcodes.Exit`), and an optional Lease semaphore bounds
the number of nodes updating at once.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import urllib3
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from tenacity import RetryError, Retrying, retry_if_result, stop_after_attempt, wait_fixed

from cilia_safe_agent_updater import health
from cilia_safe_agent_updater.exitcodes import Exit, UpdaterError
from cilia_safe_agent_updater.generation import ANNOTATION
from cilia_safe_agent_updater.steps import Reporter

log = logging.getLogger("cilia_safe_agent_updater.kube")

COMPONENT = "cilia-safe-agent-updater"
T = TypeVar("T")

#: Errors of one API call once the client's own retries are used up.
API_ERRORS = (ApiException, urllib3.exceptions.HTTPError)


@dataclass(frozen=True)
class KubeSettings:
    """Flags of ``--mode kubernetes`` (defaults documented in README.md).

    Intervals and timeouts are seconds; attempts are counts (>= 1).
    """

    node_name: str
    namespace: str = "cilia-system"
    agent_daemonset: str = "cilia-agent"
    agent_selector: str = "app=cilia-agent"
    expected_generation: str = ""
    poll_interval: float = 3.0
    image_check_attempts: int = 20
    check_images: bool = True
    pod_replace_attempts: int = 20
    ready_attempts: int = 20
    agent_health_address: str = "unix:/var/run/cilia/cilia.sock"
    health_attempts: int = 20
    health_rpc_timeout: float = 2.0
    api_timeout: float = 10.0
    max_concurrent_updates: int = 0
    lease_namespace: str = ""
    lease_prefix: str = "cilia-safe-agent-updater"
    lease_duration: int = 60
    lease_wait_timeout: float = 600.0
    events: bool = True


def _one_line(exc: BaseException) -> str:
    """``str(exc)`` on one line (PyYAML messages span several)."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or repr(exc)


def _server_problem(server: str) -> str:
    """Why ``server`` (a kubeconfig cluster's ``server``) is not an API server URL; "" if it is.

    Accepted: ``http(s)://HOST[:PORT][/PATH]`` as urllib3 parses it (what the client sends
    requests to).
    """
    try:
        url = urllib3.util.parse_url(server)
    except urllib3.exceptions.LocationParseError as exc:
        return f"{server!r} is not a URL ({_one_line(exc)})"
    if url.scheme not in ("http", "https") or not url.host:
        return f"{server!r} is not a URL of the form https://HOST[:PORT]"
    return ""


def api_client(kubeconfig: str | None, *, retries: int, backoff: float) -> client.ApiClient:
    """Return an ApiClient for ``kubeconfig`` (None: in-cluster config) that retries by itself.

    Retries (urllib3 ``Retry`` as ``Configuration.retries``, the official client's own
    mechanism): up to ``retries`` times on connection/read errors and on 429/500/502/503/504
    for idempotent methods (GET, PUT, DELETE), sleeping ``backoff * 2**(n-1)`` s between
    tries and honouring Retry-After. The final response is handed back to the client, which
    raises ``ApiException`` with its status.

    Raises:
        UpdaterError(USAGE): no kubeconfig and not running in a cluster, or an unreadable
            kubeconfig (missing file, not YAML, not UTF-8, wrong structure, a cluster
            ``server`` that is not an ``http(s)://HOST[:PORT]`` URL); the one-line message
            names the file and the problem.
    """
    cfg = client.Configuration()
    source = kubeconfig if kubeconfig else "in-cluster config"
    try:
        if kubeconfig:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, client_configuration=cfg
            )
        else:
            config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    except (config.ConfigException, OSError) as exc:
        if not kubeconfig:
            raise UpdaterError(
                Exit.USAGE, f"--kubeconfig: cannot load {source}: {_one_line(exc)}"
            ) from exc
        raise UpdaterError(
            Exit.USAGE, f"--kubeconfig {source}: unreadable kubeconfig: {_one_line(exc)}"
        ) from exc
    except (yaml.YAMLError, ValueError, TypeError, AttributeError, KeyError, IndexError) as exc:
        # not YAML (yaml.YAMLError), not UTF-8 (UnicodeDecodeError is a ValueError), or YAML
        # of the wrong shape (the client indexes it blindly: TypeError/AttributeError/...)
        raise UpdaterError(
            Exit.USAGE,
            f"--kubeconfig {source}: unreadable kubeconfig: {type(exc).__name__}: {_one_line(exc)}",
        ) from exc
    problem = _server_problem(str(cfg.host or ""))
    if problem:
        raise UpdaterError(
            Exit.USAGE, f"--kubeconfig {source}: unreadable kubeconfig: cluster server {problem}"
        )
    cfg.retries = urllib3.Retry(
        total=retries,
        connect=retries,
        read=retries,
        status=retries,
        backoff_factor=backoff,
        status_forcelist=(429, 500, 502, 503, 504),
        raise_on_status=False,
        respect_retry_after_header=True,
    )
    return client.ApiClient(cfg)


class KubeAPI:
    """The few API calls the updater makes, returning plain dicts (wire JSON).

    Every method raises ``ApiException`` / ``urllib3.exceptions.HTTPError`` after the
    client's retries (see :func:`api_client`).
    """

    def __init__(self, api: client.ApiClient, timeout: float) -> None:
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.coordination = client.CoordinationV1Api(api)
        self.timeout = timeout

    @staticmethod
    def _json(response: Any) -> dict[str, Any]:
        data = json.loads(response.data)
        assert isinstance(data, dict)
        return data

    def get_daemonset(self, namespace: str, name: str) -> dict[str, Any]:
        return self._json(
            self.apps.read_namespaced_daemon_set(
                name, namespace, _preload_content=False, _request_timeout=self.timeout
            )
        )

    def list_controller_revisions(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        body = self._json(
            self.apps.list_namespaced_controller_revision(
                namespace,
                label_selector=selector,
                _preload_content=False,
                _request_timeout=self.timeout,
            )
        )
        return list(body.get("items") or [])

    def list_pods(self, namespace: str, selector: str, node: str) -> list[dict[str, Any]]:
        body = self._json(
            self.core.list_namespaced_pod(
                namespace,
                label_selector=selector,
                field_selector=f"spec.nodeName={node}",
                _preload_content=False,
                _request_timeout=self.timeout,
            )
        )
        items = body.get("items") or []
        # Field selectors are honoured by a real API server; filter again so a partial
        # implementation (or a stale cache) can never make us touch another node's pod.
        return [p for p in items if (p.get("spec") or {}).get("nodeName") == node]

    def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return self._json(
            self.core.read_namespaced_pod(
                name, namespace, _preload_content=False, _request_timeout=self.timeout
            )
        )

    def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        self.core.delete_namespaced_pod(
            name,
            namespace,
            body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
            _preload_content=False,
            _request_timeout=self.timeout,
        )

    def get_node(self, name: str) -> dict[str, Any]:
        return self._json(
            self.core.read_node(name, _preload_content=False, _request_timeout=self.timeout)
        )

    def create_event(self, namespace: str, body: dict[str, Any]) -> None:
        self.core.create_namespaced_event(
            namespace,
            cast(Any, body),  # wire JSON; the client posts dicts as they are
            _preload_content=False,
            _request_timeout=self.timeout,
        )

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._json(
                self.coordination.read_namespaced_lease(
                    name, namespace, _preload_content=False, _request_timeout=self.timeout
                )
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create_lease(self, namespace: str, body: dict[str, Any]) -> None:
        self.coordination.create_namespaced_lease(
            namespace,
            cast(Any, body),
            _preload_content=False,
            _request_timeout=self.timeout,
        )

    def replace_lease(self, namespace: str, name: str, body: dict[str, Any]) -> None:
        self.coordination.replace_namespaced_lease(
            name,
            namespace,
            cast(Any, body),
            _preload_content=False,
            _request_timeout=self.timeout,
        )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _micro_time(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(text: str | None) -> dt.datetime | None:
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


class EventRecorder:
    """Creates one core/v1 Event per step (best effort: a failure is logged, never raised).

    Events go to ``namespace``; ``involvedObject`` is the agent pod once known, else the Node
    (``kubectl describe node`` and ``describe pod`` show them).
    """

    def __init__(self, api: KubeAPI, namespace: str, node: str) -> None:
        self.api = api
        self.namespace = namespace
        self.node = node

    def __call__(
        self, reason: str, message: str, warning: bool, involved: dict[str, Any] | None
    ) -> None:
        now = _now()
        target = involved or {"kind": "Node", "name": self.node, "apiVersion": "v1"}
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{COMPONENT}.", "namespace": self.namespace},
            "involvedObject": target,
            "reason": reason,
            "message": message[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": COMPONENT, "host": self.node},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.node,
            "firstTimestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "lastTimestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "count": 1,
        }
        try:
            self.api.create_event(self.namespace, body)
        except API_ERRORS as exc:
            log.warning("event not recorded", extra={"reason": reason, "error": str(exc)})


class LeaseSemaphore:
    """At most ``slots`` holders at once, through Leases ``<prefix>-0 … <prefix>-<slots-1>``.

    A slot is free when its Lease does not exist, has no holder, or was not renewed for
    ``leaseDurationSeconds`` (clocks of the nodes are assumed roughly in sync, as for
    client-go leader election). Taking or renewing is a PUT with the read resourceVersion,
    so two contenders never both win (the loser gets 409 and tries the next slot). While held,
    a daemon thread renews every ``duration / 3`` s.
    """

    def __init__(
        self, api: KubeAPI, namespace: str, prefix: str, slots: int, holder: str, duration: int
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.prefix = prefix
        self.slots = slots
        self.holder = holder
        self.duration = duration
        self.held: str | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _spec(self, acquire_time: str, transitions: int) -> dict[str, Any]:
        return {
            "holderIdentity": self.holder,
            "leaseDurationSeconds": self.duration,
            "acquireTime": acquire_time,
            "renewTime": _micro_time(_now()),
            "leaseTransitions": transitions,
        }

    def try_acquire(self) -> str | None:
        """Take a free slot (or the one we already hold); return its Lease name or None."""
        for index in range(self.slots):
            name = f"{self.prefix}-{index}"
            if self._take(name):
                return name
        return None

    def _take(self, name: str) -> bool:
        """Create, take over (expired/free) or renew (ours) Lease ``name``; False when another
        holder has it or a concurrent writer won (409)."""
        try:
            lease = self.api.get_lease(self.namespace, name)
            if lease is None:
                self.api.create_lease(
                    self.namespace,
                    {
                        "apiVersion": "coordination.k8s.io/v1",
                        "kind": "Lease",
                        "metadata": {"name": name, "namespace": self.namespace},
                        "spec": self._spec(_micro_time(_now()), 0),
                    },
                )
                return True
            spec = lease.get("spec") or {}
            holder = spec.get("holderIdentity") or ""
            renewed = _parse_time(spec.get("renewTime"))
            duration = int(spec.get("leaseDurationSeconds") or self.duration)
            expired = renewed is None or (_now() - renewed).total_seconds() > duration
            if holder and holder != self.holder and not expired:
                return False
            transitions = int(spec.get("leaseTransitions") or 0)
            if holder != self.holder:
                transitions += 1
                acquire = _micro_time(_now())
            else:
                acquire = spec.get("acquireTime") or _micro_time(_now())
            lease["spec"] = self._spec(acquire, transitions)
            self.api.replace_lease(self.namespace, name, lease)
            return True
        except ApiException as exc:
            if exc.status == 409:  # someone else created/updated it first
                return False
            raise

    def acquire(self, wait_timeout: float, interval: float, reporter: Reporter) -> None:
        """Poll :meth:`try_acquire` until a slot is ours, then start renewing it.

        Raises:
            UpdaterError(LOCK_TIMEOUT): no slot within ``wait_timeout`` s.
        """
        attempts = max(1, int(wait_timeout / interval) + 1) if interval > 0 else 1
        name = _poll(self.try_acquire, attempts, interval, "lease")
        if name is None:
            raise UpdaterError(
                Exit.LOCK_TIMEOUT,
                f"no update slot free among {self.slots} Lease(s) {self.prefix}-* in "
                f"{self.namespace} within {wait_timeout:g} s (--lease-wait-timeout)",
            )
        self.held = name
        reporter.step("UpdateSlotAcquired", f"holding Lease {self.namespace}/{name}", lease=name)
        self._renewer = threading.Thread(target=self._renew_loop, name="lease-renew", daemon=True)
        self._renewer.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(max(1.0, self.duration / 3)):
            try:
                if self.held is not None and not self._take(self.held):
                    log.warning("lease lost to another holder", extra={"lease": self.held})
            except API_ERRORS as exc:
                log.warning("lease renewal failed", extra={"lease": self.held, "error": str(exc)})

    def release(self) -> None:
        """Stop renewing and clear the holder of the held Lease (best effort)."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
        if self.held is None:
            return
        try:
            lease = self.api.get_lease(self.namespace, self.held)
            if lease is not None and (lease.get("spec") or {}).get("holderIdentity") == self.holder:
                lease["spec"]["holderIdentity"] = None
                self.api.replace_lease(self.namespace, self.held, lease)
        except API_ERRORS as exc:
            log.warning("lease not released", extra={"lease": self.held, "error": str(exc)})
        self.held = None


def _poll(fn: Callable[[], T | None], attempts: int, interval: float, what: str) -> T | None:
    """Call ``fn`` up to ``attempts`` times, ``interval`` s apart, until it returns non-None.

    An API error in one attempt is logged and counts as an unsuccessful attempt (upstream
    dereferenced a nil pod there). Returns the result or None when the attempts ran out.
    """

    def attempt() -> T | None:
        try:
            return fn()
        except API_ERRORS as exc:
            log.warning("poll attempt failed", extra={"wait": what, "error": str(exc)})
            return None

    retrying = Retrying(
        stop=stop_after_attempt(max(1, attempts)),
        wait=wait_fixed(interval),
        retry=retry_if_result(lambda result: result is None),
    )
    try:
        return retrying(attempt)
    except RetryError:
        return None


def _is_ready(pod: dict[str, Any]) -> bool:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


def _pod_ref(pod: dict[str, Any]) -> dict[str, Any]:
    meta = pod.get("metadata") or {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
        "uid": meta.get("uid"),
    }


def desired_images(daemonset: dict[str, Any]) -> list[str]:
    """Images of the DaemonSet's pod template (init containers first), without duplicates."""
    spec = ((daemonset.get("spec") or {}).get("template") or {}).get("spec") or {}
    images: list[str] = []
    for key in ("initContainers", "containers"):
        for container in spec.get(key) or []:
            image = container.get("image")
            if image and image not in images:
                images.append(image)
    return images


def _normalise(image: str) -> str:
    for prefix in ("docker.io/library/", "docker.io/", "index.docker.io/library/"):
        if image.startswith(prefix):
            image = image[len(prefix) :]
    if "@" not in image and ":" not in image.rsplit("/", 1)[-1]:
        image += ":latest"
    return image


def missing_images(node: dict[str, Any], images: list[str]) -> list[str]:
    """Images of ``images`` absent from ``node.status.images[*].names`` (after normalising
    ``docker.io/library/`` prefixes and an implicit ``:latest``).

    Note: the kubelet reports at most ``--node-status-max-images`` (default 50) images;
    on nodes with more, use ``--no-image-check``.
    """
    present = {
        _normalise(name)
        for entry in (node.get("status") or {}).get("images") or []
        for name in entry.get("names") or []
    }
    return [image for image in images if _normalise(image) not in present]


def run(settings: KubeSettings, api: KubeAPI, reporter: Reporter) -> Exit:
    """Run the Kubernetes-mode update of ``settings.node_name``; return the exit code.

    Raises:
        UpdaterError: every failure, with its exit code (see module docstring).
        ApiException / urllib3 HTTPError: an API call failed after the client's retries
            outside a poll loop (the CLI maps it to ``Exit.API_UNAVAILABLE``).
    """
    if settings.events:
        reporter.sinks.append(EventRecorder(api, settings.namespace, settings.node_name))
    reporter.involved = {"apiVersion": "v1", "kind": "Node", "name": settings.node_name}
    semaphore: LeaseSemaphore | None = None
    try:
        if settings.max_concurrent_updates > 0:
            semaphore = LeaseSemaphore(
                api,
                settings.lease_namespace or settings.namespace,
                settings.lease_prefix,
                settings.max_concurrent_updates,
                settings.node_name,
                settings.lease_duration,
            )
        return _update(settings, api, reporter, semaphore)
    except UpdaterError as exc:
        reporter.step("UpdateFailed", str(exc), warning=True, exit_code=int(exc.code))
        raise
    finally:
        if semaphore is not None:
            semaphore.release()


REVISION_LABEL = "controller-revision-hash"
"""Label the DaemonSet controller puts on its ControllerRevisions and on the pods it makes."""


def current_revision(api: KubeAPI, namespace: str, daemonset: dict[str, Any]) -> str:
    """The DaemonSet's current revision hash: ``metadata.labels[controller-revision-hash]``
    of its ControllerRevision (``ownerReferences`` controller = the DaemonSet) with the
    highest ``revision``; "" when it has none (no DaemonSet controller ran).

    The DaemonSet controller writes a new revision for every change of the pod template,
    so an overlay that changes the agent's image or config checksum, applied without
    re-running ``hash --write``, still counts as a new generation (Kubernetes: the
    DaemonSet controller's ControllerRevisions and ``controller-revision-hash``)."""
    uid = (daemonset.get("metadata") or {}).get("uid")
    match = ((daemonset.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    selector = ",".join(f"{k}={v}" for k, v in sorted(match.items()))
    best: tuple[int, str] | None = None
    for rev in api.list_controller_revisions(namespace, selector):
        meta = rev.get("metadata") or {}
        owners = meta.get("ownerReferences") or []
        if not any(o.get("controller") and o.get("uid") == uid for o in owners):
            continue
        digest = (meta.get("labels") or {}).get(REVISION_LABEL) or ""
        if not digest:
            digest = str(meta.get("name") or "").rsplit("-", 1)[-1]
        number = int(rev.get("revision") or 0)
        if best is None or number > best[0]:
            best = (number, digest)
    return best[1] if best is not None else ""


def _update(
    settings: KubeSettings, api: KubeAPI, reporter: Reporter, semaphore: LeaseSemaphore | None
) -> Exit:
    ns, node = settings.namespace, settings.node_name
    try:
        daemonset = api.get_daemonset(ns, settings.agent_daemonset)
    except ApiException as exc:
        if exc.status == 404:
            raise UpdaterError(
                Exit.DAEMONSET_NOT_FOUND,
                f"agent DaemonSet {ns}/{settings.agent_daemonset} not found (--agent-daemonset)",
            ) from exc
        raise
    template_meta = ((daemonset.get("spec") or {}).get("template") or {}).get("metadata") or {}
    desired = (template_meta.get("annotations") or {}).get(ANNOTATION) or ""
    revision = current_revision(api, ns, daemonset)
    if not desired and not revision:
        raise UpdaterError(
            Exit.ANNOTATION_MISSING,
            f"agent DaemonSet {ns}/{settings.agent_daemonset}: spec.template.metadata."
            f"annotations[{ANNOTATION!r}] is missing or empty (install with the chart "
            "deploy/helm/cilia, which stamps it, or run `cilia-safe-agent-updater hash --write` "
            "on other manifests)",
        )
    if desired and settings.expected_generation and settings.expected_generation != desired:
        raise UpdaterError(
            Exit.GENERATION_SKEW,
            f"--expected-generation {settings.expected_generation} differs from the agent "
            f"DaemonSet's {desired}: the agent DaemonSet is not updated yet",
        )
    pod = _single_agent_pod(settings, api)
    pod_meta = pod.get("metadata") or {}
    current = (pod_meta.get("annotations") or {}).get(ANNOTATION) or ""
    pod_revision = (pod_meta.get("labels") or {}).get(REVISION_LABEL) or ""
    if revision and pod_revision:
        # the DaemonSet controller's own revision is the truth: a template changed without
        # a new generation annotation (a stale committed hash) still rolls the agent
        desired, current = revision, pod_revision
    reporter.involved = _pod_ref(pod)
    if current == desired:
        reporter.step(
            "AgentUpToDate",
            f"agent pod {pod_meta.get('name')} already runs generation {desired[:12]}",
            pod=pod_meta.get("name"),
            generation=desired,
        )
        return Exit.OK
    reporter.step(
        "AgentOutdated",
        f"agent pod {pod_meta.get('name')} runs generation {current[:12] or '<none>'}, "
        f"desired {desired[:12]}",
        pod=pod_meta.get("name"),
        current=current,
        desired=desired,
    )
    if settings.check_images:
        images = desired_images(daemonset)

        last_missing: list[str] = list(images)

        def images_present() -> list[str] | None:
            missing = missing_images(api.get_node(node), images)
            last_missing[:] = missing
            if missing:
                log.info("waiting for images on the node", extra={"missing": missing})
                return None
            return images

        if (
            _poll(images_present, settings.image_check_attempts, settings.poll_interval, "images")
            is None
        ):
            raise UpdaterError(
                Exit.IMAGES_MISSING,
                f"node {node}: desired images not in status.images after "
                f"{settings.image_check_attempts} checks: {last_missing}",
            )
        reporter.step("ImagesPresent", f"desired images present on node {node}", images=images)
    if semaphore is not None:
        semaphore.acquire(settings.lease_wait_timeout, settings.poll_interval, reporter)
    old_uid = pod_meta.get("uid") or ""
    try:
        api.delete_pod(ns, pod_meta["name"], old_uid)
    except ApiException as exc:
        if exc.status not in (404, 409):  # already gone / already replaced: wait anyway
            raise
    reporter.step("AgentPodDeleted", f"deleted agent pod {pod_meta.get('name')}", uid=old_uid)

    def replacement() -> dict[str, Any] | None:
        pods = api.list_pods(ns, settings.agent_selector, node)
        live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
        if len(live) == 1 and (live[0].get("metadata") or {}).get("uid") != old_uid:
            return live[0]
        return None

    new_pod = _poll(
        replacement, settings.pod_replace_attempts, settings.poll_interval, "replacement"
    )
    if new_pod is None:
        raise UpdaterError(
            Exit.REPLACEMENT_MISSING,
            f"node {node}: no single new agent pod after {settings.pod_replace_attempts} "
            f"checks {settings.poll_interval:g} s apart (--pod-replace-attempts)",
        )
    new_name = new_pod["metadata"]["name"]
    reporter.involved = _pod_ref(new_pod)
    reporter.step("ReplacementCreated", f"replacement agent pod {new_name} scheduled", pod=new_name)

    def ready() -> dict[str, Any] | None:
        current_pod = api.get_pod(ns, new_name)
        return current_pod if _is_ready(current_pod) else None

    if _poll(ready, settings.ready_attempts, settings.poll_interval, "ready") is None:
        raise UpdaterError(
            Exit.REPLACEMENT_NOT_READY,
            f"agent pod {new_name} not Ready after {settings.ready_attempts} checks "
            f"{settings.poll_interval:g} s apart (--ready-attempts)",
        )
    reporter.step("ReplacementReady", f"agent pod {new_name} is Ready", pod=new_name)
    if settings.agent_health_address:
        if not health.wait_serving(
            settings.agent_health_address,
            attempts=settings.health_attempts,
            interval=settings.poll_interval,
            rpc_timeout=settings.health_rpc_timeout,
        ):
            raise UpdaterError(
                Exit.AGENT_UNHEALTHY,
                f"agent at {settings.agent_health_address} not SERVING after "
                f"{settings.health_attempts} checks (--health-attempts)",
            )
        reporter.step(
            "AgentHealthy",
            f"agent answers gRPC health SERVING at {settings.agent_health_address}",
            address=settings.agent_health_address,
        )
    reporter.step(
        "AgentUpdated", f"agent on node {node} runs generation {desired[:12]}", generation=desired
    )
    return Exit.OK


def _single_agent_pod(settings: KubeSettings, api: KubeAPI) -> dict[str, Any]:
    pods = api.list_pods(settings.namespace, settings.agent_selector, settings.node_name)
    if not pods:
        raise UpdaterError(
            Exit.NO_AGENT_POD,
            f"no agent pod ({settings.agent_selector}) in {settings.namespace} on node "
            f"{settings.node_name}",
        )
    if len(pods) > 1:
        names = sorted((p.get("metadata") or {}).get("name", "?") for p in pods)
        raise UpdaterError(
            Exit.MULTIPLE_AGENT_PODS,
            f"{len(pods)} agent pods on node {settings.node_name}: {', '.join(names)}; "
            "expected exactly one",
        )
    return pods[0]
