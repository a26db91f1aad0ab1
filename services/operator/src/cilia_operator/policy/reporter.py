"""Say where a user looks that a policy is enforced fail closed: a Warning Event on it.

With ``--store kubernetes`` the API server accepts policies Cilia cannot enforce as
written (a named port, SCTP, ``icmps``, ``toServices``, ...). The agents enforce them fail
closed (``cilia_common.policy.judge``: the endpoints they select become default-deny in
that rule's direction). :class:`PolicyReporter` judges every CiliumNetworkPolicy,
CiliumClusterwideNetworkPolicy and NetworkPolicy with the same function and, for each one
not enforced as written, creates one core/v1 Event on it (``kubectl describe`` and
``kubectl get events`` show it):

- ``type: Warning``, ``reason: PolicyFailClosed`` (the agents enforce the rewrite) or
  ``PolicyRefused`` (nothing can be enforced, e.g. not even the kind or name is readable);
- ``message``: the judgement's one line (directions made default-deny, the fields and why);
- ``involvedObject``: the policy (kind, apiVersion, namespace, name, uid, resourceVersion);
- its name is ``<policy name>.<10 hex digits of the sha256 of kind/namespace/name/message>``,
  so the same judgement is reported once, also across operator restarts and replicas
  (a second create answers AlreadyExists and is ignored). A cluster-wide policy's Event
  lives in the ``default`` namespace (:data:`CLUSTER_EVENT_NAMESPACE`), as Events of
  cluster-scoped objects do.

Runs on the leader only, one supervised task per kind (list, then watch from the list's
resourceVersion; an expired watch lists again through the supervisor's restart).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from cilia_common.policy.judge import judge_policy
from cilia_common.tasks import Supervisor

from ..store import AlreadyExists, Resource, Store, StoreError
from .validation import CCNP_KIND, CNP_KIND, DEFAULT_NAMESPACE, NP_KIND

log = logging.getLogger(__name__)

EVENT_KIND = "Event"
REASON_FAIL_CLOSED = "PolicyFailClosed"
REASON_REFUSED = "PolicyRefused"
COMPONENT = "cilia-operator"
POLICY_KINDS: Sequence[str] = (CNP_KIND, CCNP_KIND, NP_KIND)
CLUSTER_EVENT_NAMESPACE = DEFAULT_NAMESPACE
"""Namespace of the Events of cluster-wide policies (cluster-scoped objects)."""


def policy_event(obj: Mapping[str, Any], namespace_for_cluster: str) -> Resource | None:
    """The Event to create for one stored policy, None when it is enforced as written.

    ``namespace_for_cluster``: where the Event of a cluster-wide policy lives.
    """
    judgement = judge_policy(obj)
    if judgement.verdict == "enforced":
        return None
    meta = obj.get("metadata") or {}
    kind = str(obj.get("kind") or "")
    name = str(meta.get("name") or "")
    namespace = "" if kind == CCNP_KIND else str(meta.get("namespace") or DEFAULT_NAMESPACE)
    message = judgement.summary()
    digest = hashlib.sha256(f"{kind}/{namespace}/{name}/{message}".encode()).hexdigest()[:10]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": EVENT_KIND,
        "metadata": {"name": f"{name}.{digest}", "namespace": namespace or namespace_for_cluster},
        "involvedObject": {
            "apiVersion": str(obj.get("apiVersion") or ""),
            "kind": kind,
            "name": name,
            **({"namespace": namespace} if namespace else {}),
            **({"uid": meta["uid"]} if meta.get("uid") else {}),
            **(
                {"resourceVersion": str(meta["resourceVersion"])}
                if meta.get("resourceVersion")
                else {}
            ),
        },
        "type": "Warning",
        "reason": REASON_REFUSED if judgement.verdict == "refused" else REASON_FAIL_CLOSED,
        "message": message[:1024],
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": COMPONENT,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


class PolicyReporter:
    """Creates the Events of :func:`policy_event` for every policy as it changes.

    Args:
        store: the Kubernetes store (it maps the ``Event`` kind).
        namespace_for_cluster: where the Events of cluster-wide policies go.
    """

    def __init__(self, store: Store, namespace_for_cluster: str = CLUSTER_EVENT_NAMESPACE) -> None:
        self.store = store
        self.namespace_for_cluster = namespace_for_cluster
        self.reported = 0
        self._supervisor: Supervisor | None = None

    async def report(self, obj: Mapping[str, Any]) -> Resource | None:
        """Create the Event of one policy (None: enforced as written, or already reported).

        Raises:
            StoreError: the API server refused or is unreachable.
        """
        event = policy_event(obj, self.namespace_for_cluster)
        if event is None:
            return None
        try:
            created = await self.store.create(event)
        except AlreadyExists:
            return None
        self.reported += 1
        log.warning(
            "policy enforced fail closed",
            extra={"policy": event["involvedObject"], "reason": event["reason"],
                   "message": event["message"]},
        )  # fmt: skip
        return created

    async def _follow(self, kind: str) -> None:
        listed = await self.store.list(kind)
        for obj in listed.items:
            await self._report_logged(obj)
        async for change in self.store.watch(kind, listed.resource_version):
            if change.type in ("ADDED", "MODIFIED"):
                await self._report_logged(change.object)

    async def _report_logged(self, obj: Mapping[str, Any]) -> None:
        try:
            await self.report(obj)
        except StoreError as exc:
            log.error("cannot create the Event of a policy", extra={"error": str(exc)})

    def start(self) -> None:
        """Follow the three policy kinds (supervised; restarted with backoff on failure)."""
        if self._supervisor is not None:
            return
        self._supervisor = Supervisor(log)
        for kind in POLICY_KINDS:
            self._supervisor.spawn(f"policy-events-{kind}", functools.partial(self._follow, kind))

    async def stop(self) -> None:
        """Stop following; safe to call twice."""
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None:
            await supervisor.stop()
