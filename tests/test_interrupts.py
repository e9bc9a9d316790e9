"""SIGINT and SIGTERM in this process while it changes what the host serves (host/interrupts.py),
sent to the test's own process for real. The whole story with the real engine and sparkrun is in
tests/test_engine_cycle.py (a replacement interrupted, a capture interrupted)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from sparkrun_coldsnap.host.interrupts import Interrupts, as_interrupt


def deliver(sig: signal.Signals) -> None:
    """*sig* to this process, and time for Python to run its handler (it runs between bytecodes)."""
    os.kill(os.getpid(), sig)
    for _ in range(100):
        time.sleep(0.001)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_inside_a_committed_section_is_held_until_it_ends_and_said(sig):
    said: list[str] = []
    interrupts = Interrupts(said.append)
    before = signal.getsignal(sig)
    interrupts.install()
    try:
        with interrupts.committed("restoring tiny:latest"):
            deliver(sig)
            finished = True  # the section went on
        assert finished and interrupts.pending == sig
        assert said == ["%s received while restoring tiny:latest: finishing it (about a second), so the host is left serving; send it again to abandon it" % sig.name]
    finally:
        interrupts.uninstall()
    assert signal.getsignal(sig) == before and interrupts.pending is None


def test_a_second_signal_abandons_the_section_and_later_ones_let_the_cleanup_finish():
    said: list[str] = []
    interrupts = Interrupts(said.append)
    interrupts.install()
    cleaned = False
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"), interrupts.committed("restoring tiny:latest"):
            try:
                deliver(signal.SIGINT)
                deliver(signal.SIGTERM)
            finally:
                deliver(signal.SIGINT)  # while unwinding: ignored
                cleaned = True
        assert cleaned and said[-1] == "SIGTERM received again: abandoning restoring tiny:latest"
    finally:
        interrupts.uninstall()


def test_outside_a_committed_section_sigterm_unwinds_as_ctrl_c_does():
    interrupts = Interrupts(lambda _text: None)
    interrupts.install()
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            deliver(signal.SIGTERM)
    finally:
        interrupts.uninstall()
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"), as_interrupt():
        deliver(signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) == before
