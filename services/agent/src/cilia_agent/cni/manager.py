"""The CNI-config manager: the agent's side of the contract with the container runtime.

- The conflist (``--cni-conf-dir``/``--cni-conf-name``) is written the first time the node
  is ready (a runtime then starts sending ADDs; ``--cni-exclusive`` moves other configs
  aside), and removed at stop with ``--cni-uninstall`` (the configs moved aside return).
- The plugin's DEL queue (``--cni-del-queue-dir``: DELs the plugin could not deliver while
  the agent was down) is replayed through the endpoint manager's Del once at start,
  after the restore and before serving, and then every
  ``--cni-del-queue-replay-interval`` seconds while serving (a plugin that found the
  socket not yet serving queues its DEL after the start-up replay). A replay never
  deletes an endpoint newer than the queued DEL (:mod:`cilia_agent.cni.delqueue`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import pathlib
from concurrent.futures import Executor
from dataclasses import dataclass

from cilia_agent.cni.conflist import uninstall, write_conflist
from cilia_agent.cni.delqueue import Deleter, ReplayReport, replay
from cilia_agent.config import Config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CNIConfig:
    """The flags the manager follows.

    Attributes:
        conf_dir: ``--cni-conf-dir``.
        conf_name: ``--cni-conf-name``.
        socket: ``--socket`` (named in the conflist for the plugin).
        log_file: ``--cni-log-file`` ("" = none; named in the conflist).
        del_queue_dir: ``--cni-del-queue-dir``.
        replay_interval: ``--cni-del-queue-replay-interval`` (s).
        exclusive: ``--cni-exclusive``.
        uninstall: ``--cni-uninstall``.
        chaining_mode: ``--cni-chaining-mode`` (``none`` or ``portmap``).
    """

    conf_dir: pathlib.Path
    conf_name: str
    socket: pathlib.Path
    log_file: str
    del_queue_dir: pathlib.Path
    replay_interval: float
    exclusive: bool
    uninstall: bool
    chaining_mode: str = "none"


class CNIConfigManager:
    """Writes the conflist when ready and replays the plugin's DEL queue.

    Args:
        config: the CNI flags.
        delete: the endpoint manager's Del.
        executor: where the conflist is written.
    """

    def __init__(self, config: CNIConfig, delete: Deleter, executor: Executor) -> None:
        self.config = config
        self.delete = delete
        self.executor = executor
        self.del_queue_report = ReplayReport()
        self._uninstalled = False

    @property
    def path(self) -> pathlib.Path:
        """The conflist's path."""
        return self.config.conf_dir / self.config.conf_name

    async def write(self) -> None:
        """Write the conflist (the node became ready).

        Raises:
            OSError: the file could not be written.
        """
        cfg = self.config
        path = await asyncio.get_running_loop().run_in_executor(
            self.executor,
            functools.partial(
                write_conflist,
                cfg.conf_dir,
                cfg.conf_name,
                cfg.socket,
                cfg.log_file,
                cfg.del_queue_dir,
                exclusive=cfg.exclusive,
                chaining_mode=cfg.chaining_mode,
            ),
        )
        log.info("agent ready, CNI config written", extra={"path": str(path)})

    def uninstall(self) -> None:
        """With ``--cni-uninstall``: remove the conflist (no new ADD reaches this agent)
        and bring back the configs ``--cni-exclusive`` moved aside (once)."""
        if self.config.uninstall and not self._uninstalled:
            self._uninstalled = True
            uninstall(self.config.conf_dir, self.config.conf_name)

    async def replay(self) -> ReplayReport:
        """Replay the DEL queue once through the Del path."""
        report = await replay(self.config.del_queue_dir, self.delete)
        self.del_queue_report = report
        if report.deleted or report.nothing or report.failed or report.corrupt:
            log.info(
                "DEL queue replayed",
                extra={
                    "dir": str(self.config.del_queue_dir),
                    "deleted": len(report.deleted),
                    "nothing_to_delete": len(report.nothing),
                    "failed": report.failed,
                    "corrupt": report.corrupt,
                },
            )
        return report

    async def replay_loop(self) -> None:
        """Replay the queue every ``replay_interval`` seconds while it holds DELs (runs
        until cancelled; an unreadable directory is logged and tried again)."""
        while True:
            await asyncio.sleep(self.config.replay_interval)
            try:
                if any(self.config.del_queue_dir.glob("*.del")):
                    await self.replay()
            except OSError as exc:
                log.warning("cannot read the DEL queue", extra={"reason": str(exc)})


def cni_config(cfg: Config) -> CNIConfig:
    """The :class:`CNIConfig` of the agent's flags."""
    return CNIConfig(
        conf_dir=cfg.cni_conf_dir,
        conf_name=cfg.cni_conf_name,
        socket=cfg.socket,
        log_file=cfg.cni_log_file,
        del_queue_dir=cfg.cni_del_queue_dir,
        replay_interval=cfg.cni_del_queue_replay_interval,
        exclusive=cfg.cni_exclusive,
        uninstall=cfg.cni_uninstall,
        chaining_mode=cfg.cni_chaining_mode,
    )
