"""The host-wide io_uring switch, held by several captures at once: the real sysctl, the real
host state folder; captures under different homes, a hold on another host's behalf, a
holder killed outright."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from fakes.fake_unit_hosts import FakeUnitHosts

from sparkrun_coldsnap.errors import CaptureError
from sparkrun_coldsnap.host import iouring
from sparkrun_coldsnap.host.iouring import SYSCTL, hold_off, holders, io_uring_disabled, let_go, put_back_after_crash


@pytest.fixture
def switch_on():
    """The switch at 0 (io_uring allowed) for the test, as it was afterwards."""
    if not SYSCTL.exists():
        pytest.fail("this kernel has no io_uring switch")
    before = SYSCTL.read_text().strip()
    assert holders() == [], "another capture holds io_uring off on this host"
    SYSCTL.write_text("0")
    yield
    SYSCTL.write_text(before)


def value() -> str:
    return SYSCTL.read_text().strip()


def test_captures_under_two_homes_put_the_setting_back_only_when_both_are_done(switch_on, use_settings, tmp_path):
    use_settings(home=tmp_path / "home-a")
    first = io_uring_disabled()
    first.__enter__()
    use_settings(home=tmp_path / "home-b")
    with io_uring_disabled():
        assert value() == "2" and len(holders()) == 2
    assert value() == "2", "the second capture put io_uring back under the first"
    first.__exit__(None, None, None)
    assert value() == "0" and holders() == []


def test_a_hold_for_another_host_outlasts_a_local_capture_and_a_recover(switch_on):
    assert hold_off("coordinator-1") == "0"
    with io_uring_disabled():
        assert value() == "2"
    assert put_back_after_crash() is None and value() == "2"
    assert let_go("coordinator-1") == "0" and value() == "0"


def test_a_hold_for_another_host_stops_counting_after_its_time(switch_on, monkeypatch):
    hold_off("coordinator-2")
    monkeypatch.setattr(iouring, "REMOTE_HOLD_SECONDS", 0.05)
    time.sleep(0.1)
    assert put_back_after_crash() == "0" and value() == "0" and holders() == []


def test_a_holder_killed_outright_stops_counting_and_the_value_from_before_it_is_put_back(switch_on):
    code = "import os, signal; from sparkrun_coldsnap.host.iouring import io_uring_disabled\nwith io_uring_disabled():\n    os.kill(os.getpid(), signal.SIGKILL)"
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert cp.returncode < 0, cp.stderr
    assert value() == "2" and holders() == []  # the holder is gone, the setting not yet back
    with io_uring_disabled():  # the next capture keeps the value from before the killed one
        assert value() == "2"
    assert value() == "0"


def test_a_token_that_is_not_a_name_is_refused_before_anything_changes(switch_on):
    with pytest.raises(CaptureError, match="hold token"):
        hold_off("../x")
    assert value() == "0"


def test_a_hold_whose_coordinator_on_this_host_was_killed_outright_stops_counting(switch_on):
    code = "import os, signal; from sparkrun_coldsnap.host.iouring import coordinator, hold_off\nhold_off('coordinator-3', coordinator())\nos.kill(os.getpid(), signal.SIGKILL)"
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert cp.returncode < 0, cp.stderr
    assert value() == "2" and holders() == []  # its let-go never came; the hold ended with it
    assert put_back_after_crash() == "0" and value() == "0"


def test_a_hold_whose_coordinator_cannot_be_seen_from_here_counts_until_let_go(switch_on):
    gone = subprocess.run([sys.executable, "-c", "import json; from sparkrun_coldsnap.host.iouring import coordinator; print(json.dumps(coordinator()))"], capture_output=True, text=True, check=True)
    by = {**json.loads(gone.stdout), "boot_id": "another-kernel"}  # a pid here says nothing of a process under another kernel
    hold_off("coordinator-4", by)
    assert holders() == ["holder-remote-coordinator-4"] and put_back_after_crash() is None
    hold_off("coordinator-5", iouring.coordinator())  # alive: this process
    assert len(holders()) == 2
    let_go("coordinator-4")
    assert let_go("coordinator-5") == "0" and value() == "0"


class AnswerLost(FakeUnitHosts):
    """Unit hosts (this machine, over the real wire) whose agent takes the hold but whose answer never arrives."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def call(self, unit, step, *, timeout=900.0):
        self.calls.append(step.verb)
        answer = super().call(unit, step, timeout=timeout)
        if step.verb == "io_uring_off":
            raise CaptureError("no answer from %s within %d s" % (unit.host, timeout))
        return answer


def test_a_hold_taken_whose_answer_was_lost_is_let_go(switch_on):
    from sparkrun_coldsnap.controller.ranks import io_uring_off
    from sparkrun_coldsnap.documents.request import LaunchUnit

    hosts = AnswerLost()
    with pytest.raises(CaptureError, match="no answer"), io_uring_off(hosts, [LaunchUnit(name="solo", host="localhost")]):
        pass
    assert hosts.calls == ["io_uring_off", "io_uring_back"]
    assert value() == "0" and holders() == []
