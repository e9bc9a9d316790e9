"""A host file the captured engine maps changes after capture (a library upgrade, say).

Real engine, real CRIU, real sparkrun. The engine preloads a private copy of a system
library; after capture the copy's build-ID is rewritten in place, which is what makes
``criu restore`` fail deep inside. Admission must refuse first, before eviction, naming
the file; the workload must still come up (``on_incompatible: vanilla``); and with
``recapture: true`` the next start restores again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import require_engine, write_recipe
from test_engine_cycle import PROMPT, ask, engine_processes, wait_gone
from test_file_drift import SYSTEM_LIB, rewrite_build_id

pytestmark = [pytest.mark.engine, pytest.mark.skipif(not SYSTEM_LIB.exists(), reason="needs Debian's zlib at its usual path")]


def drift_recipe(tmp_path: Path, store: Path, lib: Path, extra: str = "", name: str = "drift.yaml") -> Path:
    block = "coldsnap:\n  engine_env: vllm-cpu\n  capsule:\n    name: drift\n    store: %s\n%s  validation:\n    prompt: %r\n    max_tokens: 16\n" % (store, extra, PROMPT)
    return write_recipe(tmp_path, coldsnap=block, name=name, replace={"env:\n": "env:\n  LD_PRELOAD: %s\n" % lib})


def receipts(store: Path, kind: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((store / "receipts" / "drift").glob("*-%s.json" % kind))]


def test_a_library_changed_since_capture_is_refused_before_eviction_and_the_workload_still_comes_up(sparkrun, tmp_path):
    require_engine()
    assert not engine_processes(), "an engine is already running; stop it first"
    lib = tmp_path / "libs" / "libz.so.1"
    lib.parent.mkdir()
    shutil.copy2(SYSTEM_LIB.resolve(), lib)
    store = tmp_path / "store"
    recipe = drift_recipe(tmp_path, store, lib)
    capture_receipt = tmp_path / "capture.json"
    sparkrun.coldsnap("capture", str(recipe), "-H", "localhost", "--receipt", str(capture_receipt))
    wait_gone()
    captured = json.loads(capture_receipt.read_text())
    assert captured["details"]["recorded_files"] > 10
    config = sparkrun.json("inspect", "drift", "--store", str(store), "--json")["config"]
    assert str(lib) in {f["path"] for f in config["units"][0]["files"]}

    # A workload is serving; the library changes under the capsule.
    sparkrun("run", str(recipe), "-H", "localhost", "--no-follow")
    try:
        before = {p.pid for p in engine_processes()}
        reply = ask()
        rewrite_build_id(lib)

        # Refused before eviction, naming the file; the old workload serves on.
        # The same recipe (same file name: the same sparkrun workload) that fails instead.
        (tmp_path / "strict").mkdir()
        strict = drift_recipe(tmp_path / "strict", store, lib, extra="  on_incompatible: fail\n")
        cp = sparkrun("run", str(strict), "-H", "localhost", "--no-follow", check=False)
        text = cp.stderr + cp.stdout
        assert cp.returncode != 0
        assert "files the captured workload uses changed since capture: %s (build-ID" % lib in text, text[-2000:]
        assert "recapture (sparkrun coldsnap capture), or set coldsnap.on_incompatible: vanilla" in text
        assert {p.pid for p in engine_processes()} == before and ask() == reply
        assert receipts(store, "restore")[-1]["state"] == "refused"

        # The default: the refused restore becomes a vanilla start, validated, saying why.
        sparkrun("stop", str(recipe), "-H", "localhost")
        wait_gone()
        out = sparkrun("run", str(recipe), "-H", "localhost", "--no-follow")
        assert "starting the engine vanilla" in out.stderr + out.stdout
        assert ask() == reply
        start = receipts(store, "start")[-1]
        assert start["state"] == "succeeded" and start["validation"]["passed"]
        assert "files the captured workload uses changed since capture" in start["details"]["instead_of_restore"]
        assert "Up (pid" in sparkrun("status", "-H", "localhost").stdout
    finally:
        sparkrun("stop", str(recipe), "-H", "localhost")
        wait_gone()

    # recapture: true captures the engine again and serves from the new capsule ...
    (tmp_path / "healing").mkdir()
    healing = drift_recipe(tmp_path / "healing", store, lib, extra="  recapture: true\n")
    old_digest = captured["capsule"]
    out = sparkrun("run", str(healing), "-H", "localhost", "--no-follow")
    try:
        assert "capturing the engine again (recapture: true)" in out.stderr + out.stdout
        assert "restored drift:latest" in out.stderr + out.stdout
        assert ask() == reply
    finally:
        sparkrun("stop", str(healing), "-H", "localhost")
        wait_gone()
    new_digest = sparkrun.json("list", "--store", str(store), "--json")["capsules"][0]["digest"]
    assert new_digest != old_digest

    # ... so the next start restores, from the new capsule, with no capture.
    out = sparkrun("run", str(healing), "-H", "localhost", "--no-follow")
    try:
        assert "restored drift:latest" in out.stderr + out.stdout and "capturing the engine again" not in out.stderr + out.stdout
        last = receipts(store, "restore")[-1]
        assert last["state"] == "succeeded" and last["capsule"] == new_digest
    finally:
        sparkrun("stop", str(healing), "-H", "localhost")
        wait_gone()
