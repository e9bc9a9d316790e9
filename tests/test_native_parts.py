"""A native weight payload written by ranks on several hosts (weights/native_parts.py) and the
weight path a restore of several units takes (controller/units_weights.choose).

Each "host" here is a coldsnap home of its own (where payloads live); the files are what
the engine's workers write, ``rank-N.bin`` and ``rank-N.json``, one rank per host.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkrun_coldsnap.controller import units_weights
from sparkrun_coldsnap.documents.request import CapsuleRef, LaunchUnit, RestoreRequest, ValidationSpec
from sparkrun_coldsnap.errors import CompatibilityError, EngineError
from sparkrun_coldsnap.units.steps import AdmitAnswer
from sparkrun_coldsnap.weights import native_parts, native_payload

TOKEN = "0123abcd0123abcd"


def write_rank(directory: Path, rank: int, content: bytes) -> None:
    (directory / ("rank-%d.bin" % rank)).write_bytes(content)
    (directory / ("rank-%d.json" % rank)).write_text('{"rank": %d}' % rank)


def on(use_settings, home: Path) -> None:
    use_settings(home=home)


def test_each_host_keeps_its_ranks_files_under_the_digest_a_payload_of_every_file_has(tmp_path, use_settings):
    homes = {"a": tmp_path / "a", "b": tmp_path / "b"}
    staged = {}
    for rank, (host, home) in enumerate(homes.items()):
        on(use_settings, home)
        staged[host] = native_parts.staging(TOKEN)
        write_rank(staged[host], rank, b"weights of rank %d" % rank)
    parts = {}
    for host, home in homes.items():
        on(use_settings, home)
        parts[host] = native_parts.part(staged[host])
    assert [f.name for f in parts["a"]] == ["rank-0.bin", "rank-0.json"] and [f.name for f in parts["b"]] == ["rank-1.bin", "rank-1.json"]
    record = native_parts.combine(parts)
    for host, home in homes.items():
        on(use_settings, home)
        placed = native_parts.place(staged[host], record, [f.name for f in parts[host]])
        assert placed == native_payload.directory(record) and not staged[host].exists()
        assert native_payload.problems(native_parts.only(record, [f.name for f in parts[host]])) == []
        assert native_payload.problems(record) != []  # the other host's part is not here
    # The same digest the payload has when one host holds every file (native_payload.seal).
    one = tmp_path / "one"
    one.mkdir()
    write_rank(one, 0, b"weights of rank 0")
    write_rank(one, 1, b"weights of rank 1")
    on(use_settings, tmp_path / "single")
    assert native_payload.seal(one).digest == record.digest


def test_hosts_that_share_a_filesystem_share_the_staging_directory_and_each_finds_its_part_in_place(tmp_path, use_settings):
    on(use_settings, tmp_path / "shared")
    staged = native_parts.staging(TOKEN)
    assert native_parts.staging(TOKEN) == staged  # the second host's call finds it made
    write_rank(staged, 0, b"r0")
    write_rank(staged, 1, b"r1")
    held = native_parts.part(staged)  # each host sees both ranks' files
    record = native_parts.combine({"rank-0": held, "rank-1": held})
    for _ in ("a", "b"):
        assert native_parts.place(staged, record, [f.name for f in held]) == native_payload.directory(record)
    assert native_payload.problems(record) == []


def test_two_hosts_that_wrote_different_files_under_one_name_are_refused(tmp_path, use_settings):
    on(use_settings, tmp_path)
    for host, content in (("a", b"one"), ("b", b"two")):
        d = tmp_path / host
        d.mkdir()
        write_rank(d, 0, content)
    with pytest.raises(EngineError, match=r"two hosts wrote different native payload files named rank-0.bin \(unit b\)"):
        native_parts.combine({"a": native_parts.part(tmp_path / "a"), "b": native_parts.part(tmp_path / "b")})
    with pytest.raises(EngineError, match="wrote no native payload files on any host"):
        native_parts.combine({"a": (), "b": ()})


def test_a_staging_token_that_is_not_hexadecimal_is_refused(tmp_path, use_settings):
    on(use_settings, tmp_path)
    with pytest.raises(Exception, match="is not hexadecimal"):
        native_parts.staging("../escape")


UNITS = [LaunchUnit(name="rank-0", host="a", rank=0), LaunchUnit(name="rank-1", host="b", rank=1)]


def request(weights: str, tmp_path: Path) -> RestoreRequest:
    from test_launch_units import two_host_workload

    w = two_host_workload(tmp_path).model_copy(update={"weights": weights})
    return RestoreRequest(workload=w, validation=ValidationSpec(prompt="hi"), capsule=CapsuleRef(name="x"), workload_name="w")


def answer(path: str, native_dir: str | None = None, note: str | None = None) -> AdmitAnswer:
    """What a host's admission answers over the wire, as the coordinator reads it."""
    return AdmitAnswer.model_validate({"problems": [], "weights": {"path": path, "native_dir": native_dir, "note": note}})


def test_native_only_when_every_host_holds_its_part_at_one_path(tmp_path):
    both = {"rank-0": answer("native", "/h/native/x"), "rank-1": answer("native", "/h/native/x")}
    assert units_weights.choose(request("auto", tmp_path), UNITS, both) == units_weights.weight_paths.WeightChoice("native", Path("/h/native/x"))
    one_missing = {"rank-0": answer("native", "/h/native/x"), "rank-1": answer("recovery", note="native weight payload sha256:ab is not on this host")}
    chosen = units_weights.choose(request("auto", tmp_path), UNITS, one_missing)
    assert chosen is not None and chosen.path == "recovery" and chosen.note == "unit rank-1 on host b: native weight payload sha256:ab is not on this host"
    apart = {"rank-0": answer("native", "/h1/native/x"), "rank-1": answer("native", "/h2/native/x")}
    chosen = units_weights.choose(request("auto", tmp_path), UNITS, apart)
    assert chosen is not None and chosen.path == "recovery" and "different paths (/h1/native/x, /h2/native/x)" in (chosen.note or "")
    with pytest.raises(CompatibilityError, match="weights: native: the hosts hold the native payload under different paths"):
        units_weights.choose(request("native", tmp_path), UNITS, apart)
    assert units_weights.choose(request("auto", tmp_path), UNITS, {"rank-0": AdmitAnswer(problems=()), "rank-1": AdmitAnswer(problems=())}) is None  # in the images
