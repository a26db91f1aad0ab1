"""cilia-kubemock: a local mock Kubernetes API server for tests (see README.md).

``KubeMock`` serves the real HTTP protocol (resourceVersion, 409 Conflict, watch, 410
Gone) from memory; ``kube_api`` (pytest fixture, auto-registered through the ``pytest11``
entry point) starts one per test.
"""

from .pytest_fixtures import KubeAPI, kubeconfig_dict, write_kubeconfig
from .resources import DEFAULT_TYPES, ResourceType
from .server import ApiError, KubeMock

__all__ = [
    "DEFAULT_TYPES",
    "ApiError",
    "KubeAPI",
    "KubeMock",
    "ResourceType",
    "kubeconfig_dict",
    "write_kubeconfig",
]
