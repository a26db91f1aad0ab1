"""Run a real ``cilia_agent.app.Agent`` in its own process for the cilia-cni tests.

Usage: ``python agent_runner.py '<json>'`` with ``{"config": {Config fields},
"static": {pool: [cidr, ...]}}``. The agent gets its pool as a static allocation (no
operator, as the agent's own privileged tests do), serves its unix socket, writes its
conflist once ready, prints ``ready`` on stdout and runs until SIGTERM/SIGINT.

Exec'd by :class:`realagent.RealAgent`; a separate process so the tests can stop and
SIGKILL it (agent down, DEL queue replay) and so the plugin never shares its GIL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from typing import Any

from cilia_agent.app import Agent
from cilia_agent.config import Config


async def _serve(spec: dict[str, Any]) -> None:
    fields = set(Config.model_fields)
    config = Config(**{k: v for k, v in spec["config"].items() if k in fields})
    agent = Agent(config, static_allocation=spec["static"])
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await agent.start()
    print("ready", flush=True)
    try:
        await stop.wait()
    finally:
        await agent.stop()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(_serve(json.loads(sys.argv[1])))


if __name__ == "__main__":
    main()
