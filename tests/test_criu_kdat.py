"""CRIU's record of the kernel's features (criu/kdat.py), with the real CRIU and the
real /run: made where CRIU does not keep it, read by CRIU afterwards, made again for another
boot or another CRIU; on a tmpfs /run (a mount namespace of the test's own) left to CRIU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sparkrun_coldsnap.criu import kdat as criu_kdat
from sparkrun_coldsnap.criu.tool import Criu
from sparkrun_coldsnap.drivers.cpu import CpuDriver

pytestmark = pytest.mark.engine  # the real CRIU


def criu_log(tmp_path) -> str:
    """What a CRIU run says of the record at level 4."""
    log = tmp_path / "check.log"
    Criu.locate().run(["check", "-v4", "-o", str(log)], timeout=120, what="criu check")
    return log.read_text(errors="replace")


@pytest.fixture
def no_record():
    """/run as CRIU found it on this host before the plugin's first restore, and as it was after."""
    saved = {p: (p.read_bytes(), p.stat().st_mode) for p in (criu_kdat.KDAT, criu_kdat.NOTE) if p.is_file()}
    for p in saved:
        p.unlink()
    yield
    for p, (data, mode) in saved.items():
        p.write_bytes(data)
        p.chmod(mode & 0o777)


def test_where_run_is_not_a_tmpfs_the_record_is_made_read_by_criu_and_kept(no_record, tmp_path):
    if criu_kdat.on_tmpfs(criu_kdat.RUN):
        pytest.skip("this host's /run is a tmpfs: CRIU keeps its record itself (the next test)")
    assert "Loaded kdat cache" not in criu_log(tmp_path)
    assert not criu_kdat.KDAT.exists(), "CRIU wrote its record on a disk /run by itself"

    criu = Criu.locate()
    assert "CRIU probes the kernel at every run" in criu_kdat.state(criu)  # what doctor says
    done = criu_kdat.ensure(criu)
    assert done["record"] == "made", done
    assert "made this boot, by this CRIU" in criu_kdat.state(criu)
    assert "Loaded kdat cache from /run/criu.kdat" in criu_log(tmp_path)
    assert criu_kdat.ensure(criu) == {"record": "kept"}
    note = json.loads(criu_kdat.NOTE.read_text())
    assert note["version"] == criu.version

    criu_kdat.NOTE.write_text(json.dumps({**note, "boot_id": "another-boot"}))
    assert criu_kdat.ensure(criu)["record"] == "made", "a record of another boot was kept"
    criu_kdat.NOTE.unlink()
    assert criu_kdat.ensure(criu)["record"] == "made", "a record the plugin did not make was kept"
    assert CpuDriver().ready_tools() == {"record": "kept"}  # what a restore's preparation asks


def test_on_a_tmpfs_run_the_record_is_left_to_criu(tmp_path):
    code = (
        "from sparkrun_coldsnap.criu import kdat as criu_kdat\n"
        "from sparkrun_coldsnap.criu.tool import Criu\n"
        "assert criu_kdat.on_tmpfs(criu_kdat.RUN)\n"
        "print(criu_kdat.ensure(Criu.locate())['record'], criu_kdat.ensure(Criu.locate())['record'])\n"
    )
    script = 'mount -t tmpfs -o size=4m test-run /run && exec "$@"'
    cp = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "-", sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.split() == ["made", "kept", "by", "CRIU"]


def test_without_root_or_unshare_nothing_is_made_and_nothing_raises(no_record, monkeypatch):
    criu = Criu.locate()
    monkeypatch.setattr(criu_kdat.os, "geteuid", lambda: 1000)
    assert "not root" in criu_kdat.ensure(criu)["skipped"]
    monkeypatch.undo()
    if criu_kdat.on_tmpfs(criu_kdat.RUN):
        return
    monkeypatch.setattr(criu_kdat.shutil, "which", lambda name: None)
    assert "no unshare on PATH" in criu_kdat.ensure(criu)["skipped"]
    assert not criu_kdat.KDAT.exists()
