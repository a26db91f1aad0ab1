"""``cilia-hubble-ui`` as a process (the ``listening`` line for port 0, the page and its
health served, a clean stop on SIGTERM) and its command line in-process (one-line errors for
bad flags and unusable TLS files)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cilia_hubble_ui.__main__ import main

START_SECONDS = 20.0


def _binary() -> str:
    exe = Path(sys.executable).with_name("cilia-hubble-ui")
    found = str(exe) if exe.exists() else shutil.which("cilia-hubble-ui")
    if found is None:
        pytest.fail("cilia-hubble-ui is not installed (make setup / tox -e hubble-ui)")
    return found


def _listening(proc: subprocess.Popen[str]) -> str:
    assert proc.stderr is not None
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        entry = json.loads(line)
        if entry["msg"] == "listening" and entry["listener"] == "http":
            return str(entry["address"])
    proc.kill()
    raise AssertionError(f"no listening line; exit {proc.wait()}")


def test_serves_the_page_on_the_port_it_bound_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [_binary(), "serve", "--listen-address", "127.0.0.1:0",
         "--hubble-relay-address", "127.0.0.1:1", "--max-clients", "3"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        address = _listening(proc)
        assert not address.endswith(":0")
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=5) as resp:
            assert json.load(resp)["status"] == "ok"
        with urllib.request.urlopen(f"http://{address}/?namespace=shop", timeout=5) as resp:
            assert "cytoscape.min.js" in resp.read().decode()
        with urllib.request.urlopen(f"http://{address}/static/vendor/cytoscape.min.js") as resp:
            assert resp.status == 200 and len(resp.read()) > 100_000
        with pytest.raises(urllib.error.HTTPError) as bad:
            urllib.request.urlopen(f"http://{address}/?protocol=carrier-pigeon", timeout=5)
        assert bad.value.code == 400
        # over-long request line / header line: 414 / 431 with one plain line, not a repr
        with pytest.raises(urllib.error.HTTPError) as long_query:
            urllib.request.urlopen(f"http://{address}/api/graph?q={'a' * 100_000}", timeout=5)
        body = long_query.value.read().decode()
        assert long_query.value.code == 414
        assert body == ("414 Request-URI Too Long: the request line is longer than 8190 bytes "
                        "(--max-request-line-bytes): use fewer or shorter filters\n")  # fmt: skip
        big = urllib.request.Request(f"http://{address}/healthz", headers={"X-Big": "b" * 10_000})
        with pytest.raises(urllib.error.HTTPError) as long_header:
            urllib.request.urlopen(big, timeout=5)
        assert long_header.value.code == 431
        assert "bytearray" not in long_header.value.read().decode()
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=5) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert "Traceback" not in proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--flows-buffer", "0"], "--flows-buffer"),
        (["--update-interval", "soon"], "--update-interval"),
        (["--tls-relay-client-cert-file", "c.pem", "--tls-relay-client-key-file", "k.pem"],
         "--tls-relay-client-cert-file needs --tls-relay-ca-cert-files"),
        (["--disable-tls", "--tls-relay-ca-cert-files", "ca.pem"], "--disable-tls contradicts"),
    ],
)  # fmt: skip
def test_bad_flags_exit_2_with_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["serve", *args])
    except SystemExit as exc:  # argparse refuses a value of the wrong type itself
        code = int(str(exc.code))
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_an_unusable_tls_file_stops_the_start_with_its_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing-ca.crt"
    assert main(["serve", "--listen-address", "127.0.0.1:0", "--tls-relay-ca-cert-files",
                 str(missing)]) == 1  # fmt: skip
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("cilia-hubble-ui: cannot start: ") and str(missing) in last, last
