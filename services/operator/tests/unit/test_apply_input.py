"""`cilia-operator apply -f` refuses unreadable input with one line and exit 2, before any RPC."""

import pathlib
import subprocess
import sys

BIN = pathlib.Path(sys.executable).parent / "cilia-operator"


def test_binary_file_is_refused_with_one_line_and_no_traceback(tmp_path: pathlib.Path) -> None:
    garbage = tmp_path / "random.bin"
    garbage.write_bytes(bytes(range(128, 256)) * 3)

    run = subprocess.run(
        [str(BIN), "apply", "-f", str(garbage), "--server", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert run.returncode == 2
    assert "not UTF-8 text" in run.stderr
    assert "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_missing_file_is_refused_naming_it(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope.yaml"

    run = subprocess.run(
        [str(BIN), "apply", "-f", str(missing), "--server", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert run.returncode == 2
    assert str(missing) in run.stderr
