"""CNI conflist writer (upstream ``write-cni-conf-when-ready``).

The file is written atomically and only once the agent is ready, so a runtime
never picks up a network whose agent cannot serve ADD yet. It is left in place
on shutdown (a restarting agent keeps serving the same pods).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from cilia_agent.endpoint.state import atomic_write

CNI_VERSION = "1.0.0"
NETWORK_NAME = "cilia"
PLUGIN_TYPE = "cilia-cni"


def conflist_document(socket_path: pathlib.Path, log_file: str = "") -> dict[str, Any]:
    """Return the conflist as a dict.

    Shape: ``{"cniVersion":"1.0.0","name":"cilia","plugins":[{"type":"cilia-cni",
    "agent-socket":"<abs path>"[, "log-file": "..."]}]}``.
    """
    plugin: dict[str, Any] = {"type": PLUGIN_TYPE, "agent-socket": str(socket_path.absolute())}
    if log_file:
        plugin["log-file"] = log_file
    return {"cniVersion": CNI_VERSION, "name": NETWORK_NAME, "plugins": [plugin]}


def write_conflist(
    conf_dir: pathlib.Path, name: str, socket_path: pathlib.Path, log_file: str = ""
) -> pathlib.Path:
    """Atomically write the conflist to ``conf_dir/name`` (mode 0644); returns its path.

    Raises:
        StateError: the directory or file cannot be written.
    """
    conf_dir.mkdir(parents=True, exist_ok=True)
    path = conf_dir / name
    data = json.dumps(conflist_document(socket_path, log_file), indent=2) + "\n"
    atomic_write(path, data.encode(), mode=0o644)
    return path
