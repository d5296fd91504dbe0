"""Templates through the Python SDK: an image archive (`docker save`'s layout, made here
with tarfile) imported from bytes, from a path and from an open file; its run config comes
back; the same image under two names is one template; garbage is a 400; get, list and
delete. Each imported name is removed at the end, whatever happens. (Builds are tested by
tests/templates_build.rs on a private template cache.)"""

import hashlib
import io
import json
import tarfile
import uuid

import pytest

from locker import LockerError


def _tar(files):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as t:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _docker_archive(label):
    layer = _tar([("etc/greeting", b"hello from python\n")])
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["GREETING=py"], "WorkingDir": "/srv", "Labels": {"run": label}},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
    }).encode()
    cfg = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": cfg, "Layers": ["l/layer.tar"]}]).encode()
    return _tar([("manifest.json", manifest), (cfg, config), ("l/layer.tar", layer)])


@pytest.fixture
def names(client):
    made = []
    yield made
    for n in made:
        try:
            client.templates.delete(n)
        except LockerError:
            pass


def test_an_image_archive_is_imported_from_bytes_a_path_and_a_file(client, names, tmp_path):
    archive = _docker_archive(uuid.uuid4().hex)
    a, b, c = (f"py-img-{uuid.uuid4().hex[:8]}" for _ in range(3))
    names.extend([a, b, c])
    t = client.templates.import_image(a, archive)
    assert t["name"] == a and t["packages"] == []
    assert t["config"]["workdir"] == "/srv"
    assert t["config"]["env"] == {"GREETING": "py"}
    path = tmp_path / "image.tar"
    path.write_bytes(archive)
    assert client.templates.import_image(b, str(path))["digest"] == t["digest"]
    with open(path, "rb") as f:
        assert client.templates.import_image(c, f)["digest"] == t["digest"]
    assert client.templates.get(a)["digest"] == t["digest"]
    assert {a, b, c} <= {x["name"] for x in client.templates.list()}
    client.templates.delete(a)
    with pytest.raises(LockerError) as e:
        client.templates.get(a)
    assert e.value.status == 404


def test_garbage_is_not_an_image(client, names):
    n = f"py-junk-{uuid.uuid4().hex[:8]}"
    names.append(n)
    with pytest.raises(LockerError) as e:
        client.templates.import_image(n, b"not an image at all")
    assert e.value.status == 400 and e.value.message
