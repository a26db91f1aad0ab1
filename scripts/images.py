"""Build Cilia's container images through the Docker SDK (``make images``).

One image per service (DESIGN.md §1: "CI builds one image per service"), built from
``services/<service>/Dockerfile`` and tagged ``cilia-<service>:<version>`` plus
``cilia-<service>:git-<short revision>``; labelled with the OCI keys
``org.opencontainers.image.{title,version,revision,created,source}``.

No image registry is reachable on the project's machines (only PyPI, Debian, npm and the
Go module proxy are), so the base image every Dockerfile starts
``FROM`` (default ``cilia-base:bookworm``) is built locally when it is missing:
``debootstrap --variant=minbase`` of Debian bookworm from the host's configured mirror, then
``docker import``. pip is never run against an index inside a container: the host builds
wheels (``pip wheel`` with ``constraints.txt``) into ``build/images/wheels`` and the
Dockerfiles install them with ``pip install --no-index``. Debian packages a runtime stage
needs (the agent's libbpf1, iptables, kmod; redis-server) are installed by ``apt-get`` inside the
build, which runs with the host's network (``network_mode=host``) and is then cached by the
engine's layer cache.

Importable (tests, the safe-agent-updater's Docker-mode tests)::

    from images import ensure_base_image, build_service
    ensure_base_image()
    image_id = build_service("agent", tag="cilia-agent:test-a",
                             extra_labels={"io.cilia.test": "a"})

Command line (``scripts/images.sh`` runs this with the project's ``.venv``)::

    python scripts/images.py [--base-image NAME] [--tag TAG] [--quiet] [SERVICE ...]

Environment: ``CILIA_BASE_IMAGE`` (base image name), ``CILIA_IMAGE_TAG`` (tag instead of the
version), ``CILIA_DEBIAN_MIRROR`` (mirror for debootstrap; default: the host's apt source).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fcntl
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import docker
import docker.errors

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("operator", "agent", "cni", "relay", "safe-agent-updater", "hubble-ui")
#: Image-only targets that are not Python services (built from deploy/).
EXTRA_IMAGES = {"redis": ROOT / "deploy" / "images" / "redis.Dockerfile"}
DEFAULT_BASE_IMAGE = "cilia-base:bookworm"
#: Debian packages of the base image (every runtime stage starts from it).
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "iproute2")
DEBIAN_SUITE = "bookworm"
BUILD_DIR = ROOT / "build" / "images"
#: Fixed zip timestamps for the project's own wheels, so an unchanged source gives a
#: byte-identical wheel and the engine's layer cache stays valid (seconds since the epoch).
SOURCE_DATE_EPOCH = "1700000000"
#: Images built at the same time by :func:`build_all` (``--jobs``).
DEFAULT_JOBS = 2
#: Seconds the Docker SDK waits for one API call (a build streams, so this bounds silence).
DOCKER_TIMEOUT = 900
#: Local (non-PyPI) packages: name of the wheel's distribution -> source directory.
LOCAL_PACKAGES = {"cilia_api": ROOT / "proto", "cilia_common": ROOT / "lib" / "common"}

Progress = Callable[[str], None]


class ImageBuildError(RuntimeError):
    """A build step failed; the message names the image and carries the engine's error."""


def _say(msg: str) -> None:
    print(f"[images] {msg}", file=sys.stderr, flush=True)


def docker_client() -> docker.DockerClient:
    """A Docker SDK client for the local engine (``DOCKER_HOST`` or /var/run/docker.sock).

    Raises:
        ImageBuildError: the engine does not answer (start it: ``scripts/setup.sh``).
    """
    try:
        client = docker.from_env(timeout=DOCKER_TIMEOUT)
        client.ping()
    except docker.errors.DockerException as exc:
        raise ImageBuildError(
            f"Docker engine not reachable ({exc}); scripts/setup.sh installs docker.io and "
            "starts dockerd"
        ) from exc
    return client


def have_image(client: docker.DockerClient, name: str) -> bool:
    """Whether image ``name`` (``repo:tag`` or id) exists in the local engine."""
    try:
        client.images.get(name)
    except docker.errors.ImageNotFound:
        return False
    return True


def service_version(service: str) -> str:
    """The ``version`` of ``services/<service>/pyproject.toml`` (e.g. ``"0.1.0"``).

    Raises:
        ImageBuildError: unknown service or no version line.
    """
    path = ROOT / "services" / service / "pyproject.toml"
    if not path.is_file():
        raise ImageBuildError(f"unknown service {service!r}: {path} does not exist")
    m = re.search(r'^version\s*=\s*"([^"]+)"', path.read_text(), re.M)
    if not m:
        raise ImageBuildError(f"no version in {path}")
    return m.group(1)


def git_revision() -> str:
    """``HEAD``'s full commit id, or ``"unknown"`` outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def _debian_mirror() -> str:
    """The Debian mirror debootstrap uses: ``CILIA_DEBIAN_MIRROR`` or the host's apt source."""
    env = os.environ.get("CILIA_DEBIAN_MIRROR")
    if env:
        return env
    for src in [
        *sorted(Path("/etc/apt").glob("sources.list.d/*.sources")),
        Path("/etc/apt/sources.list"),
    ]:
        try:
            text = src.read_text()
        except OSError:
            continue
        for m in re.finditer(r"^URIs:\s*(\S+)", text, re.M):
            if "security" not in m.group(1) and "debian" in m.group(1):
                return m.group(1)
        for m in re.finditer(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+bookworm\s", text, re.M):
            return m.group(1)
    return "http://deb.debian.org/debian"


def ensure_base_image(
    name: str | None = None,
    *,
    client: docker.DockerClient | None = None,
    progress: Progress = _say,
) -> str:
    """Make sure base image ``name`` exists locally; build it with debootstrap if not.

    Args:
        name: image ``repo:tag``; default ``CILIA_BASE_IMAGE`` or ``cilia-base:bookworm``.
            A name other than the default is only checked (and pulled if a registry
            answers), never built.
        client: Docker SDK client (default: :func:`docker_client`).
        progress: receives one human-readable line per step.

    Returns:
        The image name.

    Raises:
        ImageBuildError: the image is missing and cannot be pulled or built (no
            debootstrap, not root, mirror unreachable).

    The local build: ``debootstrap --variant=minbase --include=<BASE_PACKAGES>`` of Debian
    bookworm (about 40-60 s from the configured mirror, ~290 MB), the apt lists and caches
    removed, then ``docker import`` with ``LANG=C.UTF-8``.
    """
    name = name or os.environ.get("CILIA_BASE_IMAGE") or DEFAULT_BASE_IMAGE
    client = client or docker_client()
    if have_image(client, name):
        return name
    if name != DEFAULT_BASE_IMAGE:
        progress(f"base image {name} missing locally; trying to pull it")
        try:
            client.images.pull(name)
        except docker.errors.APIError as exc:
            raise ImageBuildError(
                f"base image {name} is not present and cannot be pulled ({exc}); only "
                f"{DEFAULT_BASE_IMAGE} is built locally"
            ) from exc
        return name
    with _lock("base"):
        if have_image(client, name):  # built by a concurrent caller while we waited
            return name
        return _build_base(client, name, progress)


@contextlib.contextmanager
def _lock(what: str) -> Iterator[None]:
    """Exclusive host-wide lock (flock on /tmp/cilia-images-<what>.lock): concurrent test
    sessions must not debootstrap or write build/images at the same time."""
    with open(f"/tmp/cilia-images-{what}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build_base(client: docker.DockerClient, name: str, progress: Progress) -> str:
    if shutil.which("debootstrap") is None:
        raise ImageBuildError(
            "debootstrap is missing (apt-get install debootstrap, or run scripts/setup.sh)"
        )
    if os.geteuid() != 0:
        raise ImageBuildError(f"building {name} with debootstrap needs root")
    mirror = _debian_mirror()
    started = time.monotonic()
    progress(f"building base image {name}: debootstrap {DEBIAN_SUITE} from {mirror}")
    with tempfile.TemporaryDirectory(prefix="cilia-base.") as tmp:
        rootfs = Path(tmp) / "rootfs"
        cmd = [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(BASE_PACKAGES)}",
            DEBIAN_SUITE,
            str(rootfs),
            mirror,
        ]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        assert proc.stdout is not None
        tail: deque[str] = deque(maxlen=20)
        for line in proc.stdout:
            tail.append(line.rstrip())
            if line.startswith(("I: Retrieving", "I: Installing", "I: Configuring", "I: Base")):
                progress(f"  debootstrap: {line.strip()[3:]}")
        if proc.wait() != 0:
            raise ImageBuildError(
                f"debootstrap failed (exit {proc.returncode}):\n" + "\n".join(tail)
            )
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (rootfs / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        progress(f"  debootstrap done in {time.monotonic() - started:.0f} s; docker import")
        tar = subprocess.Popen(
            ["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE
        )
        assert tar.stdout is not None
        repo, _, tag = name.rpartition(":")
        client.api.import_image_from_stream(
            tar.stdout,
            repository=repo,
            tag=tag,
            changes=[
                "ENV LANG=C.UTF-8",
                'CMD ["/bin/bash"]',
                f'LABEL org.opencontainers.image.title="{name}" '
                f'org.opencontainers.image.description="debootstrap {DEBIAN_SUITE} minbase '
                f'+ {" ".join(BASE_PACKAGES)}"',
            ],
        )
        if tar.wait() != 0:
            raise ImageBuildError("tar of the debootstrap root failed")
    if not have_image(client, name):
        raise ImageBuildError(f"docker import did not produce {name}")
    progress(f"base image {name} ready in {time.monotonic() - started:.0f} s")
    return name


def _local_deps(service: str) -> list[tuple[str, Path]]:
    """(wheel distribution name, source dir) of the project packages a service installs."""
    src = ROOT / "services" / service
    deps = (src / "pyproject.toml").read_text()
    out = [(dist, path) for dist, path in LOCAL_PACKAGES.items() if dist.replace("_", "-") in deps]
    return [*out, (f"cilia_{service.replace('-', '_')}", src)]


def _third_party_requirements(sources: Iterable[Path]) -> list[str]:
    """Runtime requirements of the given pyproject.toml dirs, without the cilia-* ones."""
    import tomllib

    reqs: set[str] = set()
    for src in sources:
        data = tomllib.loads((src / "pyproject.toml").read_text())
        for req in data.get("project", {}).get("dependencies", []):
            if not re.match(r"cilia[-_]", req):
                reqs.add(req)
    return sorted(reqs)


def _wheel_python(progress: Progress) -> Path:
    """A venv of the host's Debian ``/usr/bin/python3`` (``build/images/pyenv``) that runs
    ``pip wheel``: the base image's interpreter is the same Debian python3 (3.11.2), so
    environment markers (e.g. ``python_full_version < "3.11.3"``) resolve as in the image.
    The project's .venv may be another 3.11 (pyenv) and would pick different wheels."""
    venv = BUILD_DIR / "pyenv"
    py = venv / "bin" / "python"
    if not py.exists():
        system = Path("/usr/bin/python3")
        if not system.exists():
            raise ImageBuildError("/usr/bin/python3 missing (Debian python3 + python3-venv)")
        progress(f"creating {venv.relative_to(ROOT)} from {system}")
        res = subprocess.run([str(system), "-m", "venv", str(venv)], capture_output=True, text=True)
        if res.returncode != 0:
            raise ImageBuildError(f"python3 -m venv failed: {res.stderr.strip()}")
    return py


_DIGEST_SKIP = {"build", "__pycache__", "tests", ".pytest_cache", ".mypy_cache", "dist"}


def _source_digest(src: Path) -> str:
    """sha256 (16 hex) over the paths and bytes of a package's source tree, skipping build
    output, caches, tests and ``*.egg-info``."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _DIGEST_SKIP and not d.endswith(".egg-info")
        )
        for name in sorted(filenames):
            if name.endswith((".pyc", ".whl")) or name == "Dockerfile":
                continue
            path = Path(dirpath) / name
            h.update(path.relative_to(src).as_posix().encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def build_wheels(services: Iterable[str] = SERVICES, *, progress: Progress = _say) -> Path:
    """Build every wheel the images install into ``build/images/wheels`` (on the host).

    Layout: ``deps/`` (third-party wheels pinned by constraints.txt, resolved by the host's
    Debian python3 like the image's), ``local/<service>/`` (cilia-api, cilia-common if used,
    and the service's wheel; reproducible through ``SOURCE_DATE_EPOCH``, cached in
    ``cache/`` by a digest of their sources so an unchanged package is not rebuilt) and
    ``<service>.requirements.txt`` (third-party top-level requirements). Third-party and own
    wheels are separate so a code change rebuilds only an image's last layers.

    Returns:
        The wheels directory.

    Raises:
        ImageBuildError: ``pip wheel`` failed (its output is in the message).
    """
    with _lock("wheels"):
        return _build_wheels(list(services), progress)


def _pip_wheel(py: Path, args: list[str]) -> None:
    env = dict(os.environ, SOURCE_DATE_EPOCH=SOURCE_DATE_EPOCH, PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PIP_CONSTRAINT", None)
    res = subprocess.run(
        [str(py), "-m", "pip", "wheel", "-q", *args], env=env, capture_output=True, text=True
    )
    if res.returncode != 0:
        raise ImageBuildError(f"pip wheel {' '.join(args)} failed:\n{res.stdout}\n{res.stderr}")


def _build_wheels(services: list[str], progress: Progress) -> Path:
    out = BUILD_DIR / "wheels"
    deps, cache = out / "deps", out / "cache"
    deps.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    py = _wheel_python(progress)
    started = time.monotonic()
    constraints = ROOT / "constraints.txt"
    # 1. the project's own wheels, each rebuilt only when its sources changed
    local: dict[str, Path] = {}
    for dist, src in {d: p for svc in services for d, p in _local_deps(svc)}.items():
        slot = cache / f"{dist}-{_source_digest(src)}"
        if not any(slot.glob("*.whl")):
            progress(f"pip wheel {src.relative_to(ROOT)}")
            tmp = Path(tempfile.mkdtemp(prefix=f".{dist}.", dir=cache))
            _pip_wheel(py, ["--no-deps", "-c", str(constraints), "-w", str(tmp), str(src)])
            for old in cache.glob(f"{dist}-*"):
                shutil.rmtree(old)
            tmp.rename(slot)
        (local[dist],) = slot.glob("*.whl")
    # 2. third-party wheels, fetched only when the requirements or constraints changed
    reqs = sorted(
        {r for svc in services for r in _third_party_requirements(p for _, p in _local_deps(svc))}
    )
    stamp_text = "\n".join([*reqs, constraints.read_text()])
    stamp = deps / f".stamp-{hashlib.sha256(stamp_text.encode()).hexdigest()[:16]}"
    if not stamp.exists():
        progress(f"pip wheel {len(reqs)} third-party requirements (constraints.txt)")
        req_file = out / ".all.requirements.txt"
        req_file.write_text("\n".join(reqs) + "\n")
        _pip_wheel(py, ["-c", str(constraints), "-w", str(deps), "-r", str(req_file)])
        stamp.touch()
    # 3. per service: its own wheels and its top-level third-party requirements
    for svc in services:
        target = out / "local" / svc
        wanted = {local[d].name for d, _ in _local_deps(svc)}
        target.mkdir(parents=True, exist_ok=True)
        for old in target.glob("*.whl"):
            if old.name not in wanted:
                old.unlink()
        for dist, _ in _local_deps(svc):
            if not (target / local[dist].name).exists() or (
                (target / local[dist].name).read_bytes() != local[dist].read_bytes()
            ):
                shutil.copy2(local[dist], target / local[dist].name)
        svc_reqs = _third_party_requirements(p for _, p in _local_deps(svc))
        _write_if_changed(out / f"{svc}.requirements.txt", "\n".join(svc_reqs) + "\n")
    _write_if_changed(out / "constraints.txt", constraints.read_text())
    progress(f"wheels ready in {time.monotonic() - started:.0f} s")
    return out


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def _context_files(service: str, dockerfile: Path) -> Iterator[tuple[Path, str]]:
    """(host path, path in the build context) of every file a service's build needs."""
    yield dockerfile, dockerfile.relative_to(ROOT).as_posix()
    images_dir = ROOT / "deploy" / "images"
    for p in sorted(images_dir.rglob("*")):
        if p.is_file():
            yield p, p.relative_to(ROOT).as_posix()
    if service in SERVICES:
        wheels = BUILD_DIR / "wheels"
        for p in sorted((wheels / "deps").glob("*.whl")):
            yield p, p.relative_to(ROOT).as_posix()
        for p in sorted((wheels / "local" / service).glob("*.whl")):
            yield p, p.relative_to(ROOT).as_posix()
        for name in (f"{service}.requirements.txt", "constraints.txt"):
            yield wheels / name, (wheels / name).relative_to(ROOT).as_posix()
    if service == "cni":
        # What hosts get as cilia-cni: the static executable (services/cni/shim) and the
        # version file cilia-cni-install names its copy by.
        yield static_cni(), "build/images/cni-bin/cilia-cni"
        version = BUILD_DIR / "cni-version" / "cilia-cni.version"
        version.parent.mkdir(parents=True, exist_ok=True)
        version.write_text(service_version("cni") + "\n")
        yield version, "build/images/cni-bin/.cilia-cni/cilia-cni.version"
    if service == "agent":
        yield ROOT / "Makefile", "Makefile"  # the bpf stage runs its `make bpf` rule
        for p in sorted((ROOT / "bpf").rglob("*")):
            if (
                p.is_file()
                and "tests" not in p.relative_to(ROOT / "bpf").parts
                and (p.suffix in (".c", ".h"))
            ):
                yield p, p.relative_to(ROOT).as_posix()


def static_cni() -> Path:
    """The static ``cilia-cni`` executable (``make cni-shim``: services/cni/shim, linked
    with ``-static``), built when missing or older than its source.

    Raises:
        ImageBuildError: it could not be built (the compiler's reason).
    """
    res = subprocess.run(
        ["make", "-C", str(ROOT), "--no-print-directory", "cni-shim"],
        capture_output=True,
        text=True,
        check=False,
    )
    if res.returncode != 0:
        raise ImageBuildError(f"the static cilia-cni could not be built: {res.stderr.strip()}")
    return ROOT / "build" / "cni" / "cilia-cni"


def _context_tar(files: Iterable[tuple[Path, str]]) -> io.BytesIO:
    """An uncompressed tar of the build context with fixed owners and mtimes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for host, arc in files:
            info = tar.gettarinfo(str(host), arcname=arc)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = int(SOURCE_DATE_EPOCH)
            with host.open("rb") as fh:
                tar.addfile(info, fh)
    buf.seek(0)
    return buf


def image_tags(service: str, tag: str | None = None) -> list[str]:
    """Tags :func:`build_service` applies: ``[tag]`` when given, else
    ``cilia-<service>:<CILIA_IMAGE_TAG or version>`` and ``cilia-<service>:git-<rev12>``."""
    if tag:
        return [tag]
    version = os.environ.get("CILIA_IMAGE_TAG") or (
        service_version(service) if service in SERVICES else "bookworm"
    )
    tags = [f"cilia-{service}:{version}"]
    rev = git_revision()
    if rev != "unknown":
        tags.append(f"cilia-{service}:git-{rev[:12]}")
    return tags


def build_service(
    service: str,
    tag: str | None = None,
    *,
    extra_labels: dict[str, str] | None = None,
    build_args: dict[str, str] | None = None,
    base_image: str | None = None,
    client: docker.DockerClient | None = None,
    progress: Progress | None = _say,
    wheels: bool = True,
    nocache: bool = False,
) -> str:
    """Build one service image (or ``"redis"``) and return its image id (``sha256:…``).

    Args:
        service: one of :data:`SERVICES` or a key of :data:`EXTRA_IMAGES`.
        tag: single ``repo:tag`` to apply; default :func:`image_tags`.
        extra_labels: labels added to the image (e.g. to make two builds of the same
            code differ: an updater test's images A and B).
        build_args: extra ``--build-arg``s (the Dockerfiles take BASE_IMAGE, VERSION,
            GIT_REVISION, CREATED).
        base_image: base image (default: :func:`ensure_base_image`'s default), built
            first when missing.
        progress: receives the engine's build log line by line (``None``: silent).
        wheels: build the host wheels first (False: reuse ``build/images/wheels``).
        nocache: build without the engine's layer cache.

    Raises:
        ImageBuildError: a build step failed (message: the engine's error and the last
            log lines).
    """
    say = progress or (lambda _m: None)
    client = client or docker_client()
    if service in SERVICES:
        dockerfile = ROOT / "services" / service / "Dockerfile"
    elif service in EXTRA_IMAGES:
        dockerfile = EXTRA_IMAGES[service]
    else:
        raise ImageBuildError(
            f"unknown image {service!r}; known: {', '.join([*SERVICES, *EXTRA_IMAGES])}"
        )
    base = ensure_base_image(base_image, client=client, progress=say)
    if service in SERVICES and (wheels or not (BUILD_DIR / "wheels" / "local" / service).is_dir()):
        build_wheels([service], progress=say)
    tags = image_tags(service, tag)
    version = tags[0].rpartition(":")[2]
    revision = git_revision()
    args = {
        "BASE_IMAGE": base,
        "VERSION": service_version(service) if service in SERVICES else version,
        "GIT_REVISION": revision,
    }
    args.update(build_args or {})
    with _lock("wheels"):
        context = _context_tar(_context_files(service, dockerfile))
    started = time.monotonic()
    say(f"building {tags[0]} (base {base})")
    image_id = ""
    tail: deque[str] = deque(maxlen=30)
    for chunk in client.api.build(
        fileobj=context,
        custom_context=True,
        dockerfile=dockerfile.relative_to(ROOT).as_posix(),
        tag=tags[0],
        buildargs=args,
        labels=dict(extra_labels or {}),
        rm=True,
        forcerm=True,
        nocache=nocache,
        network_mode="host",
        decode=True,
    ):
        if "error" in chunk:
            raise ImageBuildError(
                f"building {tags[0]} failed: {chunk['error'].strip()}\n" + "\n".join(tail)
            )
        line = chunk.get("stream", "")
        for ln in line.splitlines():
            if ln.strip():
                tail.append(ln)
                if ln.startswith("Step ") or not ln.startswith(" ---> "):
                    say(f"  {service}: {ln.rstrip()}")
        aux = chunk.get("aux")
        if isinstance(aux, dict) and "ID" in aux:
            image_id = aux["ID"]
    if not image_id:
        image_id = str(client.images.get(tags[0]).id)
    for extra in tags[1:]:
        repo, _, t = extra.rpartition(":")
        client.api.tag(image_id, repo, t)
    size = client.images.get(image_id).attrs.get("Size", 0)
    say(
        f"built {', '.join(tags)} ({image_id[7:19]}, {size / 1e6:.0f} MB) in "
        f"{time.monotonic() - started:.0f} s"
    )
    return str(image_id)


def build_all(
    services: Iterable[str] = (*SERVICES, *EXTRA_IMAGES),
    *,
    tag: str | None = None,
    base_image: str | None = None,
    progress: Progress = _say,
    nocache: bool = False,
    jobs: int = DEFAULT_JOBS,
) -> dict[str, str]:
    """Build the base image (if missing), the wheels once, then the images, ``jobs`` at a
    time (each build with its own SDK client; the engine runs them concurrently).

    Returns:
        ``{service: image id}``.

    Raises:
        ImageBuildError: the first failing build (the others are still waited for).
    """
    services = list(services)
    client = docker_client()
    base = ensure_base_image(base_image, client=client, progress=progress)
    py = [s for s in services if s in SERVICES]
    if py:
        build_wheels(py, progress=progress)

    def one(svc: str) -> str:
        return build_service(
            svc,
            tag.replace("{service}", svc) if tag else None,
            base_image=base,
            client=docker_client(),
            progress=progress,
            wheels=False,
            nocache=nocache,
        )

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {svc: pool.submit(one, svc) for svc in services}
        return {svc: fut.result() for svc, fut in futures.items()}


def main(argv: list[str] | None = None) -> int:
    """CLI: build the named images (default: all). Exit 0, or 1 with the error on stderr."""
    ap = argparse.ArgumentParser(
        prog="scripts/images.sh", description="Build Cilia's container images."
    )
    ap.add_argument(
        "images",
        nargs="*",
        metavar="IMAGE",
        help=f"images to build (default: {' '.join([*SERVICES, *EXTRA_IMAGES])})",
    )
    ap.add_argument(
        "--base-image",
        help=f"base image (default {DEFAULT_BASE_IMAGE}, built with debootstrap when missing)",
    )
    ap.add_argument(
        "--tag",
        help="tag instead of cilia-<svc>:<version> + :git-<rev>; "
        "'{service}' is replaced by the image name",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=DEFAULT_JOBS,
        help=f"images built concurrently, >= 1 (default {DEFAULT_JOBS})",
    )
    ap.add_argument("--no-cache", action="store_true", help="ignore the engine's layer cache")
    ap.add_argument("--quiet", action="store_true", help="print only one line per image")
    ap.add_argument(
        "--wheels-only",
        action="store_true",
        help="only build build/images/wheels (for a hand-run `docker build`)",
    )
    ns = ap.parse_args(argv)
    if ns.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {ns.jobs}")
    known = (*SERVICES, *EXTRA_IMAGES)
    for name in ns.images:
        if name not in known:
            ap.error(f"unknown image {name!r}; known: {' '.join(known)}")
    progress: Progress = _say
    if ns.quiet:

        def progress(msg: str) -> None:
            if msg.startswith(("built ", "base image")):
                _say(msg)

    started = time.monotonic()
    if ns.wheels_only:
        try:
            build_wheels([s for s in ns.images or SERVICES if s in SERVICES], progress=progress)
        except ImageBuildError as exc:
            _say(f"error: {exc}")
            return 1
        return 0
    try:
        ids = build_all(
            ns.images or known,
            tag=ns.tag,
            base_image=ns.base_image,
            progress=progress,
            nocache=ns.no_cache,
            jobs=ns.jobs,
        )
    except ImageBuildError as exc:
        _say(f"error: {exc}")
        return 1
    _say(f"{len(ids)} images built in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
