"""A workload on two hosts captured and restored through sparkrun's CLI: recipes/tiny-vllm-cpu-two-node.yaml,
the real CPU vLLM with tensor parallel 2, one rank on each host of tests/two_hosts.py, real CRIU
on each host through sparkrun's transport.

`sparkrun coldsnap capture --cluster two-node`, `sparkrun run` restoring both units (validated
through rank 0), `sparkrun status` listing both, `sparkrun stop` stopping both, `sparkrun coldsnap bench` of the
recipe (one sample of each path); and the faults:
a placement that is not the captured one (ranks swapped, one host fewer), a unit refused by
admission on one host only, a host that cannot be reached, a unit whose dump fails.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest
from test_two_node_run import chat, host_processes, prepare_run, rank_logs, run_logged, share_model_cache

from sparkrun_coldsnap.host import xstate_perm

pytestmark = pytest.mark.engine

CLUSTER = ("--cluster", "two-node")


def capsule_config(sparkrun, store) -> dict:
    out = sparkrun.coldsnap("inspect", "tiny-vllm-cpu-two-node:latest", "--store", str(store), "--json").stdout
    return json.loads(out)


def no_process_left(two_node, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while (left := {h.address: host_processes(h) for h in two_node.hosts}) and any(left.values()) and time.monotonic() < deadline:
        time.sleep(1)
    return left


def cluster_of(sparkrun, name: str, hosts) -> tuple[str, str]:
    """A cluster of *hosts* in that order, sharing this machine's model cache as two-node does."""
    sparkrun("cluster", "create", name, "--hosts", ",".join(h.address for h in hosts), "--user", "root")
    share_model_cache(sparkrun, name)
    return ("--cluster", name)


def one_line_error(cp) -> str:
    lines = [line for line in (cp.stdout + cp.stderr).splitlines() if "rror" in line]
    assert cp.returncode != 0 and lines, cp.stdout[-3000:] + cp.stderr[-3000:]
    return lines[-1]


def test_capture_two_hosts_restore_both_units_through_sparkrun_run_status_and_stop_see_both(two_node, sparkrun, tmp_path):
    recipe = prepare_run(two_node, sparkrun, tmp_path, keep_block=True)
    store = tmp_path / "store"
    head, worker = two_node.hosts
    try:
        out = run_logged(sparkrun, tmp_path / "capture.log", "coldsnap", "capture", str(recipe), *CLUSTER)
        assert "captured tiny-vllm-cpu-two-node:latest" in out, out
        assert no_process_left(two_node) == {head.address: set(), worker.address: set()}  # a capture stops what it started

        cfg = capsule_config(sparkrun, store)["config"]
        assert [(u["name"], u["host"]) for u in cfg["units"]] == [("rank-0", head.address), ("rank-1", worker.address)]
        assert all(u["tcp_established"] and u["driver_data"].get("peer_connections") for u in cfg["units"]), cfg["units"]
        assert cfg["validation"]["reply"]

        # A placement that is not the captured one is refused before anything runs, in one line.
        swapped = sparkrun("run", str(recipe), *cluster_of(sparkrun, "swapped", [worker, head]), "--no-follow", check=False)
        error = one_line_error(swapped)
        assert "unit rank-0 ran on host %s at capture, the run places it on host %s" % (head.address, worker.address) in error, error
        # (one host of one CPU slot places one rank: the run asks for one)
        fewer = sparkrun("run", str(recipe), *cluster_of(sparkrun, "fewer", [head]), "-o", "tensor_parallel=1", "--no-follow", check=False)
        assert "the capsule has 2 units" in one_line_error(fewer)
        assert no_process_left(two_node, timeout=5) == {head.address: set(), worker.address: set()}

        out = run_logged(sparkrun, tmp_path / "run.log", "run", str(recipe), *CLUSTER, "--no-follow")
        assert "distributed state restored 2/2" in out and "reply matches capture" in out, out
        assert chat(head.address)
        # Each host's agent gave its unit's processes back their AMX tile permission (where the
        # host has tiles) while the unit was still stopped at the cut.
        restore = json.loads(sorted((store / "receipts" / "tiny-vllm-cpu-two-node").glob("*-restore.json"))[-1].read_text())
        for unit in restore["details"]["units"].values():
            if xstate_perm.tiles_supported():
                assert unit["amx_permission"]["processes"] >= 2 and unit["amx_permission"]["refused"] == 0, restore["details"]["units"]
            else:
                assert "amx_permission" not in unit
        status = sparkrun("status", *CLUSTER).stdout
        assert head.address in status and worker.address in status, status
        serving = {h.address: host_processes(h) for h in two_node.hosts}
        assert all(serving.values()), serving

        # Admission refused on one host only (a library the worker's tree maps differs there):
        # named with its host and unit, the workload serving untouched.
        mapped = next(f["path"] for f in next(u for u in cfg["units"] if u["name"] == "rank-1")["files"] if f["path"].endswith(".so") and "/lib" in f["path"])
        drifted = tmp_path / "drifted.so"
        subprocess.run(["cp", mapped, str(drifted)], check=True)
        with open(drifted, "ab") as f:  # another build of it, as an upgrade on that host alone would leave
            f.write(b"\0")
        sshd = str(worker.sshd.pid)
        subprocess.run(["nsenter", "-t", sshd, "-m", "mount", "--bind", str(drifted), mapped], check=True)
        try:
            refused = sparkrun("run", str(recipe), *CLUSTER, "--no-follow", check=False)
        finally:
            subprocess.run(["nsenter", "-t", sshd, "-m", "umount", "-l", mapped], check=True)
        error = one_line_error(refused)
        assert "unit rank-1 on host %s" % worker.address in error and mapped in error, error
        assert "rank-0 on host" not in error, error
        assert {h.address: host_processes(h) for h in two_node.hosts} == serving
        assert chat(head.address)
    except AssertionError as err:
        raise AssertionError("%s\n%s" % (err, rank_logs(head, worker))) from None
    finally:
        sparkrun("stop", str(recipe), *CLUSTER, check=False)
    assert no_process_left(two_node) == {head.address: set(), worker.address: set()}

    # The benchmark of the recipe: every rank started against every unit restored (one sample
    # here; docs/benchmarks.md has the medians). The lifecycle's benchmark is for one unit.
    lifecycle = sparkrun("coldsnap", "bench", str(recipe), *CLUSTER, "--lifecycle", check=False)
    assert "bench --lifecycle times a workload of one unit" in one_line_error(lifecycle)
    out = sparkrun("coldsnap", "bench", str(recipe), *CLUSTER, "--samples", "1", "--out", str(tmp_path / "bench"), "--json").stdout
    doc = json.loads(out)
    assert doc["all_restores_validated"] and doc["vanilla_ttft"]["n"] == 1 and doc["restore_ttft"]["n"] == 1, doc
    assert [(u["unit"], u["host"]) for u in doc["units"]] == [("rank-0", head.address), ("rank-1", worker.address)]
    restored = next(x for x in doc["samples"] if x["path"] != "vanilla")
    assert {name: unit["host"] for name, unit in restored["notes"]["units"].items()} == {"rank-0": head.address, "rank-1": worker.address}
    assert restored["prepare_seconds"] > 0 and "launch.rank-1" in doc["samples"][0]["phases"], doc["samples"]
    assert (tmp_path / "bench" / "bench.json").is_file()
    assert no_process_left(two_node) == {head.address: set(), worker.address: set()}


def test_a_host_that_cannot_be_reached_fails_the_capture_in_one_line_and_starts_nothing(two_node, sparkrun, tmp_path):
    recipe = prepare_run(two_node, sparkrun, tmp_path, keep_block=True)
    head, worker = two_node.hosts
    worker.sshd.terminate()
    worker.sshd.wait(timeout=10)
    try:
        cp = sparkrun("coldsnap", "capture", str(recipe), *CLUSTER, check=False)
    finally:  # the hosts serve the whole session's tests
        two_node._start_sshd(worker)
        two_node._await_sshd(worker)
    error = one_line_error(cp)
    assert "host %s (rank 1 of two-node) cannot be reached" % worker.address in error, error
    assert not (tmp_path / "store" / "index.json").exists() or "tiny-vllm-cpu-two-node" not in (tmp_path / "store" / "index.json").read_text()
    assert host_processes(head) == set()


def test_a_unit_whose_dump_fails_fails_the_capture_naming_it_and_leaves_no_process_and_no_capsule(two_node, sparkrun, tmp_path):
    recipe = prepare_run(two_node, sparkrun, tmp_path, keep_block=True)
    head, worker = two_node.hosts
    stop = threading.Event()

    def kill_rank1_criu() -> None:
        # The dumps of both units run on this machine's PID namespace: only rank-1's is killed
        # (its images directory is named after the unit's scratch directory on host b's side).
        while not stop.is_set():
            found = subprocess.run(["pgrep", "-f", "[c]riu dump -t [0-9]* -D .*inbox-"], capture_output=True, text=True).stdout.split()
            for pid in found:
                try:
                    ns = subprocess.run(["ip", "netns", "identify", pid], capture_output=True, text=True).stdout.strip()
                except OSError:
                    continue
                if ns == worker.namespace:
                    subprocess.run(["kill", "-KILL", pid])
                    return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_rank1_criu, daemon=True)
    killer.start()
    try:
        cp = sparkrun("coldsnap", "capture", str(recipe), *CLUSTER, check=False, timeout=1200)
    finally:
        stop.set()
        killer.join(timeout=5)
    error = one_line_error(cp)
    assert "unit rank-1 on host %s" % worker.address in error and "criu" in error, error
    assert "nothing was published" in error, error
    assert no_process_left(two_node) == {head.address: set(), worker.address: set()}
    index = tmp_path / "store" / "index.json"
    assert not index.exists() or "tiny-vllm-cpu-two-node" not in index.read_text()
