"""The agent generation hash kept in annotation ``safe-agent-updater-daemonset-generation``.

Definition (README.md, "The generation hash"):

    sha256( canonical_json( spec.template of the rendered agent DaemonSet,
                            with metadata.annotations["safe-agent-updater-daemonset-generation"]
                            removed, and metadata.annotations removed when it becomes empty ) )

``canonical_json`` is Go's ``encoding/json`` encoding of the parsed object, which is what the
Helm chart's ``toJson`` produces (deploy/helm/cilia, ``cilia.agent.generation``: ``include``
the pod template, ``fromYaml | toJson | sha256sum``): keys sorted by code point, no spaces,
non-ASCII kept as UTF-8, and ``<`` ``>`` ``&`` U+2028 U+2029 written as ``\u003c`` ``\u003e``
``\u0026`` ``\u2028`` ``\u2029`` (Go's HTML-safe escaping). The hash is lower-case hex (64
characters). So the chart, which computes the hash itself while rendering (no Python on the
admin's host), and ``cilia-safe-agent-updater hash`` of the same render agree; a test renders
the chart with the real helm and checks both (deploy/tests/test_helm_generation.py).

Upstream (Deckhouse ``cni-cilium``, M/templates/agent/daemonset.yaml) hashes the whole
rendered DaemonSet text rendered with a placeholder. Hashing the parsed pod template instead
makes the value independent of YAML formatting and key order, and still covers the images,
flags, env and any config-checksum annotation in the template; a change of the DaemonSet's
own metadata (labels of the DaemonSet object) rightly does not restart agents.

The hash is computed at render time (the chart, or ``cilia-safe-agent-updater hash`` for any
other renderer) and written into the agent DaemonSet's pod template and the updater DaemonSet
(object and pod template), so any agent change also rolls the updater. The running updater compares strings only: the API
server adds defaults to stored templates, so a hash recomputed from a live object would differ.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable
from typing import Any

ANNOTATION = "safe-agent-updater-daemonset-generation"

#: Characters Go's encoding/json escapes inside strings though JSON does not require it
#: (HTML safety and the JavaScript line terminators), with their escapes.
_GO_ESCAPES = {
    "<": "\\u003c",
    ">": "\\u003e",
    "&": "\\u0026",
    "\u2028": "\\u2028",
    "\u2029": "\\u2029",
}


def canonical_json(obj: Any) -> str:
    """``obj`` as Go's ``encoding/json`` (Helm's ``toJson``) writes a parsed YAML document:
    sorted keys, no spaces, UTF-8 kept, ``<>&`` and U+2028/U+2029 as ``\\uXXXX``.

    Those characters can only occur inside JSON strings, so replacing them in the output
    escapes exactly the string contents. Raises TypeError when ``obj`` is not
    JSON-serialisable. Integers are written as integers; a YAML float with a zero fraction
    (``1.0``) would be ``1`` in Go and ``1.0`` here — no Kubernetes pod field is such a float.
    """
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char, escape in _GO_ESCAPES.items():
        text = text.replace(char, escape)
    return text


def template_hash(pod_template: dict[str, Any]) -> str:
    """Return the generation hash (64 hex chars) of a DaemonSet's ``spec.template`` dict.

    The input is not modified. Raises TypeError when it is not JSON-serialisable.
    """
    template = copy.deepcopy(pod_template)
    annotations = (template.get("metadata") or {}).get("annotations")
    if isinstance(annotations, dict):
        annotations.pop(ANNOTATION, None)
        if not annotations:
            del template["metadata"]["annotations"]
    return hashlib.sha256(canonical_json(template).encode("utf-8")).hexdigest()


def stamp(documents: Iterable[dict[str, Any]], agent_name: str, updater_name: str) -> str:
    """Compute the agent DaemonSet's hash and write it into both DaemonSets, in place.

    Args:
        documents: parsed Kubernetes objects (e.g. every document of a rendered manifest).
        agent_name: ``metadata.name`` of the agent DaemonSet.
        updater_name: ``metadata.name`` of the updater DaemonSet (stamped when present).

    Returns the hash. The annotation is set on the agent's pod template, and on the updater
    DaemonSet's object metadata and pod template.

    Raises:
        ValueError: no DaemonSet named ``agent_name`` among the documents.
    """
    docs = [d for d in documents if isinstance(d, dict) and d.get("kind") == "DaemonSet"]
    agent = next((d for d in docs if d.get("metadata", {}).get("name") == agent_name), None)
    if agent is None:
        raise ValueError(f"agent DaemonSet {agent_name!r} not found in the input")
    digest = template_hash(agent["spec"]["template"])
    _annotate(agent["spec"]["template"], digest)
    for doc in docs:
        if doc.get("metadata", {}).get("name") == updater_name:
            _annotate(doc, digest)
            _annotate(doc["spec"]["template"], digest)
    return digest


def _annotate(obj: dict[str, Any], value: str) -> None:
    metadata = obj.setdefault("metadata", {})
    annotations = metadata.get("annotations") or {}
    annotations[ANNOTATION] = value
    metadata["annotations"] = annotations
