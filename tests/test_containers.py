"""The container path with real Docker: capture a CPU vLLM server running in a container,
restore it into a NEW container through `sparkrun run`, validate, and let sparkrun stop it."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import requests
from conftest import RECIPE, require_engine, write_recipe

from sparkrun_coldsnap.launch import checkpoint_leftovers

pytestmark = pytest.mark.engine
DOCKER_RECIPE = RECIPE.with_name("tiny-vllm-cpu-docker.yaml")
PROMPT = "Reply with one short sentence: what is a cold start?"


def docker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300)


def require_docker() -> None:
    if not shutil.which("docker") or docker("info").returncode != 0:
        pytest.fail("no docker daemon: run `sparkrun coldsnap setup --docker` (scripts/test.sh does)")
    if docker("image", "inspect", "coldsnap/vllm-cpu:0.32.0").returncode != 0:
        pytest.fail("no engine image coldsnap/vllm-cpu:0.32.0: run `sparkrun coldsnap setup --docker`")


def containers() -> list[dict]:
    out = docker("ps", "-a", "--format", "{{json .}}").stdout
    return [json.loads(l) for l in out.splitlines() if l.strip()]


def unpacked_checkpoints() -> set:
    """containerd's ``ctrd-checkpoint*`` directories on this host."""
    return {d for parent in checkpoint_leftovers.containerd_temp_dirs() for d in parent.glob(checkpoint_leftovers.PREFIX + "*")}


def ask() -> str:
    body = {"model": "coldsnap/tiny-qwen2", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "temperature": 0, "seed": 0}
    r = requests.post("http://127.0.0.1:8000/v1/chat/completions", json=body, timeout=60)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def docker_recipe(tmp_path, store):
    block = "coldsnap:\n  capsule:\n    name: tiny-docker\n    store: %s\n  validation:\n    prompt: %r\n    max_tokens: 16\n" % (store, PROMPT)
    return write_recipe(tmp_path, coldsnap=block, name="tiny-docker.yaml", source=DOCKER_RECIPE)


def test_capture_in_a_container_restore_into_a_new_one(sparkrun, tmp_path):
    require_engine()
    require_docker()
    assert not [c for c in containers() if "coldsnap" in c["Names"] or c["Names"].startswith("sparkrun_")], containers()
    store = tmp_path / "store"
    recipe = docker_recipe(tmp_path, store)
    receipt_path = tmp_path / "capture.json"
    sparkrun.coldsnap("capture", str(recipe), "-H", "localhost", "--receipt", str(receipt_path))
    receipt = json.loads(receipt_path.read_text())
    reply = receipt["validation"]["reply"]
    assert receipt["state"] == "succeeded" and reply
    assert containers() == []  # the capture container is gone; its state is in the capsule
    doc = sparkrun.json("inspect", "tiny-docker", "--store", str(store), "--json")
    unit = doc["config"]["units"][0]
    assert unit["driver_data"]["container"]["image"].startswith("sha256:")
    assert doc["config"]["fingerprint"]["container_runtime"].startswith("docker ")
    assert doc["config"]["workload"]["launch"]["image"].startswith("coldsnap/vllm-cpu:0.32.0@sha256:")

    unpacked_before = unpacked_checkpoints()
    out = sparkrun("run", str(recipe), "-H", "localhost", "--no-follow")
    assert "restored tiny-docker:latest" in out.stderr + out.stdout
    assert ask() == reply
    running = containers()
    # Neither containerd's unpacked copy nor docker's own copy of the images outlives the start.
    assert unpacked_checkpoints() <= unpacked_before
    assert docker("checkpoint", "ls", "--format", "{{.Name}}", running[0]["Names"]).stdout.strip() == ""
    assert len(running) == 1 and running[0]["Names"].startswith("sparkrun_") and running[0]["Names"].endswith("_solo")
    labels = docker("inspect", "--format", "{{json .Config.Labels}}", running[0]["Names"]).stdout
    assert json.loads(labels)["sparkrun.distribution"] == "sparkrun"
    status = sparkrun("status", "-H", "localhost").stdout
    assert running[0]["Names"] in status or "tiny-docker.yaml" in status
    logs = sparkrun("logs", str(recipe), "-H", "localhost", "-n", "5", check=False)
    assert logs.returncode == 0, logs.stderr
    sparkrun("stop", str(recipe), "-H", "localhost")
    assert containers() == []
    restores = sorted((store / "receipts" / "tiny-docker").glob("*-restore.json"))
    r = json.loads(restores[-1].read_text())
    assert r["validation"]["passed"] and {p["name"] for p in r["phases"]} >= {"prepare.container", "restore", "validate"}
