"""The whole cycle with the real CPU vLLM engine, real CRIU and real sparkrun.

capture -> restore through `sparkrun run` -> validated -> `sparkrun status`
shows it -> `sparkrun stop` stops it; then what must be refused with a real
capsule (damaged blobs, another host's fingerprint, a missing capsule); and
the `bench` verb on the same capsule.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import requests
from conftest import Sparkrun, base_env, require_engine, write_recipe
from registry_fixtures import Registry

from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule import media
from sparkrun_coldsnap.capsule.store import CapsuleStore, Descriptor
from sparkrun_coldsnap.host import xstate_perm

pytestmark = pytest.mark.engine
PORT = 8000
PROMPT = "Reply with one short sentence: what is a cold start?"


def recipe_with_store(tmp_path: Path, store: Path, extra: str = "", name: str = "tiny.yaml", capsule_extra: str = "") -> Path:
    block = "coldsnap:\n  engine_env: vllm-cpu\n  capsule:\n    name: tiny\n    store: %s\n%s%s  validation:\n    prompt: %r\n    max_tokens: 16\n" % (store, capsule_extra, extra, PROMPT)
    return write_recipe(tmp_path, coldsnap=block, name=name)


def ask(port: int = PORT) -> str:
    body = {"model": "coldsnap/tiny-qwen2", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "temperature": 0, "seed": 0}
    r = requests.post("http://127.0.0.1:%d/v1/chat/completions" % port, json=body, timeout=60)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def engine_processes() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline", "name"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if ("vllm.entrypoints.openai.api_server" in cmd or (p.info["name"] or "").startswith("VLLM::")) and p.status() != psutil.STATUS_ZOMBIE:
            out.append(p)
    return out


def tiles_given_back(details: dict) -> None:
    """Where the host offers AMX tiles (oneDNN uses them for the engine's matrix products), every
    restored process asked for them again before the engine was sent a request; else nothing."""
    if xstate_perm.tiles_supported():
        tiles = details["amx_permission"]
        assert tiles["processes"] >= 2 and tiles["refused"] == 0, details
    else:
        assert "amx_permission" not in details, details


def wait_gone(timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while engine_processes():
        assert time.monotonic() < deadline, "engine processes left: %s" % engine_processes()
        time.sleep(0.2)


@pytest.fixture(scope="module")
def captured(tmp_path_factory, template_home):
    """One real capture for the module: (store, recipe, receipt)."""
    require_engine()
    assert not engine_processes(), "an engine is already running; stop it first"
    tmp = tmp_path_factory.mktemp("captured")
    home = tmp / "home"
    shutil.copytree(template_home, home, symlinks=True)
    sr = Sparkrun(home, base_env(home))
    store = tmp / "store"
    recipe = recipe_with_store(tmp, store)
    receipt_path = tmp / "capture-receipt.json"
    sr.coldsnap("capture", str(recipe), "-H", "localhost", "--receipt", str(receipt_path))
    wait_gone()
    receipt = json.loads(receipt_path.read_text())
    return store, recipe, receipt


def test_capture_wrote_a_verified_capsule_and_receipt(captured, sparkrun):
    store, recipe, receipt = captured
    assert receipt["state"] == "succeeded" and receipt["operation"] == "capture"
    assert receipt["validation"]["passed"] and receipt["validation"]["reply"]
    assert {p["name"] for p in receipt["phases"]} >= {"launch", "ready", "validate", "checkpoint", "pack", "publish"}
    listing = sparkrun.json("list", "--store", str(store), "--json")
    assert [c["ref"] for c in listing["capsules"]] == ["tiny:latest"]
    assert listing["capsules"][0]["digest"] == receipt["capsule"]
    doc = sparkrun.json("inspect", "tiny", "--store", str(store), "--json")
    assert doc["manifest"]["artifactType"] == media.ARTIFACT_TYPE
    assert doc["config"]["weights"]["location"] == "in-image"
    assert doc["config"]["validation"]["reply"] == receipt["validation"]["reply"]
    # The token oracle's record: the engine returned each of the 16 tokens' id and log-probability.
    tokens = doc["config"]["validation"]["tokens"]
    assert tokens == receipt["validation"]["tokens"] and len(tokens["ids"]) == len(tokens["logprobs"]) == 16, tokens
    assert all(l["annotations"][media.A_TITLE] for l in doc["manifest"]["layers"])
    assert "layers verified" in sparkrun.coldsnap("verify", "tiny", "--store", str(store)).stdout
    # The room check's estimate, taken before the dump, is near what CRIU wrote (before the
    # zero pages were left out).
    zero = receipt["details"]["zero_pages"]
    estimate, kept = receipt["details"]["dump_estimate_bytes"], receipt["details"]["image_bytes"]
    written = kept + zero["pages_bytes_before"] - zero["pages_bytes_after"]
    assert 0.7 * written <= estimate <= 1.3 * written, (estimate, written)
    # The engine's 1 GiB KV cache is zeros: it is not in the capsule.
    assert "skipped" not in zero, zero
    assert zero["pages_bytes_before"] - zero["pages_bytes_after"] == zero["zero_pages_left_out"] * 4096 > 0.9e9, zero
    assert "compact" in {p["name"] for p in receipt["phases"]}


def test_sparkrun_run_restores_status_shows_stop_stops(captured, sparkrun, tmp_path):
    store, recipe, receipt = captured
    out = sparkrun("run", str(recipe), "-H", "localhost", "--no-follow")
    assert "restored tiny:latest" in out.stderr + out.stdout, out.stderr[-2000:]
    assert ask() == receipt["validation"]["reply"]
    status = sparkrun("status", "-H", "localhost").stdout
    assert "Up (pid" in status and "tiny.yaml" in status
    # sparkrun's logs read the restored engine's output: the validation and the request above.
    logs = sparkrun("logs", str(recipe), "-H", "localhost", "-n", "50").stdout
    assert logs.count("POST /v1/chat/completions") >= 2, logs[-2000:]
    receipts = sorted((store / "receipts" / "tiny").glob("*-restore.json"))
    r = json.loads(receipts[-1].read_text())
    assert r["state"] == "succeeded" and r["validation"]["passed"] and r["validation"]["ttft_seconds"] > 0
    assert r["capsule"] == receipt["capsule"]
    # The token oracle: the same 16 token ids, every log-probability within the default tolerance.
    check = r["validation"]["token_check"]
    assert check["oracle"] == "tokens" and check["tokens"] == 16 and check["ids_equal"] and check["first_mismatch"] is None, check
    assert check["max_abs_logprob_delta"] <= check["tolerance"] == 1e-3, check
    assert r["validation"]["tokens"]["ids"] == receipt["validation"]["tokens"]["ids"]
    tiles_given_back(r["details"])
    # Preparation made sure CRIU would not probe the kernel on the restore's clock.
    assert r["details"]["restore_tools"].get("record") in ("kept by CRIU", "kept", "made"), r["details"]
    sparkrun("stop", str(recipe), "-H", "localhost")
    wait_gone()
    # Restoring twice from the same capsule works (sparkrun coldsnap restore insists on the capsule).
    sparkrun.coldsnap("restore", str(recipe), "-H", "localhost", "--receipt", str(tmp_path / "r2.json"))
    assert json.loads((tmp_path / "r2.json").read_text())["validation"]["passed"]
    assert ask() == receipt["validation"]["reply"]
    sparkrun("stop", str(recipe), "-H", "localhost")
    wait_gone()


def test_without_memory_on_demand_the_engine_comes_back_filled_by_several_threads(captured, sparkrun):
    """The memory fill on the real engine's tree: its processes, threads and shared memory,
    restored in namespaces of their own and filled from the host's side."""
    store, recipe, receipt = captured
    filling = Sparkrun(sparkrun.home, {**sparkrun.env, "COLDSNAP_LAZY_PAGES": "0", "COLDSNAP_PAGE_FILL": "2"})
    filling("run", str(recipe), "-H", "localhost", "--no-follow")
    try:
        assert ask() == receipt["validation"]["reply"]
        r = json.loads(sorted((store / "receipts" / "tiny").glob("*-restore.json"))[-1].read_text())
        split, fill = r["details"]["staged_images"]["page_fill_split"], r["details"]["page_fill"]
        assert split["processes"] >= 2 and split["bytes_moved"] > 100e6 and fill["bytes"] == split["bytes_moved"], r["details"]
        assert fill["threads"] == 2 and r["validation"]["passed"]
        tiles_given_back(r["details"])
    finally:
        sparkrun("stop", str(recipe), "-H", "localhost")
        wait_gone()


@pytest.mark.parametrize("env", [{"COLDSNAP_PAGE_FILL": "0"}, {"COLDSNAP_PAGE_FILL": "0", "COLDSNAP_LAZY_PAGES": "0"}], ids=["memory-on-demand", "criu-copies-every-page"])
def test_without_the_fill_the_tree_runs_at_once_and_answers_request_after_request(captured, sparkrun, env):
    """Without the fill the tree runs as soon as CRIU is done: its processes are given back
    their AMX permission running (a worker without it died of SIGILL at its first request on
    an AMX host), and the calls they were blocked in go on."""
    store, recipe, receipt = captured
    running = Sparkrun(sparkrun.home, {**sparkrun.env, **env})
    running("run", str(recipe), "-H", "localhost", "--no-follow")
    try:
        for _ in range(3):
            assert ask() == receipt["validation"]["reply"]
        r = json.loads(sorted((store / "receipts" / "tiny").glob("*-restore.json"))[-1].read_text())
        assert r["validation"]["passed"] and "page_fill" not in r["details"], r["details"]
        tiles_given_back(r["details"])
    finally:
        sparkrun("stop", str(recipe), "-H", "localhost")
        wait_gone()


def test_a_second_run_replaces_the_first_which_serves_until_the_new_one_is_staged(captured, sparkrun):
    store, recipe, receipt = captured
    sparkrun("run", str(recipe), "-H", "localhost", "--no-follow")
    try:
        old = {p.pid for p in engine_processes()}
        assert old and ask() == receipt["validation"]["reply"]
        # The same recipe again: its capsule holds the PIDs and /dev/shm names the running
        # workload holds too; restored into namespaces of its own it needs none of them free.
        run = sparkrun.popen("run", str(recipe), "-H", "localhost", "--no-follow")
        assert run.stdout is not None
        lines, alive_when_staged = [], None
        for line in run.stdout:
            lines.append(line)
            if "admitted and staged" in line and alive_when_staged is None:
                alive_when_staged = {p for p in old if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}
        assert run.wait(timeout=600) == 0, "".join(lines)[-3000:] + subprocess.run(["ps", "-eo", "pid,ppid,pgid,stat,etime,cmd"], capture_output=True, text=True).stdout
        assert alive_when_staged == old, "the old workload stopped before the new one was staged:\n" + "".join(lines)[-3000:]
        assert "restored tiny:latest" in "".join(lines)
        new = {p.pid for p in engine_processes()}
        assert new and not (new & old)
        assert ask() == receipt["validation"]["reply"]
        assert sparkrun("status", "-H", "localhost").stdout.count("Up (pid") == 1
    finally:
        sparkrun("stop", str(recipe), "-H", "localhost")
        wait_gone()


def replace_interrupted(sparkrun: Sparkrun, recipe: Path, signals: list[tuple[str, signal.Signals]]) -> tuple[int, str]:
    """`sparkrun run` of *recipe* again, sent each signal of *signals* as soon as a line holding
    its text is printed; its exit status and output."""
    run = sparkrun.popen("run", str(recipe), "-H", "localhost", "--no-follow")
    assert run.stdout is not None
    lines, waiting = [], list(signals)
    for line in run.stdout:
        lines.append(line)
        if waiting and waiting[0][0] in line:
            run.send_signal(waiting.pop(0)[1])
    return run.wait(timeout=300), "".join(lines)


def test_an_interrupted_replacement_leaves_the_host_serving_or_says_what_was_stopped(captured, sparkrun):
    """SIGINT or SIGTERM right after the new capsule is staged: before the old workload is stopped
    the run ends there and the old one serves on, after that the restore is finished and the new
    one serves (which of the two, the line printed says), exit 130 either way. Sent while the old
    workload is being stopped: the restore is finished. Two signals, the second while the old
    workload is being stopped: the restore is abandoned, and a receipt and one line say what was
    stopped and what to run."""
    store, recipe, receipt = captured
    sparkrun("run", str(recipe), "-H", "localhost", "--no-follow")
    staged, stopping = "admitted and staged", "stopping the workload this run replaces"
    try:
        for when, sig in ((staged, signal.SIGINT), (staged, signal.SIGTERM), (stopping, signal.SIGINT), (stopping, signal.SIGTERM)):
            old = {p.pid for p in engine_processes()}
            rc, out = replace_interrupted(sparkrun, recipe, [(when, sig)])
            assert rc == 130, out[-3000:]
            finished = "%s received while restoring tiny:latest" % sig.name in out and "which was finished" in out
            assert finished or (when == staged and "nothing was stopped" in out), out[-3000:]
            now = {p.pid for p in engine_processes()}
            assert now and (not (now & old) if finished else now == old), out[-3000:]
            assert ask() == receipt["validation"]["reply"]
            assert sparkrun("status", "-H", "localhost").stdout.count("Up (pid") == 1
            if finished:
                done = json.loads(sorted((store / "receipts" / "tiny").glob("*-restore.json"))[-1].read_text())
                assert done["state"] == "succeeded" and done["validation"]["token_check"]["ids_equal"], done
            else:  # what was staged is dropped
                assert not list((store / ".staging").glob("restore-*")) and not list(Path("/dev/shm/coldsnap-staging").glob("restore-*"))
        rc, out = replace_interrupted(sparkrun, recipe, [(stopping, signal.SIGINT), ("SIGINT received while restoring", signal.SIGINT)])
        assert rc == 130, out[-3000:]
        said = [l for l in out.splitlines() if "was abandoned" in l]
        assert len(said) == 1 and "nothing serves" in said[0] and "was stopped before the restore" in said[0] and "`sparkrun run %s` starts it again" % recipe in said[0], out[-3000:]
        wait_gone()
        with pytest.raises(requests.ConnectionError):
            ask()
        failed = json.loads(sorted((store / "receipts" / "tiny").glob("*-restore.json"))[-1].read_text())
        assert failed["state"] == "failed" and failed["error"]["code"] == "restore.interrupted" and "(pid " in failed["details"]["replaced_workload"], failed
        assert not list((store / ".staging").glob("restore-*")) and not list(Path("/dev/shm/coldsnap-staging").glob("restore-*"))
    finally:
        sparkrun("stop", str(recipe), "-H", "localhost", check=False)
        wait_gone()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_capture_exits_130_and_leaves_nothing(sparkrun, tmp_path, sig):
    require_engine()
    store = tmp_path / "store"
    recipe = recipe_with_store(tmp_path, store)
    run = sparkrun.popen("coldsnap", "capture", str(recipe), "-H", "localhost")
    assert run.stdout is not None
    lines = []
    for line in run.stdout:
        lines.append(line)
        if "waiting for vllm to answer" in line:
            run.send_signal(sig)
    out = "".join(lines)
    assert run.wait(timeout=120) == 130 and "Interrupted." in out, out[-3000:]
    wait_gone()
    assert not (store / ".staging").exists() or [p.name for p in (store / ".staging").iterdir() if p.name not in ("uploads", "downloads")] == []
    assert "tiny" not in sparkrun.coldsnap("list", "--store", str(store), check=False).stdout


def test_one_capsule_restores_twice_at_once_on_two_ports(captured, sparkrun, tmp_path):
    store, recipe, receipt = captured
    # The same recipe under another file name (another sparkrun workload) serving on 8001.
    other = write_recipe(tmp_path, coldsnap=recipe.read_text()[recipe.read_text().index("coldsnap:") :], replace={"port: 8000": "port: 8001"}, name="tiny-second.yaml")
    sparkrun("run", str(recipe), "-H", "localhost", "--no-follow")
    try:
        out = sparkrun("run", str(other), "-H", "localhost", "--no-follow")
        assert "restored tiny:latest" in out.stderr + out.stdout, out.stderr[-2000:]
        assert ask() == receipt["validation"]["reply"]
        assert ask(8001) == receipt["validation"]["reply"]
        assert sparkrun("status", "-H", "localhost").stdout.count("Up (pid") == 2
    finally:
        sparkrun("stop", str(other), "-H", "localhost", check=False)
        sparkrun("stop", str(recipe), "-H", "localhost")
        wait_gone()


def copy_store(store: Path, tmp_path: Path) -> Path:
    """A copy of the captured store whose blobs are hard links to the original's: a blob is
    named by its digest and written once (a new one by rename, never in place), so sharing
    them is safe, and a copy costs no 250 MB. Everything else (index, lock, receipts) is
    copied: the index is rewritten and the lock is taken, which must not reach the original."""

    def link_blobs(src: str, dst: str) -> object:
        if Path(src).parent.parent.name == "blobs":
            os.link(src, dst)
            return dst
        return shutil.copy2(src, dst)

    dst = tmp_path / "store-copy"
    shutil.copytree(store, dst, copy_function=link_blobs)
    return dst


def tamper(path: Path) -> None:
    """Flip a byte in the middle of a blob of a copied store: written as a new file, so the
    hard link the copy shares with the original store is broken, not written through."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.unlink()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("which", ["manifest", "config", "layer"])
def test_a_flipped_byte_in_any_blob_is_refused(captured, sparkrun, tmp_path, which):
    store, _, receipt = captured
    s = copy_store(store, tmp_path)
    cs = CapsuleStore(s)
    cap = capsule_mod.open_capsule(cs, "tiny")
    target = {"manifest": cap.descriptor, "config": Descriptor.from_json(cap.manifest["config"]), "layer": cap.layers[-1]}[which]
    path = cs.blob_path(target.digest)
    assert path.samefile(CapsuleStore(store).blob_path(target.digest))  # shared until tampered with
    tamper(path)
    CapsuleStore(store).verify_blob(target)  # the original is untouched
    cp = sparkrun.coldsnap("verify", "tiny", "--store", str(s), check=False)
    assert cp.returncode != 0 and "failed verification" in cp.stderr and "Traceback" not in cp.stderr
    recipe = recipe_with_store(tmp_path, s, extra="  on_missing: fail\n")
    cp = sparkrun.coldsnap("restore", str(recipe), "-H", "localhost", check=False)
    assert cp.returncode != 0 and "failed verification" in cp.stderr + cp.stdout
    assert not engine_processes()
    assert not list((s / ".staging").glob("*")) and not list(Path("/dev/shm/coldsnap-staging").glob("restore-*"))


def test_missing_blob_is_refused(captured, sparkrun, tmp_path):
    store, _, _ = captured
    s = copy_store(store, tmp_path)
    cap = capsule_mod.open_capsule(CapsuleStore(s), "tiny")
    CapsuleStore(s).blob_path(cap.layers[0].digest).unlink()
    cp = sparkrun.coldsnap("verify", "tiny", "--store", str(s), check=False)
    assert cp.returncode != 0 and "missing from the store" in cp.stderr


def republish_with(store: Path, **fingerprint) -> None:
    """The capsule as another host would have captured it: valid digests, other facts."""
    cs = CapsuleStore(store)
    cap = capsule_mod.open_capsule(cs, "tiny")
    cfg = cap.config.model_copy(update={"fingerprint": cap.config.fingerprint.model_copy(update=fingerprint)})
    config_desc = cs.put_json(cfg.model_dump(mode="json"), media.CONFIG_MEDIA_TYPE)
    manifest = capsule_mod.build_manifest(config_desc, cap.layers, cfg)
    cs.tag("tiny:latest", cs.put_json(manifest, media.OCI_MANIFEST, artifact_type=media.ARTIFACT_TYPE))


def test_a_restore_whose_log_probability_differs_from_the_record_is_refused_with_its_own_code(captured, sparkrun, tmp_path):
    """The capsule republished (valid digests) with one recorded log-probability moved by 0.01: the
    restored engine replies the recorded text in the recorded tokens, and the oracle refuses it."""
    store, _, receipt = captured
    s = copy_store(store, tmp_path)
    cs = CapsuleStore(s)
    cap = capsule_mod.open_capsule(cs, "tiny")
    recorded = cap.config.validation.tokens
    assert recorded is not None
    moved = recorded.model_copy(update={"logprobs": (recorded.logprobs[0], recorded.logprobs[1] + 0.01, *recorded.logprobs[2:])})
    cfg = cap.config.model_copy(update={"validation": cap.config.validation.model_copy(update={"tokens": moved})})
    config_desc = cs.put_json(cfg.model_dump(mode="json"), media.CONFIG_MEDIA_TYPE)
    cs.tag("tiny:latest", cs.put_json(capsule_mod.build_manifest(config_desc, cap.layers, cfg), media.OCI_MANIFEST, artifact_type=media.ARTIFACT_TYPE))
    recipe = recipe_with_store(tmp_path, s, extra="  on_missing: fail\n")
    cp = sparkrun.coldsnap("restore", str(recipe), "-H", "localhost", "--receipt", str(tmp_path / "r.json"), check=False)
    assert cp.returncode != 0 and "log-probabilities differ" in cp.stderr + cp.stdout, (cp.stderr + cp.stdout)[-2000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["state"] == "failed" and r["error"]["code"] == "validation.logprobs" and r["error"]["phase"] == "validate", r["error"]
    v = r["validation"]
    assert v["reply"] == receipt["validation"]["reply"] == v["expected_reply"] and not v["passed"]
    assert v["token_check"]["ids_equal"] and v["token_check"]["first_mismatch"] == 1 and 0.009 < v["token_check"]["max_abs_logprob_delta"] < 0.011, v
    wait_gone()
    assert not list((s / ".staging").glob("*")) and not list(Path("/dev/shm/coldsnap-staging").glob("restore-*"))


def test_incompatible_fingerprint_names_every_mismatch_and_keeps_the_old_workload(captured, sparkrun, tmp_path):
    store, recipe, receipt = captured
    # A workload is running; a refused restore must leave it alone (prepare-before-evict).
    sparkrun("run", str(recipe), "-H", "localhost", "--no-follow")
    try:
        before = {p.pid for p in engine_processes()}
        other = copy_store(store, tmp_path)
        republish_with(other, kernel_release="5.15.0-other", criu_version="4.1.1", torch_version="2.0.0")
        # Same recipe name: same sparkrun workload; refusals fail here rather than start vanilla.
        bad = recipe_with_store(tmp_path, other, name="tiny.yaml", extra="  on_incompatible: fail\n")
        cp = sparkrun("run", str(bad), "-H", "localhost", "--no-follow", check=False)
        text = cp.stderr + cp.stdout
        assert cp.returncode != 0
        for field in ("kernel_release: captured 5.15.0-other", "criu_version: captured 4.1.1", "torch_version: captured 2.0.0"):
            assert field in text, text[-2000:]
        assert {p.pid for p in engine_processes()} == before
        assert ask() == receipt["validation"]["reply"]
        refused = sorted((other / "receipts" / "tiny").glob("*-restore.json"))
        assert json.loads(refused[-1].read_text())["state"] == "refused"
    finally:
        sparkrun("stop", str(recipe), "-H", "localhost")
        wait_gone()


def test_old_capsule_format_asks_to_recapture(captured, sparkrun, tmp_path):
    store, _, _ = captured
    s = copy_store(store, tmp_path)
    cs = CapsuleStore(s)
    cap = capsule_mod.open_capsule(cs, "tiny")
    doc = cap.config.model_dump(mode="json")
    doc["format"] = 0
    config_desc = cs.put_json(doc, media.CONFIG_MEDIA_TYPE)
    manifest = dict(cap.manifest, config=config_desc.to_json())
    cs.tag("tiny:latest", cs.put_json(manifest, media.OCI_MANIFEST, artifact_type=media.ARTIFACT_TYPE))
    cp = sparkrun.coldsnap("inspect", "tiny", "--store", str(s), check=False)
    assert cp.returncode != 0 and "format 0" in cp.stderr and "recapture" in cp.stderr


def test_a_missing_capsule_fails_when_asked_before_anything_starts(sparkrun, tmp_path):
    # The vanilla start instead (on_missing: vanilla, the default) is the fault tests' and the
    # host-drift test's: it does not need this engine.
    require_engine()
    strict = recipe_with_store(tmp_path, tmp_path / "empty-store", extra="  on_missing: fail\n", name="strict.yaml")
    cp = sparkrun("run", str(strict), "-H", "localhost", "--no-follow", check=False)
    assert cp.returncode != 0 and "run `sparkrun coldsnap capture" in cp.stderr + cp.stdout
    assert not engine_processes()


def test_dry_run_changes_nothing(captured, sparkrun):
    store, recipe, _ = captured
    out = sparkrun("run", str(recipe), "-H", "localhost", "--dry-run")
    assert "dry run: the run would restore capsule tiny:latest" in out.stderr + out.stdout
    assert not engine_processes()
    assert not list(Path("/dev/shm/coldsnap-staging").glob("restore-*"))


def test_sparkrun_run_pulls_a_published_capsule_before_restoring(captured, sparkrun, tmp_path):
    store, _, receipt = captured
    registry = Registry(tmp_path / "registry").start()
    try:
        target = "%s/capsules/tiny" % registry.host
        sparkrun.coldsnap("publish", "tiny", target + ":latest", "--store", str(store), "--plain-http")
        empty = tmp_path / "fresh-store"
        recipe = recipe_with_store(tmp_path, empty, extra="  on_missing: fail\n", capsule_extra="    repository: %s\n    plain_http: true\n" % target)
        out = sparkrun("run", str(recipe), "-H", "localhost", "--no-follow")
        text = out.stderr + out.stdout
        assert "pulled tiny:latest from %s:latest" % target in text and "restored tiny:latest" in text
        assert ask() == receipt["validation"]["reply"]
        assert CapsuleStore(empty).resolve("tiny:latest").descriptor.digest == receipt["capsule"]
        sparkrun("stop", str(recipe), "-H", "localhost")
        wait_gone()
    finally:
        registry.stop()


def test_on_a_host_without_the_model_sparkrun_run_fetches_capsule_and_weights_while_preparing(captured, sparkrun, tmp_path):
    store, _, receipt = captured
    registry = Registry(tmp_path / "registry").start()
    try:
        target = "%s/capsules/tiny" % registry.host
        sparkrun.coldsnap("publish", "tiny", target + ":latest", "--store", str(store), "--plain-http", "--with-weights")
        # This host has neither the capsule nor the model: an empty Hugging Face cache.
        bare = Sparkrun(sparkrun.home, {**sparkrun.env, "HF_HOME": str(tmp_path / "hf")})
        empty = tmp_path / "fresh-store"
        recipe = recipe_with_store(tmp_path, empty, extra="  on_missing: fail\n", capsule_extra="    repository: %s\n    plain_http: true\n" % target)
        out = bare("run", str(recipe), "-H", "localhost", "--no-follow")
        text = out.stderr + out.stdout
        # Fetched in sparkrun's preparation, before its own model check would have stopped the run.
        assert "fetched" in text and "model file(s) from the capsule's weights artifact" in text, text[-3000:]
        assert text.index("pulled tiny:latest") < text.index("restored tiny:latest")
        snapshot = tmp_path / "hf" / "hub" / "models--coldsnap--tiny-qwen2" / "snapshots" / "973ff5dd93da77ddc2a1bffa8e29d4d207f245dd"
        assert (snapshot / "config.json").is_file()
        assert ask() == receipt["validation"]["reply"]
        bare("stop", str(recipe), "-H", "localhost")
        wait_gone()
    finally:
        registry.stop()


def test_bench_measures_one_vanilla_start_and_one_restore_and_reports_them(captured, sparkrun, tmp_path):
    """One sample of each path, the cheapest run that still has a median and a ratio to check.
    The page cache is kept: dropping it slows every other process on the host."""
    store, recipe, receipt = captured
    out_dir = tmp_path / "bench"
    cp = sparkrun.coldsnap("bench", str(recipe), "-H", "localhost", "--samples", "1", "--keep-page-cache", "--out", str(out_dir))
    wait_gone()
    doc = json.loads((out_dir / "bench.json").read_text())
    assert doc["format"] == 1 and doc["recipe"] == "tiny" and doc["engine"] == "vllm" and doc["page_cache_dropped"] is False
    assert doc["driver"] == "cpu" and list(doc["paths"]) == ["cpu"]
    samples = doc["samples"]
    assert [(s["path"], s["index"]) for s in samples] == [("vanilla", 0), ("cpu", 0)]
    vanilla, restore = samples
    # A vanilla start takes the engine's whole start; a restore skips it.
    assert vanilla["ttft_seconds"] > restore["ttft_seconds"] > 0 and restore["prepare_seconds"] > 0
    assert "launch" in vanilla["phases"] and restore["phases"] and restore["validated"] is True
    # The summaries are the samples' own, and the ratio is of their medians.
    cpu = doc["paths"]["cpu"]
    for summary, values in ((doc["vanilla_ttft"], [vanilla["ttft_seconds"]]), (cpu["ttft"], [restore["ttft_seconds"]]), (cpu["prepare"], [restore["prepare_seconds"]])):
        assert summary == {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}
    assert cpu["speedup_median"] == vanilla["ttft_seconds"] / restore["ttft_seconds"] > 1
    assert cpu["phases_median"] == restore["phases"]
    assert cpu["all_validated"] is True and doc["all_restores_validated"] is True
    assert cpu["capsule"] == {"ref": "tiny:latest", "digest": receipt["capsule"]}
    assert (doc["restore_ttft"], doc["restore_prepare"], doc["speedup_median"]) == (cpu["ttft"], cpu["prepare"], cpu["speedup_median"])
    assert (out_dir / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Bytes and rates per phase, beside this machine's bandwidths, and the floor they add up to.
    assert cpu["total"]["median"] == restore["prepare_seconds"] + restore["ttft_seconds"]
    assert restore["bytes"]["restore"] > 0 and restore["bytes"]["prepare.stage"] > 0
    assert doc["bandwidth"]["memory_write"] > 0 and doc["bandwidth"]["page_cache_read"] > 0
    rates = cpu["rates"]
    # A filled restore's pages are written by several threads: bound by what they write together.
    bound = "memory_write_parallel" if cpu.get("page_fill") and "memory_write_parallel" in doc["bandwidth"] else "memory_write"
    assert rates["phases"]["restore"]["bytes"] == restore["bytes"]["restore"] and rates["phases"]["restore"]["bound_by"] == bound, rates
    assert 0 < rates["floor_seconds"] < restore["ttft_seconds"], rates
    assert "floor to first token %.2fs (measured %.2fs)" % (rates["floor_seconds"], restore["ttft_seconds"]) in cp.stdout
    assert restore["steps"] and "criu restore" in restore["steps"], restore["steps"]
    # The printed table holds the document's numbers.
    lines = cp.stdout.splitlines()

    def row(label: str) -> list[str]:
        line = next(l for l in lines if l.startswith(label))
        return line[len(label) :].split()

    for label, s in (("vanilla start -> first token", doc["vanilla_ttft"]), ("restore (cpu) -> first token", cpu["ttft"]), ("  preparation, before the clock (cpu)", cpu["prepare"])):
        assert row(label) == ["%.2fs" % s["median"], "%.2fs" % s["min"], "%.2fs" % s["max"], "1"], cp.stdout
    assert "cpu: %.1fx faster than vanilla (medians)" % cpu["speedup_median"] in cp.stdout
    assert "results: %s; plot: %s" % (out_dir / "bench.json", out_dir / "bench.png") in cp.stdout


def test_bench_load_drives_the_engines_own_benchmark_against_a_vanilla_start_and_a_restore(captured, sparkrun, tmp_path):
    """One round of each, a few prompts: throughput on this shared 2-core host swings from round
    to round, so only what must hold is asserted: no request failed on either side, both
    answered the validation prompt with the capture's reply, and both report the same KV cache."""
    store, recipe, receipt = captured
    out_dir = tmp_path / "load"
    load = "prompts=8,concurrency=4,input=32,output=16"
    cp = sparkrun.coldsnap("bench", str(recipe), "-H", "localhost", "--samples", "1", "--keep-page-cache", "--load", load, "--out", str(out_dir))
    wait_gone()
    doc = json.loads((out_dir / "bench.json").read_text())
    assert doc["kind"] == "load" and doc["recipe"] == "tiny" and doc["driver"] == "cpu" and doc["rounds"] == 1
    assert doc["capsule"] == {"ref": "tiny:latest", "digest": receipt["capsule"]}
    vanilla, restored = doc["samples"]
    assert (vanilla["path"], restored["path"]) == ("vanilla", "restored")
    for side in (vanilla, restored):
        # The engine's benchmark ran every request, and wrote its own result beside the document.
        assert side["load"]["completed"] == 8 and side["load"]["failed"] == 0 and side["load"]["errors"] == [], side["load"]
        assert side["load"]["output_tokens_per_second"] > 0 and 0 < side["load"]["ttft_ms"]["p50"] <= side["load"]["ttft_ms"]["p99"]
        raw = json.loads((out_dir / "client" / ("%s-0.json" % side["path"])).read_text())
        assert raw["completed"] == 8 and raw["num_prompts"] == 8 and raw["max_concurrency"] == 4
        assert side["reply"] == receipt["validation"]["reply"] and side["validated"] is True
        assert side["memory_bytes"] > 0
    assert vanilla["engine"]["kv_cache_blocks"] == restored["engine"]["kv_cache_blocks"] > 0
    assert vanilla["engine"]["kv_cache_tokens"] == restored["engine"]["kv_cache_tokens"] > 0
    assert doc["checks"] == {"no_errors": True, "same_replies": True, "same_kv_capacity": True, "all_validated": True}
    assert restored["ttft_seconds"] < vanilla["ttft_seconds"] and restored["prepare_seconds"] > 0
    assert "checks: no errors yes, same replies yes, same kv capacity yes, all validated yes" in cp.stdout
    assert "results: %s" % (out_dir / "bench.json") in cp.stdout
