"""Publish and pull against a real registry: dedup, resume, auth, TLS, and every fault."""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path

import pytest
import requests
from helpers import make_capsule, make_model, synthetic_workload
from registry_fixtures import CutProxy, Registry, free_port

from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule import media
from sparkrun_coldsnap.capsule.reference import parse
from sparkrun_coldsnap.capsule.registry import RegistryClient, Transport
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.capsule.transfer import publish, pull, pull_native, pull_weights, remote_capsules
from sparkrun_coldsnap.documents.request import CapsuleRef, ModelRef, RestoreRequest, ValidationSpec
from sparkrun_coldsnap.errors import IntegrityError, NotFoundError, RegistryError, RequestError, StoreError
from sparkrun_coldsnap.weights import native_payload

CHUNK = 1 << 20


@pytest.fixture
def registry(oci_registry, tmp_path):
    r = Registry(tmp_path / "registry").start()
    yield r
    r.stop()


def client(host: str, repo: str = "capsules/tiny", *, tag: str | None = "v1", **transport) -> tuple[RegistryClient, object]:
    ref = parse("%s/%s%s" % (host, repo, (":" + tag) if tag else ""), default_tag=None)
    transport.setdefault("plain_http", True)
    return RegistryClient(ref, Transport(**transport)), ref


def stores(tmp_path):
    return CapsuleStore(tmp_path / "local").init(), CapsuleStore(tmp_path / "other").init()


def test_publish_then_pull_round_trip_with_dedup(registry, tmp_path):
    local, other = stores(tmp_path)
    cap = make_capsule(local, tmp_path)
    c, ref = client(registry.host)
    first = publish(local, "synthetic", ref, c, chunk=CHUNK)
    assert first.digest == cap.digest and first.blobs_pushed == 1 + len(cap.layers)
    # The registry holds exactly our manifest, with its artifactType.
    data, mt, digest = c.get_manifest("v1")
    assert digest == cap.digest and json.loads(data)["artifactType"] == media.ARTIFACT_TYPE
    again = publish(local, "synthetic", ref, c, chunk=CHUNK)
    assert again.blobs_pushed == 0 and again.blobs_present == 1 + len(cap.layers)

    got = pull(c, ref, other)
    assert got.capsule.digest == cap.digest and got.blobs_fetched == 1 + len(cap.layers)
    assert capsule_mod.verify(other, got.capsule) == sum(d.size for d in cap.layers)
    assert pull(c, ref, other).blobs_fetched == 0  # nothing fetched twice
    by_digest = pull(c, ref.with_digest(cap.digest), other, local_ref="pinned:one")
    assert by_digest.capsule.ref == "pinned:one"


def test_weights_artifact_is_the_subject_and_capsules_are_found_by_referrers(registry, tmp_path):
    local, other = stores(tmp_path)
    model = make_model(tmp_path / "model")
    cap = make_capsule(local, tmp_path, model_dir=model)
    c, ref = client(registry.host)
    result = publish(local, "synthetic", ref, c, model_dir=model, chunk=CHUNK)
    assert result.weights and result.digest != cap.digest  # the published manifest carries a subject
    doc = json.loads(c.get_manifest("v1")[0])
    assert doc["subject"]["digest"] == result.weights
    # distribution 2.8 has no referrers API: the tag schema fallback holds the index.
    index = json.loads(c.get_manifest(result.weights.replace(":", "-"), accept=(media.OCI_INDEX,))[0])
    assert [d["digest"] for d in index["manifests"]] == [result.digest]
    assert index["manifests"][0]["artifactType"] == media.ARTIFACT_TYPE
    found = remote_capsules(c)
    assert {r["digest"] for r in found} == {result.digest}
    pulled = pull(c, ref, other).capsule
    target = tmp_path / "fresh-model"
    assert pull_weights(c, pulled, target) == 2
    for name in ("config.json", "model.safetensors"):
        assert (target / name).read_bytes() == (model / name).read_bytes()
    assert pull_weights(c, pulled, target) == 0  # already right: nothing fetched


def sealed_payload(tmp_path):
    """A native payload as an engine leaves it: one tensor file and one index per worker, sealed."""
    staged = tmp_path / "written"
    staged.mkdir()
    for rank in (0, 1):
        (staged / ("rank-%d.bin" % rank)).write_bytes(os.urandom((2 << 20) + rank))
        (staged / ("rank-%d.json" % rank)).write_text(json.dumps({"rank": rank}))
    return native_payload.seal(staged)


def test_native_payload_travels_as_a_referrer_of_the_capsule(registry, tmp_path, use_settings):
    use_settings(home=tmp_path / "home")
    local, other = stores(tmp_path)
    record = sealed_payload(tmp_path)
    model = make_model(tmp_path / "model")
    make_capsule(local, tmp_path, model_dir=model, native=record)
    c, ref = client(registry.host)
    result = publish(local, "synthetic", ref, c, model_dir=model, with_native=True, chunk=CHUNK)
    native_doc = json.loads(c.get_manifest(result.native)[0])
    assert native_doc["artifactType"] == media.NATIVE_ARTIFACT_TYPE and native_doc["subject"]["digest"] == result.digest
    assert sorted(l["annotations"][media.A_TITLE] for l in native_doc["layers"]) == sorted(f.name for f in record.files)
    assert [d["digest"] for d in c.referrers(result.digest, media.NATIVE_ARTIFACT_TYPE)] == [result.native]
    assert {r["digest"] for r in remote_capsules(c)} == {result.digest}  # the payload is not listed as a capsule

    # Another host: the capsule arrives without the payload; pulling it makes the native path available.
    shutil.rmtree(native_payload.directory(record))
    pulled = pull(c, ref, other).capsule
    assert native_payload.problems(record)
    assert pull_native(c, pulled) == len(record.files)
    assert native_payload.problems(record) == [] and not native_payload.download_dir(record).exists()
    assert pull_native(c, pulled) == 0  # already here
    # A damaged copy is replaced by a fresh download.
    damaged = native_payload.directory(record) / record.files[0].name
    damaged.write_bytes(b"x" * record.files[0].size)
    assert pull_native(c, pulled) == len(record.files) and native_payload.problems(record) == []


def test_native_payload_refusals(registry, tmp_path, use_settings):
    use_settings(home=tmp_path / "home")
    local, other = stores(tmp_path)
    make_capsule(local, tmp_path, name="plain")
    c, ref = client(registry.host)
    with pytest.raises(RequestError, match="capsule plain:latest has no native weight payload .*publish it without --with-native"):
        publish(local, "plain", ref, c, with_native=True, chunk=CHUNK)
    assert c.tags() == []  # refused before anything was published
    record = sealed_payload(tmp_path)
    make_capsule(local, tmp_path, name="withnative", native=record)
    shutil.rmtree(native_payload.directory(record))
    with pytest.raises(IntegrityError, match="native weight payload .* is not on this host.*publish from the host that captured it"):
        publish(local, "withnative", ref, c, with_native=True, chunk=CHUNK)
    assert c.tags() == []
    publish(local, "withnative", ref, c, chunk=CHUNK)  # without it
    pulled = pull(c, ref, other).capsule
    with pytest.raises(RequestError, match="was published without its native weight payload: publish it with --with-native"):
        pull_native(c, pulled)


def test_upload_cut_half_way_resumes(registry, tmp_path):
    local, _ = stores(tmp_path)
    cap = make_capsule(local, tmp_path, pages_mb=8)
    proxy = CutProxy(registry.port, limit=5 * CHUNK, direction="up")
    try:
        c, ref = client(proxy.host)
        with pytest.raises(RegistryError, match="cannot reach registry|broke off|answered"):
            publish(local, "synthetic", ref, c, chunk=CHUNK)
        assert proxy.cut
        states = list((local.staging / "uploads").glob("upload-*.json"))
        assert states, "the interrupted upload left no resume point"
        offset = json.loads(states[0].read_text())["offset"]
        assert offset > 0
        result = publish(local, "synthetic", ref, c, chunk=CHUNK)  # the retry completes
        assert result.digest == cap.digest
        assert not list((local.staging / "uploads").glob("upload-*.json"))
    finally:
        proxy.close()
    _, other = stores(tmp_path)
    assert pull(client(registry.host)[0], ref, other).capsule.digest == cap.digest


def test_download_cut_half_way_resumes_and_leaves_nothing_partial(registry, tmp_path):
    local, other = stores(tmp_path)
    cap = make_capsule(local, tmp_path, pages_mb=8)
    c, ref = client(registry.host)
    publish(local, "synthetic", ref, c, chunk=CHUNK)
    proxy = CutProxy(registry.port, limit=4 * CHUNK, direction="down")
    try:
        cc, _ = client(proxy.host)
        with pytest.raises(RegistryError, match="broke off"):
            pull(cc, ref, other)
        assert other.entries() == []  # no tag: nothing half-written is visible
        partials = list((other.staging / "downloads").glob("*.partial"))
        assert partials and partials[0].stat().st_size > 0
        got = pull(cc, ref, other)  # resumes with Range
        assert got.capsule.digest == cap.digest
        assert not list((other.staging / "downloads").glob("*.partial"))
    finally:
        proxy.close()


def test_a_blob_damaged_in_the_registry_is_refused_and_a_retry_completes(registry, tmp_path):
    local, other = stores(tmp_path)
    cap = make_capsule(local, tmp_path)
    c, ref = client(registry.host)
    publish(local, "synthetic", ref, c, chunk=CHUNK)
    layer = cap.layers[0]
    blob = registry.blob_file(layer.digest)
    good = blob.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    blob.write_bytes(bytes(bad))
    with pytest.raises(IntegrityError, match="does not match its digest"):
        pull(c, ref, other)
    assert other.entries() == [] and not other.has_blob(layer.digest)
    blob.write_bytes(good)
    assert pull(c, ref, other).capsule.digest == cap.digest


def test_missing_tag_other_artifact_type_and_unreachable_registry(registry, tmp_path):
    local, other = stores(tmp_path)
    c, ref = client(registry.host)
    with pytest.raises(NotFoundError, match="manifest capsules/tiny:v1: not found on .*MANIFEST_UNKNOWN"):
        pull(c, ref, other)
    # An artifact of another type under a tag.
    cfg = b"{}"
    empty = {"mediaType": media.OCI_EMPTY, "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a", "size": 2}
    r = requests.post(registry.url + "/v2/capsules/tiny/blobs/uploads/", headers={"Content-Length": "0"})
    requests.put(r.headers["Location"] + "&digest=" + empty["digest"], data=cfg)
    manifest = {"schemaVersion": 2, "mediaType": media.OCI_MANIFEST, "artifactType": "application/vnd.example.other", "config": empty, "layers": []}
    requests.put(registry.url + "/v2/capsules/tiny/manifests/other", data=json.dumps(manifest), headers={"Content-Type": media.OCI_MANIFEST}).raise_for_status()
    c2, ref2 = client(registry.host, tag="other")
    with pytest.raises(StoreError, match="is an artifact of type 'application/vnd.example.other', not a coldsnap capsule"):
        pull(c2, ref2, other)
    assert other.entries() == []
    dead, dref = client("127.0.0.1:%d" % free_port())
    with pytest.raises(RegistryError, match=r"cannot reach registry 127\.0\.0\.1:\d+: .*check the address"):
        pull(dead, dref, other)


def test_references_are_checked():
    for bad, why in [("tiny", "names no registry"), ("capsules/tiny", "not a registry host"), ("localhost:5000/Bad Name", "invalid"), ("localhost:5000/a@sha256:xyz", "malformed digest")]:
        with pytest.raises(RequestError, match=why):
            parse(bad)
    ref = parse("localhost:5000/team/capsules:v2")
    assert (ref.registry, ref.repository, ref.tag) == ("localhost:5000", "team/capsules", "v2")


def docker_config(tmp_path, host, user, password):
    d = tmp_path / "docker"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"auths": {host: {"auth": base64.b64encode(("%s:%s" % (user, password)).encode()).decode()}}}))
    return d


def test_basic_auth_from_docker_config(oci_registry, tmp_path, monkeypatch, use_settings):
    reg = Registry(tmp_path / "auth-registry", user="alice", password="s3cret-pass").start()
    try:
        local, other = stores(tmp_path)
        make_capsule(local, tmp_path)
        monkeypatch.delenv("ORAS_USER", raising=False)
        monkeypatch.delenv("ORAS_PASS", raising=False)
        monkeypatch.setenv("HOME", str(tmp_path))  # no personal credentials leak in
        c, ref = client(reg.host)
        with pytest.raises(RegistryError, match="requires credentials .*docker login") as e:
            publish(local, "synthetic", ref, c, chunk=CHUNK)
        use_settings(credential_files=(docker_config(tmp_path, reg.host, "alice", "wrong-pass") / "config.json",))
        c, ref = client(reg.host)
        with pytest.raises(RegistryError, match="refused the credentials") as e:
            publish(local, "synthetic", ref, c, chunk=CHUNK)
        assert "wrong-pass" not in str(e.value)
        use_settings(credential_files=(docker_config(tmp_path, reg.host, "alice", "s3cret-pass") / "config.json",))
        c, ref = client(reg.host)
        assert publish(local, "synthetic", ref, c, chunk=CHUNK).blobs_pushed > 0
        assert pull(c, ref, other).capsule.ref == "synthetic:v1"
    finally:
        reg.stop()


def test_tls_with_a_self_signed_certificate(oci_registry, tmp_path):
    reg = Registry(tmp_path / "tls-registry", tls=True).start()
    try:
        local, other = stores(tmp_path)
        cap = make_capsule(local, tmp_path)
        c, ref = client(reg.host, plain_http=False)
        with pytest.raises(RegistryError, match="TLS verification of registry .* failed: pass its CA certificate"):
            publish(local, "synthetic", ref, c, chunk=CHUNK)
        c, ref = client(reg.host, plain_http=False, ca_file=str(reg.cert))
        publish(local, "synthetic", ref, c, chunk=CHUNK)
        assert pull(c, ref, other).capsule.digest == cap.digest
    finally:
        reg.stop()


def test_cli_publish_pull_remote_through_sparkrun(sparkrun, registry, tmp_path, monkeypatch, use_settings):
    home = str(tmp_path / "home")
    use_settings(home=Path(home))
    monkeypatch.setitem(sparkrun.env, "COLDSNAP_HOME", home)
    local, _ = stores(tmp_path)
    record = sealed_payload(tmp_path)
    cap = make_capsule(local, tmp_path, native=record)
    target = "%s/capsules/tiny:v7" % registry.host
    out = sparkrun.coldsnap("publish", "synthetic", target, "--store", str(local.root), "--plain-http", "--chunk-size", str(CHUNK), "--with-native")
    assert "published synthetic as %s" % target in out.stdout and "native weight payload" in out.stdout
    shutil.rmtree(native_payload.directory(record))
    doc = sparkrun.json("pull", target, "--store", str(tmp_path / "cli-store"), "--plain-http", "--with-native", "--json")
    assert doc["digest"] == cap.digest and doc["ref"] == "synthetic:v7" and doc["native_files_fetched"] == len(record.files)
    assert native_payload.problems(record) == []
    listing = sparkrun.json("remote", "%s/capsules/tiny" % registry.host, "--plain-http", "--json")
    assert [c["digest"] for c in listing["capsules"]] == [cap.digest]
    bad = sparkrun.coldsnap("pull", "%s/capsules/tiny:nope" % registry.host, "--store", str(tmp_path / "x"), "--plain-http", check=False)
    assert bad.returncode != 0 and bad.stderr.startswith("Error: manifest capsules/tiny:nope: not found")


def test_a_pulled_capsule_brings_its_native_payload_when_the_recipe_wants_it(registry, tmp_path, monkeypatch, capsys, use_settings):
    from sparkrun_coldsnap.documents.recipe_block import parse_block
    from sparkrun_coldsnap.integration.strategy import pull_capsule

    use_settings(home=tmp_path / "home")
    local, other = stores(tmp_path)
    record = sealed_payload(tmp_path)
    make_capsule(local, tmp_path, native=record)
    c, ref = client(registry.host, tag="latest")
    publish(local, "synthetic", ref, c, with_native=True, chunk=CHUNK)
    shutil.rmtree(native_payload.directory(record))
    req = restore_request("synthetic", tmp_path / "m")
    repo = "%s/capsules/tiny" % registry.host

    recovery_only = parse_block({"weights": "recovery", "capsule": {"repository": repo, "plain_http": True}})
    pull_capsule(recovery_only, req, other)
    assert native_payload.problems(record)  # recovery reads the model files: no payload fetched
    pull_capsule(parse_block({"capsule": {"repository": repo, "plain_http": True}}), req, other)
    assert native_payload.problems(record) == [] and "fetched the capsule's native weight payload" in capsys.readouterr().err

    # Published without it: auto goes on (restores take recovery) and says why.
    make_capsule(local, tmp_path, name="bare", native=record)
    c2, ref2 = client(registry.host, "capsules/bare", tag="latest")
    publish(local, "bare", ref2, c2, chunk=CHUNK)
    shutil.rmtree(native_payload.directory(record))
    req2 = restore_request("bare", tmp_path / "m")
    pull_capsule(parse_block({"capsule": {"repository": "%s/capsules/bare" % registry.host, "plain_http": True}}), req2, other)
    assert "native weight payload not fetched: capsule" in capsys.readouterr().err and native_payload.problems(record)


def restore_request(name: str, model_dir: Path) -> RestoreRequest:
    """The request sparkrun's strategy builds for the synthetic capsule *name*, its model in *model_dir*."""
    w = synthetic_workload(name)
    w = w.model_copy(update={"model": ModelRef(id=w.model.id, revision=w.model.revision, path=str(model_dir))})
    return RestoreRequest(workload=w, validation=ValidationSpec(prompt="hi"), capsule=CapsuleRef(name=name), workload_name="sparkrun_%s_solo" % name)
