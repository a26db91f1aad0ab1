"""Kubeconfig files for tests that point a client at an address of their own choosing.

The real server's admin kubeconfig comes with it (:attr:`cilia_testkit.kubeapi.KubeAPI.kubeconfig`).
This one is for what a real server is not: a plain-HTTP proxy in front of it that injects
faults, or a port nothing listens on (an API server that is down).
"""

from __future__ import annotations

import json
import pathlib


def write_kubeconfig(server: str, path: pathlib.Path, namespace: str = "default") -> pathlib.Path:
    """Write a kubeconfig whose one context ``cilia-test`` sends every request to ``server``
    (``http://HOST:PORT``; no client certificate, a placeholder bearer token) with default
    namespace ``namespace``; returns ``path``. Written as JSON, which every kubeconfig reader
    takes as YAML."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "cilia-test", "cluster": {"server": server}}],
        "users": [{"name": "cilia-test", "user": {"token": "cilia-test"}}],
        "contexts": [
            {
                "name": "cilia-test",
                "context": {"cluster": "cilia-test", "user": "cilia-test", "namespace": namespace},
            }
        ],
        "current-context": "cilia-test",
    }
    path.write_text(json.dumps(config, indent=2))
    return path
