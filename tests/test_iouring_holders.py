"""The host-wide io_uring switch, held by several captures at once: the real sysctl, the real
host state folder; captures under different homes, a hold on another host's behalf, a
holder killed outright."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

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
