"""The CLI through sparkrun's own entry point, with the plugin discovered and enabled."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jsonschema
import pytest
from conftest import BIN, ROOT, write_recipe
from helpers import one_error_line

VERBS = ("capture", "restore", "inspect", "list", "verify", "delete", "gc", "capabilities", "doctor", "bench", "setup")


def test_help_lists_the_verbs(sparkrun):
    out = sparkrun.coldsnap("--help").stdout
    for verb in VERBS:
        assert "  %s " % verb in out, verb


def test_capabilities_json_is_valid_and_names_engines_drivers_formats(sparkrun):
    doc = sparkrun.json("capabilities", "--json")
    schema = json.loads((ROOT / "docs" / "schemas" / "capabilities.schema.json").read_text())
    jsonschema.validate(doc, schema)
    assert {e["name"] for e in doc["engines"]} == {"vllm", "sglang"}
    drivers = {d["name"]: d for d in doc["drivers"]}
    assert {"cpu", "n610", "n580"} <= set(drivers)
    assert drivers["cpu"]["available_here"] is True
    launchers = {l["executor"]: l for l in doc["launchers"]}
    assert set(launchers) == {"local", "docker"} and launchers["local"]["available_here"] is True
    assert doc["formats"]["artifact_type"] == "application/vnd.sparkrun.coldsnap.capsule.v1"
    assert doc["formats"]["request"] == doc["formats"]["receipt"] == doc["formats"]["capsule_config"] == 1


def test_doctor_reports_criu_plugin_and_engines(sparkrun):
    doc = sparkrun.json("doctor", "--json")
    by_name = {c["name"]: c for c in doc["checks"]}
    assert by_name["plugin"]["status"] == "ok"
    assert "criu 4.2" in by_name["criu"]["detail"]
    # The installed CPU engine is checked by name; "engine environments" is the warning for none.
    assert by_name["engine env vllm-cpu"]["status"] == "ok" and "engine environments" not in by_name
    assert " GB free; a capture needs about twice the engine's memory" in by_name["store"]["detail"]


def test_doctor_reports_a_disabled_plugin(sparkrun):
    sparkrun("plugins", "disable", "coldsnap")
    # sparkrun no longer loads us: the standalone entry point still answers.
    cp = subprocess.run([str(BIN / "sparkrun-coldsnap"), "doctor"], env=sparkrun.env, capture_output=True, text=True, timeout=300)
    assert cp.returncode == 1
    assert "installed but disabled" in cp.stdout and "sparkrun plugins enable coldsnap" in cp.stdout


def one_line_error(cp: subprocess.CompletedProcess) -> str:
    return one_error_line(cp.returncode, cp.stderr)


def test_malformed_yaml(sparkrun, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\ncoldsnap:\n  capsule: [unclosed\n")
    line = one_line_error(sparkrun.coldsnap("capture", str(bad), "-H", "localhost", check=False))
    assert str(bad) in line and "malformed YAML at line" in line and "fix the syntax" in line


def test_unknown_key_in_block(sparkrun, tmp_path):
    recipe = write_recipe(tmp_path, coldsnap="coldsnap:\n  engine_env: vllm-cpu\n  validaton:\n    prompt: hi\n")
    line = one_line_error(sparkrun.coldsnap("capture", str(recipe), "-H", "localhost", check=False))
    assert "unknown key 'validaton'" in line and "allowed keys:" in line


def test_unknown_key_blocks_sparkrun_run_too(sparkrun, tmp_path):
    recipe = write_recipe(tmp_path, coldsnap="coldsnap:\n  drivr: cpu\n")
    cp = sparkrun("run", str(recipe), "-H", "localhost", "--no-follow", check=False)
    assert cp.returncode != 0 and "unknown key 'drivr'" in cp.stderr + cp.stdout


def test_mutable_model_revision(sparkrun, tmp_path):
    recipe = write_recipe(tmp_path, replace={"model_revision: 973ff5dd93da77ddc2a1bffa8e29d4d207f245dd": "model_revision: main"})
    line = one_line_error(sparkrun.coldsnap("capture", str(recipe), "-H", "localhost", check=False))
    assert "model_revision 'main' is not immutable" in line and "pin the commit hash" in line


@pytest.mark.parametrize(
    "setting, expected",
    [("engine: tgi", "unknown engine 'tgi': use one of sglang, vllm"), ("driver: n999", "unknown snapshot driver 'n999': use auto or one of")],
)
def test_unknown_engine_or_driver(sparkrun, tmp_path, setting, expected):
    recipe = write_recipe(tmp_path, coldsnap="coldsnap:\n  engine_env: vllm-cpu\n  %s\n" % setting)
    line = one_line_error(sparkrun.coldsnap("capture", str(recipe), "-H", "localhost", check=False))
    assert expected in line


def test_unknown_capsule_and_missing_store(sparkrun, tmp_path):
    line = one_line_error(sparkrun.coldsnap("inspect", "nothing:here", "--store", str(tmp_path / "none"), check=False))
    assert "capsule nothing:here is not in the store" in line
    line = one_line_error(sparkrun.coldsnap("verify", "sha256:" + "ab" * 32, "--store", str(tmp_path / "none"), check=False))
    assert "is not in the store" in line


def test_missing_recipe_file(sparkrun, tmp_path):
    line = one_line_error(sparkrun.coldsnap("capture", str(tmp_path / "nope.yaml"), "-H", "localhost", check=False))
    assert "does not exist" in line


def written_payload(directory):
    """What an engine leaves for the plugin to seal: one worker's tensors and index."""
    directory.mkdir()
    (directory / "rank-0.bin").write_bytes(b"\1" * 65536)
    (directory / "rank-0.json").write_text("{}")
    return directory


def test_delete_removes_the_native_payload_no_other_capsule_needs(sparkrun, tmp_path, monkeypatch, use_settings):
    from helpers import make_capsule

    from sparkrun_coldsnap.capsule.store import CapsuleStore
    from sparkrun_coldsnap.weights import native_payload

    home = str(tmp_path / "home")
    use_settings(home=Path(home))
    monkeypatch.setitem(sparkrun.env, "COLDSNAP_HOME", home)
    record = native_payload.seal(written_payload(tmp_path / "written"))
    store = CapsuleStore(tmp_path / "store").init()
    make_capsule(store, tmp_path, "first", native=record)
    make_capsule(store, tmp_path, "second", native=record)
    s = str(store.root)
    out = sparkrun.coldsnap("delete", "first", "--store", s).stdout
    assert "native weight payload" not in out and native_payload.problems(record) == []  # "second" still needs it
    out = sparkrun.coldsnap("delete", "second", "--store", s).stdout
    assert "removed its native weight payload" in out and not native_payload.directory(record).exists()
    make_capsule(store, tmp_path, "third", native=native_payload.seal(written_payload(tmp_path / "again")))
    out = sparkrun.coldsnap("delete", "third", "--store", s, "--keep-native").stdout
    assert "native weight payload" not in out and native_payload.problems(record) == []
