"""cilia-hubble-ui in a real browser against the real stack (issue 14: the service map page).

The demo's pods in a namespace of their own (``app=frontend``, ``app=backend``, ``app=other``,
a greeter on the backend's TCP 8080), the demo's policy (backend admits only frontend on TCP
8080), real traffic (frontend → backend connects, other → backend is dropped by the eBPF
datapath). ``cilia-hubble-ui serve`` runs against the stack's relay; Debian's headless Chromium,
driven by Playwright (pointed at ``/usr/bin/chromium``: no browser download), opens the page
filtered to the namespace and the test checks what it shows against the flows the relay gives
``cilia-relay observe``: the same pods and endpoints as nodes, exactly one dropped edge (other →
backend, labelled with its drop reason, drawn dashed and red), then the same in the screenshot's
pixels along each edge (labels hidden for that shot). Filtering by verdict FORWARDED through
the page's form hides the dropped edge. A malformed filter in the URL is a 400 and the page
keeps being served.

Screenshots are kept under ``$CILIA_E2E_ARTIFACTS`` (default ``build/e2e-artifacts``).
"""

from __future__ import annotations

import base64
import contextlib
import os
import pathlib
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import traffic
from support import current_stack, dump_logs

from cilia_testkit import ROOT, VENV_BIN, cni, host, procs, skips
from cilia_testkit.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

NS = "cilia-e2e-ui"
PORT = 8080
POLICY = "ui-backend-allow-frontend"
ROLES = ("frontend", "backend", "other")
CHROMIUM = pathlib.Path("/usr/bin/chromium")
UI_START_SECONDS = 30.0
PAGE_SECONDS = 30.0
POLICY_WAIT_SECONDS = 15.0
ARTIFACTS = pathlib.Path(os.environ.get("CILIA_E2E_ARTIFACTS", ROOT / "build" / "e2e-artifacts"))
#: Edge colours of the page's style (static/app.js), as the screenshot's pixels show them.
RED, GREEN = (220, 38, 38), (22, 163, 74)


def _browser_missing() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} missing (Debian's chromium; scripts/setup.sh installs it)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright for Python missing (make setup installs it in .venv)"
    if not (VENV_BIN / "cilia-hubble-ui").exists():
        return f"{VENV_BIN / 'cilia-hubble-ui'} missing: run make setup"
    return None


@pytest.fixture(scope="module")
def pods(stack: Stack) -> Iterator[dict[str, cni.Pod]]:
    """The demo's three pods in :data:`NS`, the backend's greeter, and the demo's policy
    (applied and seen to drop other → backend)."""
    skips.require(_browser_missing())
    started = time.monotonic()
    conflist = stack.agent.conflist()
    made: dict[str, cni.Pod] = {}
    server: subprocess.Popen[str] | None = None
    try:
        for role in ROLES:
            pod = cni.Pod(
                name=f"cilia-e2e-{os.getpid()}-ui-{role}", namespace=NS, labels={"app": role}
            )
            pod.create_netns()
            made[role] = pod
            outcome = pod.add(conflist)
            assert outcome.returncode == 0, outcome.stdout + dump_logs()
        server = traffic.start_servers(made["backend"], (PORT,))
        out = traffic.apply(traffic.backend_from_frontend(POLICY, NS, PORT))
        assert out.returncode == 0, out.stderr
        blocked = host.wait_for(
            lambda: traffic.connect(made["other"], made["backend"].ip, PORT) is None,
            POLICY_WAIT_SECONDS,
            interval=0.3,
        )
        assert blocked, f"the policy did not drop other -> backend\n{dump_logs()}"
        print(f"hubble-ui pods and policy: {time.monotonic() - started:.1f} s")
        yield made
    finally:
        current_stack().operator_cli("delete", "cnp", POLICY, "-n", NS)
        if server is not None:
            traffic.stop(server)
        for pod in made.values():
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                pod.delete(current_stack().agent.conflist(), timeout=30)
            pod.destroy_netns()


@pytest.fixture(scope="module")
def ui(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``cilia-hubble-ui serve`` against the stack's relay; yields its bound ``host:port``."""
    log = tmp_path_factory.mktemp("hubble-ui") / "hubble-ui.log"
    with log.open("wb") as sink:
        proc = procs.spawn(
            [str(VENV_BIN / "cilia-hubble-ui"), "serve", "--listen-address", "127.0.0.1:0",
             "--hubble-relay-address", stack.relay_address, "--update-interval", "250ms"],
            stderr=sink,
        )  # fmt: skip
    try:
        line = procs.wait_for_file_line(
            log, lambda text: '"listening"' in text and '"http"' in text,
            timeout=UI_START_SECONDS, proc=proc,
        )  # fmt: skip
        found = procs.listening(line)
        assert found is not None, line
        yield found[1]
    finally:
        procs.stop(proc)


def _node_id(endpoint: dict[str, Any], address: str) -> str:
    """The page's node for a JSON flow endpoint: pod, reserved identity, identity or address
    (cilia_hubble_ui.graph's precedence, restated from its docstring)."""
    if endpoint.get("pod_name"):
        return f"pod:{endpoint.get('namespace', '')}/{endpoint['pod_name']}"
    reserved = sorted(
        label.removeprefix("reserved:")
        for label in endpoint.get("labels", [])
        if label.startswith("reserved:")
    )
    if reserved:
        return f"reserved:{reserved[0]}"
    if endpoint.get("identity"):
        return f"identity:{endpoint['identity']}"
    return f"ip:{address}"


def _expected(flows: list[dict[str, Any]]) -> tuple[set[str], set[tuple[str, str]]]:
    """(node ids, dropped edges as (from, to) in the connection's direction) of the flows."""
    nodes: set[str] = set()
    dropped: set[tuple[str, str]] = set()
    for flow in flows:
        ip = flow.get("IP", {})
        src = _node_id(flow.get("source", {}), ip.get("source", ""))
        dst = _node_id(flow.get("destination", {}), ip.get("destination", ""))
        nodes |= {src, dst}
        if flow.get("verdict") == "DROPPED":
            dropped.add((dst, src) if flow.get("is_reply") else (src, dst))
    return nodes, dropped


_MAP_STATE = """() => {
  const cy = window.hubbleMap.cy;
  const box = document.getElementById('map').getBoundingClientRect();
  const edges = cy.edges().map((e) => ({
    source: e.data('source'), target: e.data('target'), verdict: e.data('verdict'),
    label: e.data('label'), color: e.style('line-color'), lineStyle: e.style('line-style'),
    from: e.sourceEndpoint(), to: e.targetEndpoint(), control: e.controlPoints() || null,
    zoom: cy.zoom(), pan: cy.pan(),
  }));
  const nodes = cy.nodes("[kind != 'namespace']").map((n) => n.id());
  const namespaces = cy.nodes("[kind = 'namespace']").map((n) => n.data('label'));
  return { edges, nodes, namespaces, box: { x: box.x, y: box.y } };
}"""

_PIXELS = """async ([png, points]) => {
  const img = new Image();
  img.src = 'data:image/png;base64,' + png;
  await img.decode();
  const canvas = document.createElement('canvas');
  canvas.width = img.width; canvas.height = img.height;
  const ctx = canvas.getContext('2d');
  ctx.drawImage(img, 0, 0);
  return points.map(([x, y]) => {
    const d = ctx.getImageData(Math.round(x) - 4, Math.round(y) - 4, 9, 9).data;
    const out = [];
    for (let i = 0; i < d.length; i += 4) out.push([d[i], d[i + 1], d[i + 2]]);
    return out;
  });
}"""


def _near(pixel: list[int], colour: tuple[int, int, int], tolerance: int = 50) -> bool:
    return all(abs(a - b) <= tolerance for a, b in zip(pixel, colour, strict=True))


def _edge_pixels(page: Any, png: bytes, edge: dict[str, Any]) -> list[list[list[int]]]:
    """9x9 pixel patches of the screenshot ``png`` (of the map element) at 10 %, 20 %, 80 %
    and 90 % along ``edge``'s drawn line (away from its label in the middle): a straight line,
    or the quadratic Bezier curve through cytoscape's control point of a parallel edge; model
    coordinates turned into the element's pixels with the map's zoom and pan."""
    zoom, pan = edge["zoom"], edge["pan"]
    start, end = edge["from"], edge["to"]
    control = (edge["control"] or [None])[0]
    points = []
    for t in (0.1, 0.2, 0.8, 0.9):
        if control is None:
            x = start["x"] + t * (end["x"] - start["x"])
            y = start["y"] + t * (end["y"] - start["y"])
        else:
            a, b, c = (1 - t) ** 2, 2 * (1 - t) * t, t**2
            x = a * start["x"] + b * control["x"] + c * end["x"]
            y = a * start["y"] + b * control["y"] + c * end["y"]
        points.append([x * zoom + pan["x"], y * zoom + pan["y"]])
    result: list[list[list[int]]] = page.evaluate(_PIXELS, [base64.b64encode(png).decode(), points])
    return result


_EDGE_LABELS = """show => {
  window.hubbleMap.cy.style().selector('edge').style('label', show ? 'data(label)' : '').update();
  return new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)));
}"""


def _line_screenshot(page: Any, attempts: int = 5) -> tuple[dict[str, Any], bytes]:
    """The map's state and a screenshot of its element taken with the edge labels hidden, so
    each edge's line is sampled where it runs (a long label such as ``dropped · POLICY_DENIED
    · TCP/8080`` on a short edge covers most of its line with its white outline); retried
    while the state read before and after the screenshot differ (a flow that adds an element
    re-runs the layout, moving every edge). Labels are shown again before returning.

    Raises:
        AssertionError: the layout moved in each of ``attempts`` screenshots.
    """
    page.evaluate(_EDGE_LABELS, False)
    try:
        for _ in range(attempts):
            before: dict[str, Any] = page.evaluate(_MAP_STATE)
            png: bytes = page.locator("#map").screenshot()
            if page.evaluate(_MAP_STATE) == before:
                return before, png
            page.wait_for_timeout(300)
        raise AssertionError(f"the map's layout kept moving over {attempts} screenshots")
    finally:
        page.evaluate(_EDGE_LABELS, True)


def _wait_map(page: Any, nodes: int) -> dict[str, Any]:
    """Wait until the map drew at least ``nodes`` nodes (the first, empty graph comes before
    the relay answered); the map's state."""
    page.wait_for_function(
        "n => document.getElementById('map').dataset.ready === 'true'"
        " && Number(document.getElementById('map').dataset.nodes) >= n",
        arg=nodes,
        timeout=PAGE_SECONDS * 1000,
    )
    page.wait_for_timeout(300)  # one more update interval: the layout has run and drawn
    state: dict[str, Any] = page.evaluate(_MAP_STATE)
    return state


def _open(page: Any, url: str, nodes: int) -> dict[str, Any]:
    """Open ``url`` (asserting a 200) and :func:`_wait_map`."""
    response = page.goto(url)
    assert response is not None and response.status == 200, url
    return _wait_map(page, nodes)


def test_the_service_map_shows_the_pods_and_the_dropped_edge_the_flows_show(
    pods: dict[str, cni.Pod], ui: str
) -> None:
    from playwright.sync_api import sync_playwright

    started = time.monotonic()
    front, back, other = (pods[r] for r in ROLES)
    assert traffic.connect(front, back.ip, PORT) == traffic.greeting(back.name, PORT)
    assert traffic.connect(other, back.ip, PORT) is None
    time.sleep(1.2)  # the relay's sort buffer sends flows after 1 s without new ones
    seen = traffic.observe("--pod", f"{NS}/", "--last", "2000")
    assert seen.returncode == 0, seen.stderr
    nodes, dropped = _expected(seen.flows)
    text = traffic.summary(seen.flows)
    pod_ids = {f"pod:{NS}/{p.name}" for p in pods.values()}
    assert pod_ids <= nodes, text
    assert dropped == {(f"pod:{NS}/{other.name}", f"pod:{NS}/{back.name}")}, text

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            state = _open(page, f"http://{ui}/?namespace={NS}", len(nodes))

            # What the map holds is what the flows say.
            assert set(state["nodes"]) == nodes, (state["nodes"], text)
            assert state["namespaces"] == [NS]
            map_el = page.locator("#map")
            assert map_el.get_attribute("data-nodes") == str(len(nodes))
            assert map_el.get_attribute("data-dropped-edges") == "1"
            drops = [e for e in state["edges"] if e["verdict"] == "DROPPED"]
            assert [(e["source"], e["target"]) for e in drops] == sorted(dropped), state["edges"]
            (drop,) = drops
            assert drop["label"] == "dropped · POLICY_DENIED · TCP/8080", drop
            assert (drop["color"], drop["lineStyle"]) == ("rgb(220,38,38)", "dashed"), drop
            forwarded_pair = (f"pod:{NS}/{front.name}", f"pod:{NS}/{back.name}")
            forwarded = [
                e
                for e in state["edges"]
                if e["verdict"] == "FORWARDED" and (e["source"], e["target"]) == forwarded_pair
            ]
            assert len(forwarded) == 1, state["edges"]
            assert page.locator("#flows tbody tr[data-verdict='DROPPED']").count() >= 1

            # ... and so is what the screenshot shows: red along the dropped edge, green along
            # the forwarded one (sampled with the labels hidden, from the state of that moment).
            map_el.screenshot(path=str(ARTIFACTS / "hubble-ui-map.png"))
            shot, png = _line_screenshot(page)
            (drop,) = [e for e in shot["edges"] if e["verdict"] == "DROPPED"]
            forwarded = [e for e in shot["edges"] if (e["verdict"], e["source"], e["target"])
                         == ("FORWARDED", *forwarded_pair)]  # fmt: skip
            assert len(forwarded) == 1, shot["edges"]
            red = sum(_near(p, RED) for patch in _edge_pixels(page, png, drop) for p in patch)
            green = sum(
                _near(p, GREEN) for patch in _edge_pixels(page, png, forwarded[0]) for p in patch
            )
            print(
                f"screenshot: {red} red pixels along the dropped edge, {green} green along the forwarded"
            )
            assert red >= 12, f"dropped edge not drawn red: {red} red pixels"
            assert green >= 12, f"forwarded edge not drawn green: {green} green pixels"
            assert sum(_near(p, RED) for patch in _edge_pixels(page, png, forwarded[0])
                       for p in patch) == 0  # fmt: skip

            # The page's own filter form: verdict FORWARDED goes to the relay and hides the drop.
            page.select_option("#filters select[name=verdict]", "FORWARDED")
            with page.expect_navigation():
                page.click("#apply")
            assert "verdict=FORWARDED" in page.url and f"namespace={NS}" in page.url
            filtered = _wait_map(page, 2)
            assert [e["verdict"] for e in filtered["edges"]] == ["FORWARDED"] * len(
                filtered["edges"]
            )
            assert (f"pod:{NS}/{front.name}", f"pod:{NS}/{back.name}") in {
                (e["source"], e["target"]) for e in filtered["edges"]
            }
            assert page.locator("#map").get_attribute("data-dropped-edges") == "0"
            assert page.locator("#flows tbody tr[data-verdict='DROPPED']").count() == 0
            page.locator("#map").screenshot(path=str(ARTIFACTS / "hubble-ui-forwarded.png"))

            # A malformed filter is a clear 400; the service keeps serving the next page.
            bad = page.goto(f"http://{ui}/?namespace={NS}&port=99999")
            assert bad is not None and bad.status == 400
            assert "port: '99999' is not a number 0-65535" in page.inner_text("#error")
            again = _open(page, f"http://{ui}/?namespace={NS}&verdict=DROPPED", 2)
            assert [e["verdict"] for e in again["edges"]] == ["DROPPED"]
        finally:
            browser.close()
    print(f"hubble-ui browser checks: {time.monotonic() - started:.1f} s")
