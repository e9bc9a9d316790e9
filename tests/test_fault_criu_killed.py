"""CRIU killed mid-dump, for real: the message says what happened and the state is the true one.

The fault is injected by ``scripts/faults/criu-killed.sh`` given as the CRIU command line
(``COLDSNAP_CRIU``): it kills the real CRIU with SIGKILL once the tree is seized, then ends by
SIGKILL itself. The workload is the small multi-process server of the CRIU driver tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from registry_fixtures import free_port
from test_criu_driver import captured_server, start, wait_http

from sparkrun_coldsnap.controller.common import Attempt
from sparkrun_coldsnap.criu.tree import CheckpointFailed
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
from sparkrun_coldsnap.drivers.cpu import CpuDriver
from sparkrun_coldsnap.errors import CaptureError
from sparkrun_coldsnap.host.iouring import io_uring_disabled
from sparkrun_coldsnap.host.process_tree import kill_tree

KILLER = Path(__file__).resolve().parent.parent / "scripts" / "faults" / "criu-killed.sh"


def test_a_dump_killed_mid_way_names_the_signal_and_leaves_a_serving_tree_serving(criu, tmp_path, monkeypatch):
    monkeypatch.setenv("COLDSNAP_CRIU", "sh %s dump" % KILLER)
    port = free_port()
    with io_uring_disabled():
        unit = start(tmp_path, port)
        try:
            assert wait_http("http://127.0.0.1:%d/state" % port).strip() == "1"
            remaps_before = set(Path("/dev/shm").glob("link_remap.*"))
            with pytest.raises(CheckpointFailed) as caught:
                CpuDriver().checkpoint(unit.root_pid, tmp_path / "images", unit="solo", host="localhost", progress=lambda m: None)
            msg = caught.value.message
            assert set(Path("/dev/shm").glob("link_remap.*")) <= remaps_before  # none left by the killed CRIU
            assert "ended by signal 9 (SIGKILL)" in msg, msg
            assert "RLIMIT" not in msg and "left running" not in msg, msg
            if not caught.value.tree_running:
                # A kill that lands while CRIU's parasite code runs inside a process ends that
                # process (about one run in fifteen here): then the message must say so.
                assert "gone" in msg, msg
                pytest.skip("the kill landed inside the parasite and ended the tree, as the message says: %s" % msg)
            assert "the process tree is still running" in msg, msg
            # What a capture of an already serving workload needs: it still serves.
            assert wait_http("http://127.0.0.1:%d/state" % port, timeout=10).strip() == "2"
            # And a retry with a CRIU that is not killed captures it.
            monkeypatch.delenv("COLDSNAP_CRIU")
            from sparkrun_coldsnap.documents import settings as settings_mod

            settings_mod.forget()
            image = CpuDriver().checkpoint(unit.root_pid, tmp_path / "retry", unit="solo", host="localhost", progress=lambda m: None)
            assert image.image_bytes > 0
        finally:
            kill_tree(unit.root_pid)
    unit.reap()


class FakeUnit:
    """A stand-in for a started engine (a fake: the real stop is covered by the engine tests)."""

    def __init__(self) -> None:
        self.stopped = self.reaped = False

    def stop(self, grace: float = 10.0) -> None:
        self.stopped = True

    def reap(self, timeout: float = 10.0) -> None:
        self.reaped = True


def test_a_failure_after_launch_reports_the_engine_it_started_as_stopped_and_the_phase():
    rb = ReceiptBuilder("capture")
    unit = FakeUnit()
    with pytest.raises(CaptureError) as caught, Attempt(rb) as attempt:
        attempt.running = unit  # type: ignore[assignment]
        with rb.phase("checkpoint"):
            raise CheckpointFailed("criu dump of pid 1 was ended by signal 9 (SIGKILL) before it finished: x; the process tree is still running", tree_running=True)
    assert unit.stopped and unit.reaped
    assert caught.value.message.endswith("the engine this capture started has been stopped")
    receipt = caught.value.receipt
    assert receipt is not None and receipt.state == "failed"
    assert receipt.error is not None and receipt.error.phase == "checkpoint" and receipt.error.code == "capture.failed"
    assert receipt.details["workload_state"] == "stopped"


def test_a_restore_killed_mid_way_leaves_no_process_and_a_retry_restores(criu, tmp_path, monkeypatch):
    from sparkrun_coldsnap.documents import settings as settings_mod
    from sparkrun_coldsnap.errors import RestoreError

    port = free_port()
    driver = CpuDriver()
    image = captured_server(tmp_path, port, driver)
    assert driver.admission(image) == []
    monkeypatch.setenv("COLDSNAP_CRIU", "sh %s restore" % KILLER)
    monkeypatch.setenv("CRIU_KILL_AFTER", "0.02")
    monkeypatch.setenv("COLDSNAP_LAZY_PAGES", "0")  # no daemon: the kill lands in criu restore itself
    settings_mod.forget()
    with pytest.raises(RestoreError) as caught:
        driver.restore(image, tmp_path / "images", log_path=tmp_path / "r1.log", progress=lambda m: None)
    assert "ended by signal 9 (SIGKILL)" in caught.value.message, caught.value.message
    import psutil

    live = [p for p in image.pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert live == [], "a partly restored process is left: %s" % live
    assert not any(Path(f.path).exists() for f in image.shared_files)  # the shared files it put back are gone
    for name in ("COLDSNAP_CRIU", "CRIU_KILL_AFTER"):
        monkeypatch.delenv(name)
    settings_mod.forget()
    assert driver.admission(image) == []
    pid = driver.restore(image, tmp_path / "images", log_path=tmp_path / "r2.log", progress=lambda m: None).root_pid
    try:
        assert wait_http("http://127.0.0.1:%d/state" % port).strip() == "2"
    finally:
        kill_tree(pid)


def test_a_dump_that_left_the_tree_running_says_only_that_it_was_stopped_once_capture_stops_it():
    from sparkrun_coldsnap.criu.tree import TreeState

    rb = ReceiptBuilder("capture")
    unit = FakeUnit()
    with pytest.raises(CaptureError) as caught, Attempt(rb) as attempt:
        attempt.running = unit  # type: ignore[assignment]
        with rb.phase("checkpoint"):
            raise CheckpointFailed("criu dump of pid 1 was ended by signal 9 (SIGKILL) before it finished: x", tree_running=True, state=TreeState(alive=3, total=3, resumed=0))
    assert unit.stopped
    assert caught.value.message == "criu dump of pid 1 was ended by signal 9 (SIGKILL) before it finished: x; the engine this capture started has been stopped"


def test_a_dump_failure_on_units_a_capture_stops_no_longer_calls_the_tree_running():
    from sparkrun_coldsnap.criu.tree import TreeState

    rb = ReceiptBuilder("capture")
    with pytest.raises(CaptureError) as caught, Attempt(rb, stop=list, told="every unit started has been stopped and nothing was published"):
        raise CheckpointFailed("criu dump of pid 1 was ended by signal 9 (SIGKILL) before it finished: x", tree_running=True, state=TreeState(alive=2, total=2, resumed=1))
    assert caught.value.message == "criu dump of pid 1 was ended by signal 9 (SIGKILL) before it finished: x; every unit started has been stopped and nothing was published"


def test_a_dump_failure_nobody_stops_still_says_the_tree_runs():
    from sparkrun_coldsnap.criu.tree import TreeState

    err = CheckpointFailed("criu dump of pid 1 failed: x", tree_running=True, state=TreeState(alive=2, total=2, resumed=1))
    assert err.message == "criu dump of pid 1 failed: x; the process tree is still running (1 resumed from a stop)"
