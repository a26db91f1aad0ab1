"""CNI conflist writer (upstream ``write-cni-conf-when-ready``, ``cni-exclusive``,
``cni-uninstall``, ``cni-chaining-mode``).

The file is written atomically (temporary file, rename) and only once the agent is
ready, so a runtime never picks up a network whose agent cannot serve ADD yet. It
names the agent socket and the DEL queue directory the plugin must use.

``cni-exclusive``: every other ``*.conf``, ``*.conflist`` and ``*.json`` in the
directory is renamed to ``<name>.cilia_bak`` when the conflist is written, so the
runtime uses only cilia (upstream renames to ``*.cilium_bak``). ``cni-uninstall``:
on a clean shutdown the conflist is removed and every ``*.cilia_bak`` is renamed
back (one whose original name exists again is left alone).

``cni-chaining-mode``: ``portmap`` appends the standard ``portmap`` plugin with the
``portMappings`` capability after cilia-cni (upstream's portmap conflist template), so the
runtime passes a pod's ``hostPort`` mappings to it and it installs their DNAT; cilia-cni's
result (its ``prevResult``) names the host-side interface portmap needs. ``none``: cilia-cni
alone.
"""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

from cilia_agent.endpoint.state import atomic_write

log = logging.getLogger(__name__)

CNI_VERSION = "1.0.0"
NETWORK_NAME = "cilia"
PLUGIN_TYPE = "cilia-cni"
BACKUP_SUFFIX = ".cilia_bak"
CONFIG_SUFFIXES = (".conf", ".conflist", ".json")
#: The plugins each ``--cni-chaining-mode`` chains after cilia-cni.
CHAINED_PLUGINS: dict[str, list[dict[str, Any]]] = {
    "none": [],
    "portmap": [{"type": "portmap", "capabilities": {"portMappings": True}}],
}


def conflist_document(
    socket_path: pathlib.Path,
    log_file: str = "",
    del_queue_dir: pathlib.Path | None = None,
    chaining_mode: str = "none",
) -> dict[str, Any]:
    """Return the conflist as a dict.

    Shape: ``{"cniVersion":"1.0.0","name":"cilia","plugins":[{"type":"cilia-cni",
    "agent-socket":"<abs path>"[, "del-queue-dir": "<abs path>"][, "log-file": "..."]}
    (, the plugins of :data:`CHAINED_PLUGINS` [chaining_mode])]}``.

    Raises:
        ValueError: an unknown ``chaining_mode``.
    """
    if chaining_mode not in CHAINED_PLUGINS:
        raise ValueError(f"cni chaining mode {chaining_mode!r}: one of {sorted(CHAINED_PLUGINS)}")
    plugin: dict[str, Any] = {"type": PLUGIN_TYPE, "agent-socket": str(socket_path.absolute())}
    if del_queue_dir is not None:
        plugin["del-queue-dir"] = str(del_queue_dir.absolute())
    if log_file:
        plugin["log-file"] = log_file
    chained = [dict(p) for p in CHAINED_PLUGINS[chaining_mode]]
    return {"cniVersion": CNI_VERSION, "name": NETWORK_NAME, "plugins": [plugin, *chained]}


def write_conflist(
    conf_dir: pathlib.Path,
    name: str,
    socket_path: pathlib.Path,
    log_file: str = "",
    del_queue_dir: pathlib.Path | None = None,
    *,
    exclusive: bool = False,
    chaining_mode: str = "none",
) -> pathlib.Path:
    """Atomically write the conflist to ``conf_dir/name`` (mode 0644); returns its path.

    With ``exclusive`` the other configs are moved aside first (:func:`move_aside`).

    Raises:
        ValueError: an unknown ``chaining_mode`` (nothing written).
        StateError: the directory or file cannot be written.
        OSError: (exclusive) another config cannot be renamed.
    """
    document = conflist_document(socket_path, log_file, del_queue_dir, chaining_mode)
    conf_dir.mkdir(parents=True, exist_ok=True)
    if exclusive:
        move_aside(conf_dir, name)
    path = conf_dir / name
    data = json.dumps(document, indent=2) + "\n"
    atomic_write(path, data.encode(), mode=0o644)
    return path


def move_aside(conf_dir: pathlib.Path, keep: str) -> list[pathlib.Path]:
    """Rename every CNI config in ``conf_dir`` except ``keep`` to ``<name>.cilia_bak``.

    Returns the new paths. Hidden files and non-config files are left alone.

    Raises:
        OSError: a rename failed.
    """
    moved: list[pathlib.Path] = []
    for path in sorted(conf_dir.iterdir()):
        if path.name == keep or path.name.startswith(".") or not path.is_file():
            continue
        if path.suffix not in CONFIG_SUFFIXES:
            continue
        target = path.with_name(path.name + BACKUP_SUFFIX)
        path.rename(target)
        moved.append(target)
        log.info(
            "cni-exclusive: moved another CNI config aside",
            extra={"path": str(path), "moved_to": str(target)},
        )
    return moved


def uninstall(conf_dir: pathlib.Path, name: str) -> list[pathlib.Path]:
    """Remove our conflist and rename every ``*.cilia_bak`` back; returns the restored paths.

    A backup whose original name exists again (another plugin rewrote it) stays.
    Never raises for a missing file; other errors are logged.
    """
    (conf_dir / name).unlink(missing_ok=True)
    restored: list[pathlib.Path] = []
    try:
        backups = sorted(conf_dir.glob("*" + BACKUP_SUFFIX))
    except OSError as exc:
        log.error("cni-uninstall: cannot list", extra={"dir": str(conf_dir), "reason": str(exc)})
        return restored
    for backup in backups:
        original = backup.with_name(backup.name[: -len(BACKUP_SUFFIX)])
        if original.exists():
            log.warning(
                "cni-uninstall: original exists again, backup kept",
                extra={"path": str(backup)},
            )
            continue
        try:
            backup.rename(original)
        except OSError as exc:
            log.error(
                "cni-uninstall: cannot restore", extra={"path": str(backup), "reason": str(exc)}
            )
            continue
        restored.append(original)
    log.info(
        "cni-uninstall: conflist removed, configs restored",
        extra={"restored": [str(p) for p in restored]},
    )
    return restored
