"""deploy/compose: the file validates with the host's compose, uses the images `make images`
builds, and every cilia-* command line parses with the binary's own parser.

Debian ships docker-compose 1.29 (scripts/setup.sh installs it); the v2 plugin
(`docker compose`) is used when present. Without either the test FAILS (no silent pass).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

# Both imports resolve through pytest's rootdir handling (rootdir conftest.py and this test
# directory are on the import path): no edits of the import path.
from test_chart_manifests import _parsers

from scripts import images

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose" / "compose.yaml"


def _compose_cmd() -> list[str]:
    for docker in ("docker", "/usr/bin/docker"):
        if shutil.which(docker):
            res = subprocess.run([docker, "compose", "version"], capture_output=True, check=False)
            if res.returncode == 0:
                return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    assert legacy, "neither `docker compose` nor docker-compose found (scripts/setup.sh)"
    return [legacy]


@pytest.fixture(scope="module")
def config() -> dict:
    res = subprocess.run(
        [*_compose_cmd(), "-p", "cilia", "-f", str(COMPOSE), "config"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    return yaml.safe_load(res.stdout)


def test_compose_file_validates(config: dict) -> None:
    assert set(config["services"]) >= {"redis", "operator", "agent", "relay"}


def test_images_are_the_ones_make_images_builds(config: dict) -> None:
    for name, svc in config["services"].items():
        image = {"updater": "safe-agent-updater", "cni-install": "cni", "cni-server": "cni"}.get(
            name, name
        )
        assert svc["image"] in images.image_tags(image), (name, svc["image"])


def test_agent_runs_in_the_host_network_with_explicit_capabilities(config: dict) -> None:
    agent = config["services"]["agent"]
    assert agent["network_mode"] == "host"
    assert not agent.get("privileged")
    assert {"NET_ADMIN", "SYS_ADMIN"} <= set(agent["cap_add"])


def test_every_flag_is_accepted_by_its_binary(config: dict) -> None:
    parsers = _parsers()
    checked = 0
    for name, svc in config["services"].items():
        binary = "cilia-" + name
        if binary not in parsers:
            continue
        try:
            parsers[binary]().parse_args(svc["command"])
        except SystemExit as exc:
            pytest.fail(f"{name}: {binary} refuses {svc['command']} ({exc})")
        checked += 1
    assert checked == 3
