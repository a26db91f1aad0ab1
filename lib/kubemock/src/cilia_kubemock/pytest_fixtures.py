"""Pytest fixtures (auto-registered via the ``pytest11`` entry point ``cilia_kubemock``).

``kube_api``: a fresh :class:`~cilia_kubemock.server.KubeMock` per test, in a background
thread, and a ready ``kubernetes.client.Configuration``, kubeconfig file and
``ApiClient`` factory pointing at it.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from .server import KubeMock


def kubeconfig_dict(url: str, namespace: str = "default") -> dict[str, Any]:
    """A kubeconfig (as a dict) with one context ``kubemock`` pointing at ``url``."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kubemock", "cluster": {"server": url}}],
        "users": [{"name": "kubemock", "user": {"token": "kubemock"}}],
        "contexts": [
            {
                "name": "kubemock",
                "context": {"cluster": "kubemock", "user": "kubemock", "namespace": namespace},
            }
        ],
        "current-context": "kubemock",
    }


def write_kubeconfig(url: str, path: pathlib.Path) -> pathlib.Path:
    """Write :func:`kubeconfig_dict` for ``url`` to ``path`` (YAML); returns ``path``."""
    path.write_text(yaml.safe_dump(kubeconfig_dict(url)))
    return path


@dataclass
class KubeAPI:
    """What ``kube_api`` yields.

    Attributes:
        url: ``http://127.0.0.1:PORT``.
        mock: the server (thread-safe helpers: ``put_object``, ``get_object``,
            ``objects``, ``delete_object``, ``compact``, ``resource_version``, ``requests``).
        kubeconfig: path of a kubeconfig file for ``--kubeconfig`` / ``KUBECONFIG``.
        configuration: a ``kubernetes.client.Configuration`` with ``host = url``.
    """

    url: str
    mock: KubeMock
    kubeconfig: pathlib.Path
    configuration: Any

    def api_client(self) -> Any:
        """A new ``kubernetes.client.ApiClient`` on :attr:`configuration` (close it)."""
        from kubernetes import client

        return client.ApiClient(self.configuration)


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``kubemock`` marker."""
    config.addinivalue_line(
        "markers", "kubemock(**kwargs): KubeMock keyword arguments for the kube_api fixture"
    )


@pytest.fixture
def kube_api(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Iterator[KubeAPI]:
    """A fresh mock API server for one test (stopped afterwards).

    Tune it with ``@pytest.mark.kubemock(pod_termination_delay=1.0, event_history=5)``
    (keyword arguments of :class:`KubeMock`).
    """
    from kubernetes import client

    marker = request.node.get_closest_marker("kubemock")
    mock = KubeMock(**(marker.kwargs if marker else {}))
    url = mock.start()
    config = client.Configuration()
    config.host = url
    try:
        yield KubeAPI(url, mock, write_kubeconfig(url, tmp_path / "kubeconfig"), config)
    finally:
        mock.stop()
