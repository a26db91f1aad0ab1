"""An OCI image made here, without a registry: one static binary as the whole image.

The test node's containerd imports it (``ctr images import``); the kubelet node
(:mod:`cilia_testkit.kubelet`) uses it for every test pod and as the sandbox image.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import pathlib
import tarfile

#: The image every test pod (and the sandbox) uses, imported into the node's containerd.
IMAGE = "cilia.test/testpod:1"


def write_oci_image(binary: pathlib.Path, out: pathlib.Path, name: str = IMAGE) -> pathlib.Path:
    """Write an OCI image layout tarball (``oci-layout``, ``index.json``, ``blobs/sha256``)
    of one layer holding ``binary`` as ``/testpod`` (mode 0755), entrypoint ``/testpod``,
    command ``pause``, linux/amd64; the index entry is annotated with ``name``
    (``io.containerd.image.name``, what ``ctr images import`` names it). Returns ``out``.

    Shapes: OCI image-spec v1.0 (image layout, manifest, config)."""
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return digest

    layer_tar = io.BytesIO()
    with tarfile.open(fileobj=layer_tar, mode="w") as tar:
        info = tar.gettarinfo(str(binary), arcname="testpod")
        info.mode, info.uid, info.gid, info.uname, info.gname, info.mtime = 0o755, 0, 0, "", "", 0
        with binary.open("rb") as f:
            tar.addfile(info, f)
    raw = layer_tar.getvalue()
    diff_id = "sha256:" + hashlib.sha256(raw).hexdigest()
    layer = gzip.compress(raw, mtime=0)
    layer_digest = blob(layer)
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": ["/testpod"], "Cmd": ["pause"], "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        },
        sort_keys=True,
    ).encode()
    config_digest = blob(config)
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": len(config),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": layer_digest,
                    "size": len(layer),
                }
            ],
        },
        sort_keys=True,
    ).encode()
    manifest_digest = blob(manifest)
    index = json.dumps(
        {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": manifest_digest,
                    "size": len(manifest),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1],
                    },
                }
            ],
        }
    ).encode()
    with tarfile.open(out, "w") as tar:

        def add(path: str, data: bytes) -> None:
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))

        add("oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        add("index.json", index)
        for digest, data in blobs.items():
            add(f"blobs/sha256/{digest.split(':', 1)[1]}", data)
    return out
