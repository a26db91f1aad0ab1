"""Build the self-contained ``cilia-cni`` (no Python needed on the host) and cache it.

The plugin stays Python; PyInstaller (pinned in constraints.txt) collects it in **onedir**
mode: one executable plus its support directory, which a host runs without any
interpreter, library or package of its own (the bundle carries libpython, the extension
modules, the libraries they link and the pure-Python modules the plugin imports; it needs
the host's glibc, 2.36 or newer for a bundle built on Debian 12). The executable is then
replaced by ``launcher.c``, compiled here: it dlopens the bundle's libpython and runs the
plugin's ``main()`` in its own process (see that file). Layout of a bundle::

    <bundle>/cilia-cni            the executable (launcher.c)
    <bundle>/.cilia-cni/          libpython3.11.so.1.0, extension modules, the modules' .pyc,
                                  cilia-cni.version (the plugin's version, one line)

``cilia-cni-install`` (deploy/images/cni-install.sh) copies a bundle onto a host and points
``/opt/cni/bin/cilia-cni`` at its executable (services/cni/README.md "Frozen binary").

Why onedir and these options (measured, services/cni/README.md "Frozen binary"):

- onefile unpacks its whole archive into a temporary directory on every exec: VERSION took
  379 ms against 27 ms for onedir on the same host, so a runtime would pay it per pod;
- ``inspect``, ``multiprocessing``, ``pkgutil`` and ``ctypes`` are excluded: the plugin
  never imports them at run time (they are reachable only through modules' unused code
  paths), but when they are in the bundle PyInstaller's runtime hooks (and its bootstrap,
  for ctypes) import them at every start-up (VERSION 73 ms with the first three, 27 ms
  without);
- ``--debug noarchive`` (despite the flag's group, no debugging is switched on): every
  module is collected as a ``.pyc`` file in the support directory instead of into the
  zlib-compressed PYZ archive and ``base_library.zip``, so the interpreter's own path
  finder loads them, as in a venv, without PyInstaller's pure-Python importer decompressing
  each one (CPU of an ADD up to the agent call, n=40: PYZ bundle p50 94.2 ms, noarchive
  83.1, venv launcher 85.5). The launcher depends on it: it runs no PyInstaller importer;
- the launcher instead of PyInstaller's bootloader: on Linux the bootloader re-executes
  itself once per start (to put the support directory on ``LD_LIBRARY_PATH``) and runs its
  bootstrap (its importer, run-time hooks) before the plugin. VERSION CPU per exec
  (medians of 30, interleaved, ``env -i``): bootloader 21.4 ms, launcher 15.3 ms; with the
  restart skipped by setting the bootloader's internal ``_PYI_*`` variables in the host
  wrapper: ~1 ms saved only, and it would depend on PyInstaller internals, so not used.

What start-up costs now, and what was tried (2026-12-02, CPU = user + system per exec,
interleaved, medians of n=20-30 on a loaded 2-core host; services/cni/tests/integration/
measure_startup.py and ``python -m bench cni_latency``):

- the plugin's own imports were most of it: ``json`` (its decoder and encoder compile
  regular expressions at import, so ``re``, ``enum``, ``functools``, ``collections``) and
  ``ipaddress`` (``functools``, ``collections``). The plugin now uses
  :mod:`cilia_cni.jsonio` (``_json``'s C scanner and encoder), string checks for its two
  patterns and ``inet_pton`` for the agent's addresses: VERSION 30.0 -> 17.3 ms CPU,
  ADD (contract-level agent peer) 34.5 -> 21.1, DEL 34.5 -> 23.5; against a real stack
  the plugin's CPU per ADD went 43-46 -> 27-28 ms (bench, through the installed wrapper);
  ``python3 -I -S -c pass`` of the same interpreter is ~10 ms;
- Nuitka 4.3.3 ``--standalone --python-flag=no_site`` (gcc 12, no LTO), same sources:
  slower to start than this bundle, before the import trimming (VERSION 34.6 vs 30.0 ms
  CPU, ADD 42.0 vs 34.5) and after it (VERSION 27.7 vs 15.7, ADD 32.2 vs 23.9, DEL 32.7
  vs 19.7), 27 MB, and a cold build of 6.7-7.6 min wall on one niced core (156-170 s CPU)
  against PyInstaller's 13-25 s: not adopted;
- ``--optimize 2`` (no docstrings or asserts) and ``--python-option "X frozen_modules=on"``:
  no measurable change (VERSION 20.1 vs 20.3 and 19.1 vs 19.0 ms CPU), not used;
- what was left above the bare interpreter (~5 ms): the bootloader's restart of itself
  and PyInstaller's bootstrap modules; gone with the launcher (the plugin's VERSION through
  it costs what ``python3 -I -S`` running the same code costs, ~15-16 ms here, of which
  ~10-12 ms is the interpreter's own start).

Cache: ``${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/cni-bin/<cilia-cni version>-pyinstaller<version>-
<16 hex>/cilia-cni/``, the hex a sha256 over every input (this file, entry.py, launcher.c,
the plugin's
sources, the versions of the frozen distributions and of
PyInstaller, the interpreter's version and platform). A present bundle is reused, so
``scripts/setup.sh`` and CI pay the build (~10-20 s) once per change of the plugin. Bundles
unused for ``--prune-days`` days are removed after a build.

Usage (with the project's ``.venv/bin/python``, which has PyInstaller and the plugin)::

    python services/cni/freeze/build.py          # build when missing; print the executable
    python services/cni/freeze/build.py --path   # print where it is (or would be); build nothing

Exit status: 0 built or cached (the executable's path on stdout); 2 the build, the
launcher's compilation (``$CC``, ``cc`` or ``clang-14`` and the interpreter's ``Python.h``
are needed) or the smoke test (VERSION with an empty environment) failed, the reason on
stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CNI_ROOT = HERE.parent
#: Name of the executable and of its support directory's dot-name (``.cilia-cni``).
NAME = "cilia-cni"
CONTENTS_DIR = f".{NAME}"
#: Modules left out of the bundle (see the module docstring: PyInstaller's start-up imports
#: them when they are bundled, and the plugin itself never imports them).
EXCLUDED_MODULES = ("inspect", "multiprocessing", "pkgutil", "ctypes")
#: Distributions whose version decides the bundle's content (the plugin's own sources are
#: hashed by content; protobuf and google.rpc are imported on the agent-error path only).
FROZEN_DISTRIBUTIONS = (
    "cilia-cni",
    "protobuf",
    "googleapis-common-protos",
    "pyinstaller",
    "pyinstaller-hooks-contrib",
)
#: The executable's C source (replaces PyInstaller's bootloader; see the module docstring).
LAUNCHER = HERE / "launcher.c"
#: The shared CPython library PyInstaller collects into the support directory.
LIBPYTHON = f"libpython{sys.version_info.major}.{sys.version_info.minor}.so.1.0"
#: The plugin's version, written into the support directory for cilia-cni-install.
VERSION_FILE = "cilia-cni.version"
DEFAULT_PRUNE_DAYS = 14
#: Seconds the PyInstaller run may take (measured 8-20 s on 2 busy cores).
DEFAULT_BUILD_TIMEOUT_SECONDS = 900.0
#: Seconds the smoke test (one VERSION exec of the new bundle) may take.
SMOKE_TIMEOUT_SECONDS = 30.0


class FreezeError(RuntimeError):
    """The bundle could not be built or does not run; the message says why."""


def cache_root() -> Path:
    """``${CILIA_CACHE_DIR:-$HOME/.cache/cilia}/cni-bin`` (not created here)."""
    base = os.environ.get("CILIA_CACHE_DIR") or os.path.join(Path.home(), ".cache", "cilia")
    return Path(base) / "cni-bin"


def _hash_tree(h: hashlib._Hash, root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".pyc"):
                continue
            path = Path(dirpath) / name
            h.update(path.relative_to(root).as_posix().encode() + b"\0")
            h.update(path.read_bytes() + b"\0")


def input_digest() -> str:
    """sha256 (16 hex) over everything that decides the bundle's bytes.

    Raises:
        FreezeError: a frozen distribution (or PyInstaller) is not installed.
    """
    h = hashlib.sha256()
    h.update(f"{sys.version}\0{sys.platform}\0{platform.machine()}\0".encode())
    _hash_tree(h, HERE)
    _hash_tree(h, CNI_ROOT / "src")
    for dist in FROZEN_DISTRIBUTIONS:
        try:
            h.update(f"{dist}=={importlib.metadata.version(dist)}\0".encode())
        except importlib.metadata.PackageNotFoundError as exc:
            raise FreezeError(f"{dist} is not installed here; run scripts/setup.sh") from exc
    return h.hexdigest()[:16]


def bundle_dir() -> Path:
    """Where the bundle for the current inputs is (or would be): ``<cache>/<key>/cilia-cni``."""
    key = (
        f"{importlib.metadata.version('cilia-cni')}-pyinstaller"
        f"{importlib.metadata.version('pyinstaller')}-{input_digest()}"
    )
    return cache_root() / key / NAME


def smoke_test(executable: Path) -> None:
    """Exec ``executable`` as a runtime would for VERSION, with an EMPTY environment (no
    PATH, so no host python3 could be found) and check the spec's answer.

    Raises:
        FreezeError: it did not exit 0 with the supported versions on stdout.
    """
    res = subprocess.run(
        [str(executable)],
        env={"CNI_COMMAND": "VERSION"},
        input=b'{"cniVersion": "1.0.0"}',
        capture_output=True,
        timeout=SMOKE_TIMEOUT_SECONDS,
        check=False,
    )
    if res.returncode != 0 or b'"supportedVersions"' not in res.stdout:
        raise FreezeError(
            f"the frozen {NAME} failed VERSION (exit {res.returncode}): "
            f"{res.stdout!r} {res.stderr.decode(errors='replace')[-2000:]}"
        )


def compiler() -> str:
    """The C compiler for the launcher: ``$CC``, else ``cc``, else ``clang-14`` (which
    scripts/setup.sh installs for the eBPF programs).

    Raises:
        FreezeError: none of them is installed.
    """
    for candidate in (os.environ.get("CC", ""), "cc", "clang-14"):
        found = shutil.which(candidate) if candidate else None
        if found:
            return found
    raise FreezeError("no C compiler for the launcher ($CC, cc or clang-14); run scripts/setup.sh")


def compile_launcher(executable: Path, contents: Path, work: Path, timeout: float) -> None:
    """Replace PyInstaller's bootloader ``executable`` with :data:`LAUNCHER` compiled
    against this interpreter's headers (it dlopens the bundle's own ``libpython`` at run
    time; RPATH ``$ORIGIN/<support dir>`` for the libraries extension modules link);
    written beside it first, then renamed over it.

    Raises:
        FreezeError: no compiler, no ``Python.h``, no ``libpython`` in the bundle, or the
            compiler failed.
    """
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").is_file():
        raise FreezeError(f"no Python.h in {include}: the interpreter's headers are needed")
    libpython = contents / LIBPYTHON
    if not libpython.is_file():
        raise FreezeError(f"PyInstaller collected no {LIBPYTHON} into {contents}")
    tmp = work / f"{NAME}.launcher"
    cmd = [
        compiler(), "-O2", "-Wall", "-Werror", f"-I{include}", "-o", str(tmp), str(LAUNCHER),
        f"-Wl,--disable-new-dtags,-rpath,$ORIGIN/{CONTENTS_DIR}",
    ]  # fmt: skip
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise FreezeError(f"compiling the launcher took more than {timeout:.0f} s") from exc
    if res.returncode != 0:
        raise FreezeError(f"compiling the launcher failed: {' '.join(cmd)}\n{res.stderr[-4000:]}")
    tmp.chmod(0o755)
    os.replace(tmp, executable)


def build(target: Path, timeout: float = DEFAULT_BUILD_TIMEOUT_SECONDS) -> Path:
    """Run PyInstaller into a temporary directory beside ``target``, smoke-test the result and
    rename it to ``target`` (a concurrent build of the same key loses the rename and keeps
    the winner's bundle). Returns the executable's path.

    Raises:
        FreezeError: PyInstaller failed or timed out, or the smoke test failed.
    """
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent.parent))
    try:
        cmd = [
            sys.executable,
            "-m",
            "PyInstaller",
            "--noconfirm",
            "--log-level",
            "WARN",
            "--onedir",
            "--name",
            NAME,
            "--contents-directory",
            CONTENTS_DIR,
            "--distpath",
            str(work / "dist"),
            "--workpath",
            str(work / "work"),
            "--specpath",
            str(work),
        ]
        cmd += ["--debug", "noarchive"]
        for module in EXCLUDED_MODULES:
            cmd += ["--exclude-module", module]
        cmd.append(str(HERE / "entry.py"))
        env = dict(os.environ, PYTHONHASHSEED="0", SOURCE_DATE_EPOCH="1700000000")
        try:
            res = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise FreezeError(f"PyInstaller took more than {timeout:.0f} s") from exc
        if res.returncode != 0:
            raise FreezeError(f"PyInstaller failed:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}")
        built = work / "dist" / NAME
        compile_launcher(built / NAME, built / CONTENTS_DIR, work, timeout)
        (built / CONTENTS_DIR / VERSION_FILE).write_text(
            importlib.metadata.version("cilia-cni") + "\n"
        )
        smoke_test(built / NAME)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            built.rename(target)
        except OSError:
            if not (target / NAME).exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target / NAME


def prune(keep: Path, days: float) -> list[Path]:
    """Remove cached bundles other than ``keep`` not used (mtime) for ``days``; return them."""
    removed = []
    cutoff = time.time() - days * 86400
    for entry in cache_root().iterdir():
        if entry == keep or entry.name.startswith("."):
            continue
        if entry.is_dir() and entry.stat().st_mtime < cutoff:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def ensure(timeout: float = DEFAULT_BUILD_TIMEOUT_SECONDS) -> Path:
    """The frozen executable for the current sources: the cached one, else a new build.

    Raises:
        FreezeError: see :func:`build` and :func:`input_digest`.
    """
    target = bundle_dir()
    executable = target / NAME
    if executable.is_file() and (target / CONTENTS_DIR).is_dir():
        os.utime(target.parent)  # used now: spared by prune()
        return executable
    return build(target, timeout)


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring."""
    parser = argparse.ArgumentParser(
        prog="services/cni/freeze/build.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--path", action="store_true", help="print the executable's path; build nothing"
    )
    parser.add_argument(
        "--prune-days",
        type=float,
        default=DEFAULT_PRUNE_DAYS,
        help=f"remove other bundles unused for this many days (default {DEFAULT_PRUNE_DAYS})",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_BUILD_TIMEOUT_SECONDS,
        help=f"seconds PyInstaller may take (default {DEFAULT_BUILD_TIMEOUT_SECONDS:.0f})",
    )
    args = parser.parse_args(argv)
    try:
        if args.path:
            print(bundle_dir() / NAME)
            return 0
        started = time.monotonic()
        cached = (bundle_dir() / NAME).is_file()
        executable = ensure(args.timeout)
        if not cached:
            print(
                f"[cni-bin] built {executable} in {time.monotonic() - started:.0f} s",
                file=sys.stderr,
            )
            for old in prune(executable.parent.parent, args.prune_days):
                print(f"[cni-bin] removed unused {old}", file=sys.stderr)
    except FreezeError as exc:
        print(f"[cni-bin] {exc}", file=sys.stderr)
        return 2
    print(executable)
    return 0


if __name__ == "__main__":
    sys.exit(main())
