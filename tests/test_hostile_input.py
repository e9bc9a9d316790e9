"""Hostile input, generated (hypothesis): every document parser either accepts or raises the
plugin's own one-line error, and a capsule layer can write nothing outside its staging
directory, whatever its tar says."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
from helpers import make_capsule
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError as PydanticValidationError

from sparkrun_coldsnap import api
from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule import media
from sparkrun_coldsnap.capsule.pack import unpack_layer
from sparkrun_coldsnap.capsule.store import CapsuleStore, Descriptor
from sparkrun_coldsnap.documents.receipts import Receipt
from sparkrun_coldsnap.documents.recipe_block import parse_block
from sparkrun_coldsnap.errors import ColdsnapError, IntegrityError, RequestError, StoreError

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=20,
)
BLOCK_KEYS = ["capsule", "driver", "engine", "engine_env", "on_incompatible", "on_missing", "ready_timeout_seconds", "recapture", "validation", "weights"]
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FAST
@given(st.one_of(JSON, st.dictionaries(st.sampled_from(BLOCK_KEYS), JSON, max_size=6)))
def test_a_recipe_block_is_accepted_or_refused_in_one_line(value):
    try:
        parse_block(value, source="r.yaml")
    except RequestError as err:
        assert err.exit_code == 2 and "\n" not in err.message and err.message.startswith("r.yaml")


@FAST
@given(st.one_of(st.text(max_size=200), JSON.map(json.dumps)))
def test_a_request_document_is_accepted_or_refused_in_one_line(text):
    try:
        api.load_request(text, source="doc.json")
    except RequestError as err:
        assert err.exit_code == 2 and "\n" not in err.message


@FAST
@given(st.dictionaries(st.sampled_from(["format", "operation", "workload", "validation", "capsule", "request_sha256", "workload_name"]), JSON, max_size=7))
def test_request_shaped_documents_are_refused_by_field(doc):
    doc.setdefault("format", 1)
    try:
        api.load_request(json.dumps(doc), source="doc.json")
    except RequestError as err:
        assert "\n" not in err.message


@FAST
@given(JSON)
def test_a_capsule_config_is_accepted_or_refused_as_damaged(doc):
    if isinstance(doc, dict):
        doc.setdefault("format", 1)
    try:
        capsule_mod.parse_config("sha256:" + "0" * 64, doc if isinstance(doc, dict) else {"format": 1, "x": doc})
    except (IntegrityError, StoreError) as err:
        assert "\n" not in err.message


@FAST
@given(JSON)
def test_a_manifest_is_accepted_or_refused(doc):
    desc = Descriptor(media.OCI_MANIFEST, "sha256:" + "0" * 64, 10)
    try:
        capsule_mod.parse_manifest(desc, doc if isinstance(doc, dict) else {"value": doc})
        layers = [Descriptor.from_json(d) for d in doc.get("layers") or []] if isinstance(doc, dict) and isinstance(doc.get("layers"), list) else []
        assert all(d.digest.startswith("sha256:") for d in layers)
    except (IntegrityError, StoreError, AttributeError, TypeError):
        # AttributeError/TypeError only from this test's own walk of a non-list "layers"
        pass


@FAST
@given(JSON)
def test_a_receipt_is_accepted_or_refused_by_its_model(doc):
    try:
        r = Receipt.model_validate(doc)
    except PydanticValidationError:
        return
    assert Receipt.model_validate_json(r.model_dump_json()) == r


# -- layers ------------------------------------------------------------------

KINDS = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE, "chardev": tarfile.CHRTYPE, "fifo": tarfile.FIFOTYPE}
NAMES = st.one_of(
    st.sampled_from(["solo/core-1.img", "solo/pages-1.img", "/etc/passwd", "../escape", "solo/../../escape", "solo/./x", "./solo/y", "solo//z", ".."]),
    st.lists(st.sampled_from(["solo", "a", "..", ".", "b.img", "/", ""]), min_size=1, max_size=4).map("/".join),
)
MEMBERS = st.lists(st.tuples(NAMES, st.sampled_from(sorted(KINDS)), st.integers(0, 3000), st.sampled_from(["x", "/etc", "../../out", "solo/core-1.img"])), min_size=1, max_size=5)


def _layer(members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, size, link in members:
            info = tarfile.TarInfo(name)
            info.type = KINDS[kind]
            info.mode = 0o6777
            if kind == "file":
                info.size = size
                tar.addfile(info, io.BytesIO(b"\1" * size))
            else:
                info.linkname = link
                tar.addfile(info)
    return buf.getvalue()


def _publish_layer(store: CapsuleStore, data: bytes, declared: int | None) -> Descriptor:
    annotations = {media.A_UNPACKED_SIZE: str(declared)} if declared is not None else None
    d = store.put_bytes(data, media.LAYER_TAR)
    return Descriptor(media.LAYER_TAR, d.digest, d.size, annotations)


def _everything(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(members=MEMBERS, declared_slack=st.integers(-2000, 2000))
def test_a_layer_writes_only_plain_files_inside_its_staging(tmp_path_factory, members, declared_slack):
    tmp = tmp_path_factory.mktemp("layer")
    store = CapsuleStore(tmp / "store").init()
    outside = tmp / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    dest = tmp / "stage" / "units"
    dest.mkdir(parents=True)
    plain = sum(size for _, kind, size, _ in members if kind == "file")
    desc = _publish_layer(store, _layer(members), max(plain + declared_slack, 0))
    before = _everything(tmp) - _everything(dest)
    try:
        unpack_layer(store, desc, dest)
    except ColdsnapError:
        pass
    assert _everything(tmp) - _everything(dest) == before  # nothing written outside the staging
    for p in dest.rglob("*"):
        assert not p.is_symlink() and (p.is_file() or p.is_dir())
        assert p.resolve().is_relative_to(dest.resolve())
        if p.is_file():
            assert p.stat().st_mode & 0o7022 == 0  # no setuid/setgid/sticky, nothing for others to write


@pytest.mark.parametrize(
    "members, why",
    [
        ([("/etc/cron.d/x", "file", 10, "")], "not a plain relative file"),
        ([("solo/../../x", "file", 10, "")], "not a plain relative file"),
        ([("solo/link", "symlink", 0, "/etc/shadow")], "not a plain relative file"),
        ([("solo/hard", "hardlink", 0, "solo/core-1.img")], "not a plain relative file"),
        ([("solo/dev", "chardev", 0, "")], "not a plain relative file"),
        ([("solo/a", "file", 10, ""), ("solo/a", "file", 10, "")], "twice"),
        ([("solo", "file", 0, ""), ("solo/core-1.img", "dir", 0, "")], "under a file"),
        ([("solo", "file", 0, ""), ("solo/core-1.img", "file", 10, "")], "names .*solo twice"),
    ],
)
def test_hostile_layers_are_refused_naming_the_member(tmp_path, members, why):
    store = CapsuleStore(tmp_path / "store").init()
    desc = _publish_layer(store, _layer(members), 100)
    with pytest.raises(IntegrityError, match=why):
        unpack_layer(store, desc, tmp_path / "stage")


def test_a_layer_larger_than_it_declares_is_refused(tmp_path):
    store = CapsuleStore(tmp_path / "store").init()
    desc = _publish_layer(store, _layer([("solo/pages-1.img", "file", 5000, "")]), 4000)
    with pytest.raises(IntegrityError, match="more than the 4000 bytes its manifest declares"):
        unpack_layer(store, desc, tmp_path / "stage")


def test_a_layer_declaring_more_than_the_disk_has_is_refused_before_writing(tmp_path):
    store = CapsuleStore(tmp_path / "store").init()
    desc = _publish_layer(store, _layer([("solo/pages-1.img", "file", 10, "")]), 1 << 60)
    with pytest.raises(StoreError, match="free space there"):
        unpack_layer(store, desc, tmp_path / "stage")
    assert not any((tmp_path / "stage").rglob("*"))


def test_a_real_capsule_still_unpacks(tmp_path):
    store = CapsuleStore(tmp_path / "store")
    cap = make_capsule(store, tmp_path, pages_mb=1)
    for d in cap.layers:
        unpack_layer(store, d, tmp_path / "stage")
    assert (tmp_path / "stage" / "solo" / "core-1.img").is_file()


@pytest.mark.parametrize(("field", "capsule"), [("capsule.name", {"name": "../../x"}), ("capsule.name", {"name": "a/b"}), ("capsule.tag", {"name": "ok", "tag": "a b"}), ("capsule.tag", {"name": "ok", "tag": "../x"})])
def test_a_request_naming_a_capsule_outside_the_name_rules_is_refused_naming_the_field(field, capsule):
    from test_requests import request

    doc = request().model_dump(mode="json")
    doc["capsule"] = capsule
    with pytest.raises(RequestError) as err:
        api.load_request(json.dumps(doc), source="doc.json")
    assert err.value.message.startswith("doc.json: %s: " % field) and "\n" not in err.value.message, err.value.message


@FAST
@given(st.text(max_size=40))
def test_a_capsule_reference_is_parsed_to_one_that_writes_back_the_same_or_refused_in_one_line(text):
    from sparkrun_coldsnap.documents.capsule_ref import CapsuleRef

    try:
        ref = CapsuleRef.parse(text)
    except RequestError as err:
        assert "\n" not in err.message and repr(text) in err.message
        return
    assert ".." not in ref.name and "/" not in ref.ref and " " not in ref.ref
    assert CapsuleRef.parse(str(ref)) == ref and ref.ref in (text, text + ":latest")


def test_the_store_tags_no_capsule_outside_the_name_rules(tmp_path):
    store = CapsuleStore(tmp_path / "store").init()
    desc = store.put_bytes(b"{}", media.OCI_MANIFEST)
    for bad in ("../../x", "x:a b", "X:latest"):
        with pytest.raises(RequestError, match="write it as NAME"):
            store.tag(bad, desc)
    assert store.entries() == []
    with pytest.raises(ColdsnapError, match="is not in the store"):
        store.resolve("../../x")


# -- request documents from another program ----------------------------------------------------

#: where each field of a request document that becomes a path, a host, a port, a command or an
#: environment lives in the document
REQUEST_FIELDS = {
    "capsule.name": ("capsule", "name"),
    "capsule.tag": ("capsule", "tag"),
    "workload_name": ("workload_name",),
    "workload.launch.port": ("workload", "launch", "port"),
    "workload.launch.command": ("workload", "launch", "command"),
    "workload.launch.engine_env": ("workload", "launch", "engine_env"),
    "workload.launch.shm_size": ("workload", "launch", "shm_size"),
    "workload.launch.image": ("workload", "launch", "image"),
    "workload.model.path": ("workload", "model", "path"),
    "workload.model.id": ("workload", "model", "id"),
    "workload.topology.hosts.0": ("workload", "topology", "hosts", 0),
    "workload.topology.units.0.name": ("workload", "topology", "units", 0, "name"),
    "workload.topology.units.0.host": ("workload", "topology", "units", 0, "host"),
    "workload.topology.units.0.command": ("workload", "topology", "units", 0, "command"),
    "workload.driver": ("workload", "driver"),
    "workload.engine": ("workload", "engine"),
}
HOSTILE_TEXT = st.one_of(
    st.sampled_from(["../../../tmp/x", "..", "/etc", "a/../../b", "x\x00y", "-oProxyCommand=touch /tmp/p", "a b", "a:b", "\n", ""]),
    st.text(max_size=30),
    st.integers(1, 12_000).map(lambda n: "a" * n),
    st.integers(),
)


def restore_document() -> dict:
    from helpers import synthetic_workload

    from sparkrun_coldsnap.documents.request import CapsuleRef, RestoreRequest, ValidationSpec

    req = RestoreRequest(workload=synthetic_workload(), validation=ValidationSpec(prompt="hi"), capsule=CapsuleRef(name="absent"), on_missing="fail", workload_name="w")
    return req.model_dump(mode="json")


def _set(doc: dict, where: tuple, value: object) -> dict:
    inner: Any = doc
    for key in where[:-1]:
        inner = inner[key]
    inner[where[-1]] = value
    return doc


def _inside(base: Path, name: str) -> bool:
    return (base / name).resolve().is_relative_to(base.resolve())


@FAST
@given(field=st.sampled_from(sorted(REQUEST_FIELDS)), value=HOSTILE_TEXT, env=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=2))
def test_a_hostile_request_field_is_refused_in_one_short_line_or_is_safe_to_use(field, value, env):
    doc = _set(restore_document(), REQUEST_FIELDS[field], value)
    doc["workload"]["launch"]["env"] = env
    try:
        req = api.load_request(json.dumps(doc), source="doc.json")
    except RequestError as err:
        assert err.exit_code == 2 and "\n" not in err.message and len(err.message) < 1000, err.message
        return
    base = Path("/nonexistent/base")
    w = req.workload
    names = [req.capsule.name, req.capsule.tag, req.workload_name, *(u.name for u in w.topology.units), *([w.launch.engine_env] if w.launch.engine_env else [])]
    assert all(_inside(base, n) and n not in (".", "..") for n in names)
    assert 1 <= w.launch.port <= 65535
    texts = [w.launch.command, w.model.id, w.model.path or "", *w.topology.hosts, *(u.host for u in w.topology.units), *w.launch.env, *w.launch.env.values()]
    assert not any("\x00" in t for t in texts)
    assert not any(h.startswith("-") for h in (*w.topology.hosts, *(u.host for u in w.topology.units)))
    assert all("=" not in k and k for k in w.launch.env)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("capsule.name", "../../../tmp/x"),
        ("capsule.name", "tiny\x00x"),
        ("capsule.name", "a" * 10_000),
        ("workload.launch.port", 0),
        ("workload.launch.port", 70000),
        ("workload_name", "../../../tmp/x"),
        ("workload.launch.engine_env", "../../../tmp/x"),
        ("workload.topology.units.0.name", "../../../tmp/x"),
        ("workload.topology.units.0.host", "-oProxyCommand=touch /tmp/x"),
        ("workload.launch.command", "vllm serve\x00--x"),
    ],
)
@pytest.mark.parametrize("verb", ["capture", "restore"])
def test_a_hostile_request_document_is_refused_in_one_line_and_writes_nothing(tmp_path, verb, field, value):
    from click.testing import CliRunner

    from sparkrun_coldsnap.cli import coldsnap_group

    doc = _set(restore_document(), REQUEST_FIELDS[field], value)
    if verb == "capture":
        doc = {k: v for k, v in doc.items() if k not in ("on_missing", "on_incompatible", "recapture", "workload_name", "workload_labels")}
        doc["operation"] = "capture"
        if field == "workload_name":
            doc["workload"]["launch"]["engine_env"] = value  # a capture names no record: the same value as a path it does use
    (tmp_path / "doc.json").write_text(json.dumps(doc))
    before = _everything(tmp_path)
    env = {"COLDSNAP_HOME": str(tmp_path / "home")}
    result = CliRunner().invoke(coldsnap_group, [verb, "--request", str(tmp_path / "doc.json"), "--store", str(tmp_path / "store")], env=env, catch_exceptions=False)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and len(lines[0]) < 1000, result.output
    shown_field = field if not (verb == "capture" and field == "workload_name") else "workload.launch.engine_env"
    assert "doc.json: %s: " % shown_field in lines[0], lines[0]
    assert _everything(tmp_path) == before  # not the store, not the home, not the path the name climbs to
    assert not Path("/tmp/x").exists()
