"""The OCI image tarball the kubelet node imports (cilia_testkit.ociimage.write_oci_image):
a valid image layout whose digests and sizes match their blobs."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import pathlib
import tarfile

from cilia_testkit.ociimage import write_oci_image


def test_the_image_layout_is_consistent_and_holds_the_binary(tmp_path: pathlib.Path) -> None:
    binary = tmp_path / "prog"
    binary.write_bytes(b"\x7fELF fake program")
    out = write_oci_image(binary, tmp_path / "image.tar", name="cilia.test/x:2")
    with tarfile.open(out) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}

    def blob(descriptor: dict[str, object]) -> bytes:
        digest = str(descriptor["digest"])
        data = files[f"blobs/sha256/{digest.split(':', 1)[1]}"]
        assert "sha256:" + hashlib.sha256(data).hexdigest() == digest
        assert len(data) == descriptor["size"]
        return data

    [entry] = json.loads(files["index.json"])["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == "cilia.test/x:2"
    manifest = json.loads(blob(entry))
    config = json.loads(blob(manifest["config"]))
    [layer_desc] = manifest["layers"]
    raw = gzip.decompress(blob(layer_desc))
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(raw).hexdigest()]
    assert config["config"]["Entrypoint"] == ["/testpod"]
    with tarfile.open(fileobj=io.BytesIO(raw)) as layer:
        [member] = layer.getmembers()
        assert member.name == "testpod" and member.mode == 0o755
        assert layer.extractfile(member).read() == binary.read_bytes()  # type: ignore[union-attr]
