"""The lifecycle with the real CPU vLLM engine, real CRIU and real sparkrun, through sparkrun's CLI.

capture -> `sparkrun run` (restored) -> hibernate (the live tree, from inside its namespaces)
-> wake (restored from the hibernation capsule) -> hibernate -> warm -> `sparkrun run` (only
activates) -> stop, with `sparkrun coldsnap status` at each step; then what is refused: sleep
on the CPU, moves not allowed, a workload that does not exist or belongs to another recipe,
and a hibernate whose CRIU is killed mid-dump (the workload keeps serving).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_engine_cycle
from conftest import Sparkrun
from helpers import one_error_line
from test_engine_cycle import ask, engine_processes, recipe_with_store, wait_gone

pytestmark = pytest.mark.engine
captured = test_engine_cycle.captured  # one real capture for this module too
KILLER = Path(__file__).resolve().parent.parent / "scripts" / "faults" / "criu-killed.sh"


@pytest.fixture
def sparkrun(sparkrun, tmp_path) -> Sparkrun:
    """sparkrun with a lifecycle record folder of the test's own."""
    sparkrun.env["COLDSNAP_LIFECYCLE_DIR"] = str(tmp_path / "lifecycle")
    return sparkrun


def status(sr: Sparkrun) -> dict:
    rows = json.loads(sr.coldsnap("status", "--json").stdout)
    assert len(rows) == 1, rows
    return rows[0]


def receipt(path: str) -> dict:
    return json.loads(Path(path).read_text())


def refused(sr: Sparkrun, *args: str, code: int) -> str:
    cp = sr.coldsnap(*args, check=False)
    assert cp.returncode == code, (cp.returncode, cp.stdout, cp.stderr)
    return one_error_line(cp.returncode, cp.stderr)


def unpacked(captured) -> tuple[Path, Path, str]:
    store, recipe, capture_receipt = captured
    return store, recipe, capture_receipt["validation"]["reply"]


def test_capture_hibernate_wake_warm_run_with_status_at_each_step(captured, sparkrun, tmp_path):
    store, recipe, reply = unpacked(captured)
    sr = sparkrun
    assert json.loads(sr.coldsnap("status", "--json").stdout) == []
    # A workload sparkrun runs from a capsule is managed from its start.
    sr("run", str(recipe), "-H", "localhost")
    try:
        row = status(sr)
        name = row["workload"]
        assert row["state"] == "active" and row["capsule"] == "tiny:latest" and row["root_pid"] and row["host_memory_bytes"] > 100 << 20
        assert ask() == reply

        # sleep: the CPU engine has no sleep mode.
        line = refused(sr, "sleep", str(recipe), "-H", "localhost", code=2)
        assert "cannot sleep workload %s: it runs vllm with the cpu driver" % name in line and line.endswith("hibernate it instead")
        assert status(sr)["state"] == "active"
        line = refused(sr, "wake", name, code=2)
        assert line == "Error: cannot wake workload %s: it is already active" % name

        # hibernate: the live workload, captured without a fresh engine start, then stopped.
        cp = sr.coldsnap("hibernate", str(recipe), "-H", "localhost", "--json")
        hib = json.loads(cp.stdout)
        phases = [p["name"] for p in hib["phases"]]
        assert hib["operation"] == "hibernate" and hib["state"] == "succeeded" and hib["capsule_ref"] == "tiny:hibernated-%s" % name
        assert "launch" not in phases and {"validate", "precheck", "checkpoint", "pack", "publish"} <= set(phases)
        assert hib["validation"]["reply"] == reply
        wait_gone()
        row = status(sr)
        assert row["state"] == "hibernated" and row["capsule"] == hib["capsule_ref"] and row["capsule_digest"] == hib["capsule"]
        assert row["root_pid"] is None and row["host_memory_bytes"] == 0
        listed = sr.coldsnap("list", "--store", str(store)).stdout
        assert "hibernated-%s" % name in listed
        line = refused(sr, "sleep", name, code=2)
        assert "cannot sleep workload %s: it runs vllm with the cpu driver" % name in line
        line = refused(sr, "hibernate", name, code=2)
        assert line == "Error: cannot hibernate workload %s: it is already hibernated" % name

        # wake: sparkrun run restores exactly the hibernated state.
        woke = json.loads(sr.coldsnap("wake", name, "--json").stdout)
        assert woke["operation"] == "wake" and woke["details"]["source"] == "hibernated"
        row = status(sr)
        assert row["state"] == "active" and row["capsule_digest"] == hib["capsule"] and row["root_pid"]
        restored = receipt(woke["details"]["restore_receipt"])
        assert restored["operation"] == "restore" and restored["capsule"] == hib["capsule"] and restored["validation"]["passed"]
        assert ask() == reply

        # hibernate again, warm, then sparkrun run only activates.
        sr.coldsnap("hibernate", name)
        wait_gone()
        warm = json.loads(sr.coldsnap("warm", name, "--keep", "600", "--json").stdout)
        assert warm["operation"] == "warm" and [p["name"] for p in warm["phases"]] == ["prepare.open", "prepare.admission", "prepare.stage"]
        row = status(sr)
        assert row["state"] == "warm" and row["warm"]["staged_bytes"] > 100 << 20 and not engine_processes()
        line = refused(sr, "warm", name, code=2)
        assert line == "Error: cannot warm workload %s: it is already warm" % name
        out = sr("run", str(recipe), "-H", "localhost").stderr
        assert "workload %s was warm: restoring from the images kept for it" % name in out
        row = status(sr)
        assert row["state"] == "active" and row["warm"] is None and row["root_pid"]
        activated = receipt(row["last_receipt"])
        assert activated["details"]["staged_ahead"] is True and "prepare.stage" not in [p["name"] for p in activated["phases"]]
        assert not Path(warm["details"]["staging"]).exists()
        assert ask() == reply
    finally:
        sr("stop", str(recipe), "-H", "localhost", check=False)
        wait_gone()
    # Stopped by sparkrun: no longer managed.
    assert json.loads(sr.coldsnap("status", "--json").stdout) == []


def test_a_hibernate_whose_criu_is_killed_leaves_the_workload_serving(captured, sparkrun, monkeypatch):
    from sparkrun_coldsnap.criu.tool import Criu

    store, recipe, reply = unpacked(captured)
    sr = sparkrun
    sr("run", str(recipe), "-H", "localhost")
    try:
        name = status(sr)["workload"]
        before = sr.coldsnap("list", "--store", str(store)).stdout  # the first test's hibernation capsule may be there
        env = dict(sr.env, COLDSNAP_CRIU="sh %s dump" % KILLER, CRIU_REAL=" ".join(Criu.locate().argv))
        cp = Sparkrun(sr.home, env).coldsnap("hibernate", name, check=False)
        line = one_error_line(cp.returncode, cp.stderr)
        assert cp.returncode == 1 and "ended by signal 9 (SIGKILL)" in line and "(receipt: " in line, line
        row = status(sr)
        if "the process tree is gone" in line or "processes are gone" in line:
            # A kill inside CRIU's parasite code ends that process: the record must say so.
            assert row["state"] == "failed" and row["note"].startswith("hibernate failed: ")
        else:
            assert "the process tree is still running" in line
            assert row["state"] == "active" and row["transition"] is None and row["note"].startswith("hibernate failed: criu dump")
            assert ask() == reply  # it serves on
        assert sr.coldsnap("list", "--store", str(store)).stdout == before  # nothing published, nothing replaced either way
        failed = receipt(row["note"].rsplit("(receipt: ", 1)[1].rstrip(")")) if "(receipt: " in row["note"] else None
        assert failed is None or failed["state"] == "failed"
    finally:
        sr("stop", str(recipe), "-H", "localhost", check=False)
        wait_gone()


def test_a_verb_on_a_workload_that_does_not_exist_or_belongs_to_another_recipe(captured, sparkrun, tmp_path):
    store, recipe, _ = unpacked(captured)
    sr = sparkrun
    line = refused(sr, "wake", "sparkrun_0000_solo", code=4)
    assert line.startswith("Error: no workload sparkrun_0000_solo is managed here (managed: none)")
    line = refused(sr, "hibernate", str(recipe), "-H", "localhost", code=4)
    assert "recipe %s has no workload managed here" % recipe in line and "`sparkrun run %s` starts it" % recipe in line
    # A record of this recipe's workload made by a recipe whose capsule has another name.
    other = recipe_with_store(tmp_path, store, name="other.yaml")
    other.write_text(other.read_text().replace("name: tiny", "name: other"))
    name = json.loads(sr.coldsnap("restore", str(recipe), "-H", "localhost", "--dry-run").stdout)["workload_name"]
    run_dir = Path(sr.env["COLDSNAP_LIFECYCLE_DIR"])
    run_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "workload": name, "recipe": str(other), "capsule_name": "other", "store": str(store), "engine": "vllm", "driver": "cpu", "executor": "local",
        "port": 8000, "served_model": "coldsnap/tiny-qwen2", "state": "hibernated", "since": "2026-01-01T00:00:00+00:00", "capsule_ref": "other:hibernated-x",
        "validation_prompt": "hi", "validation_max_tokens": 4,
    }  # fmt: skip
    (run_dir / ("%s.json" % name)).write_text(json.dumps(doc))
    try:
        line = refused(sr, "wake", str(recipe), "-H", "localhost", code=2)
        assert line == "Error: workload %s belongs to recipe %s (capsule other), not to %s (capsule tiny): pass that recipe or the workload's name" % (name, other, recipe)
    finally:
        (run_dir / ("%s.json" % name)).unlink()
