"""A manager other than sparkrun: request documents in, receipts out, with the real engine.

The worked example of docs/integrators.md runs as written: it renders the documents with
--dry-run, captures and restores from them alone (the restore through the barrier protocol),
asks the restored engine and stops it by its process group.
"""

from __future__ import annotations

import json
import os
import subprocess

import jsonschema
import pytest
from conftest import BIN, ROOT, require_engine, write_recipe
from test_engine_cycle import PROMPT, engine_processes, wait_gone

pytestmark = pytest.mark.engine
SCHEMAS = ROOT / "docs" / "schemas"


def schema(name: str) -> dict:
    return json.loads((SCHEMAS / name).read_text())


def test_the_shell_manager_example_captures_and_restores_from_documents_alone(sparkrun, tmp_path):
    require_engine()
    assert not engine_processes(), "an engine is already running; stop it first"
    block = "coldsnap:\n  engine_env: vllm-cpu\n  capsule:\n    name: managed\n  validation:\n    prompt: %r\n    max_tokens: 16\n" % PROMPT
    recipe = write_recipe(tmp_path, coldsnap=block, name="managed.yaml")
    store, out = tmp_path / "store", tmp_path / "out"
    env = dict(sparkrun.env, PATH="%s:%s" % (BIN, os.environ.get("PATH", "")))
    try:
        cp = subprocess.run(
            ["bash", str(ROOT / "docs" / "examples" / "shell-manager.sh"), str(recipe), str(store), str(out)],
            env=env, capture_output=True, text=True, timeout=1500, cwd=str(tmp_path),
        )  # fmt: skip
    finally:
        wait_gone()
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]

    capture_req, restore_req = (json.loads((out / n).read_text()) for n in ("capture-request.json", "restore-request.json"))
    jsonschema.validate(capture_req, schema("capture-request.schema.json"))
    jsonschema.validate(restore_req, schema("restore-request.schema.json"))
    assert restore_req["on_missing"] == restore_req["on_incompatible"] == "fail"
    assert "admission passes" not in (out / "restore-plan.txt").read_text()  # nothing captured yet when it was made

    captured, restored = (json.loads((out / n).read_text()) for n in ("capture-receipt.json", "restore-receipt.json"))
    for receipt in (captured, restored):
        jsonschema.validate(receipt, schema("receipt.schema.json"))
        assert receipt["state"] == "succeeded" and receipt["validation"]["passed"]
    # The document replays to its capsule: the capsule records the document's own digest.
    assert captured["request_sha256"] == capture_req["request_sha256"]
    config = sparkrun.json("inspect", "managed", "--store", str(store), "--json")["config"]
    assert config["request_sha256"] == capture_req["request_sha256"] and restored["capsule"] == captured["capsule"]

    lines = cp.stdout.splitlines()
    prepared = json.loads(next(l for l in lines if l.startswith("unit says: ")).split(": ", 1)[1])
    assert prepared["unit"] == "solo" and prepared["state"] == "prepared" and prepared["prepare_seconds"] > 0
    asked = next(l for l in lines if l.startswith("restored: "))
    assert "asked again: %r" % restored["validation"]["reply"] in asked
    assert "stopped: process group %d" % restored["details"]["root_pid"] in cp.stdout
    assert not engine_processes()


def test_an_aborted_barrier_leaves_nothing_and_the_capsule_restores_later(sparkrun, tmp_path):
    """`abort` at the barrier discards the staging; a document for another capsule is refused (exit 4)."""
    from helpers import make_capsule

    from sparkrun_coldsnap.capsule.store import CapsuleStore

    store = CapsuleStore(tmp_path / "store").init()
    make_capsule(store, tmp_path, "staged")
    doc = {
        "format": 1, "operation": "restore", "on_missing": "fail", "on_incompatible": "vanilla", "workload_name": "w",
        "validation": {"prompt": "hi"}, "capsule": {"name": "staged"}, "workload": json.loads(
            json.dumps(make_capsule(store, tmp_path, "other").config.workload.model_dump(mode="json"))
        ),
    }  # fmt: skip
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    cli = [str(BIN / "sparkrun-coldsnap"), "restore", "--request", str(path), "--store", str(store.root), "--wait-for-go"]
    cp = subprocess.run(cli, env=sparkrun.env, input="abort\n", capture_output=True, text=True, timeout=300)
    events = [json.loads(l) for l in cp.stdout.splitlines()]
    # The synthetic capsule cannot come back on this host: the request allows a vanilla start, so the
    # unit says so at the barrier, and is told to abort.
    assert cp.returncode == 0, cp.stderr
    assert events[0]["state"] == "vanilla" and "admission refused for capsule staged:latest" in events[0]["because"]
    assert events[-1]["state"] == "discarded" and "told 'abort'" in events[-1]["because"]
    assert not engine_processes() and not list((tmp_path / "store").glob("staging/*"))
    missing = dict(doc, capsule={"name": "nowhere"})
    path.write_text(json.dumps(missing))
    cp = subprocess.run(cli[:-1], env=sparkrun.env, capture_output=True, text=True, timeout=300)
    assert cp.returncode == 4 and "capsule nowhere:latest is not in" in cp.stderr
