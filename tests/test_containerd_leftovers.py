"""What a docker daemon that died mid-start leaves in containerd is deleted by the container's id:
the task (CREATED, or one whose processes run: stopped first), then the container; nothing of
another container is touched. Against a FAKE ``ctr`` (tests/fakes/fake_ctr.py) keeping
containerd's rules; tests/test_containers.py kills the real dockerd mid-restore."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from sparkrun_coldsnap.launch import containerd_leftovers

FAKE = Path(__file__).parent / "fakes" / "fake_ctr.py"
MINE, OTHER = "9f" * 32, "e5" * 32


@pytest.fixture
def ctr(tmp_path, monkeypatch):
    """The FAKE ctr first on PATH; returns (socket, state file, calls file)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ctr").write_text('#!/bin/sh\nexec %s %s "$@"\n' % (sys.executable, FAKE))
    (bin_dir / "ctr").chmod(0o755)
    sock = tmp_path / "containerd.sock"
    sock.touch()
    state, calls = tmp_path / "state.json", tmp_path / "calls"
    calls.touch()
    monkeypatch.setenv("PATH", "%s:/usr/bin:/bin" % bin_dir)
    monkeypatch.setenv("FAKE_CTR_STATE", str(state))
    monkeypatch.setenv("FAKE_CTR_CALLS", str(calls))
    return sock, state, calls


def given(state: Path, sock: Path, tasks: dict[str, str], containers: list[str]) -> None:
    state.write_text(json.dumps({str(sock): {"tasks": tasks, "containers": containers}}))


def left(state: Path, sock: Path) -> dict:
    return json.loads(state.read_text())[str(sock)]


def test_a_created_task_and_its_container_are_deleted_and_another_is_kept(ctr):
    sock, state, _ = ctr
    given(state, sock, {MINE: "CREATED", OTHER: "CREATED"}, [MINE, OTHER])
    assert containerd_leftovers.remove(MINE, sockets=[sock]) == ["task", "container"]
    assert left(state, sock) == {"tasks": {OTHER: "CREATED"}, "containers": [OTHER]}


def test_a_task_whose_processes_run_is_stopped_first(ctr):
    sock, state, calls = ctr
    given(state, sock, {MINE: "RUNNING"}, [MINE])
    assert containerd_leftovers.remove(MINE, sockets=[sock]) == ["task", "container"]
    assert left(state, sock) == {"tasks": {}, "containers": []}
    assert "tasks kill --signal SIGKILL %s" % MINE in calls.read_text()


def test_nothing_left_asks_nothing_more_than_the_lists_and_no_socket_asks_nothing(ctr, tmp_path):
    sock, state, calls = ctr
    given(state, sock, {}, [OTHER])
    assert containerd_leftovers.remove(MINE, sockets=[tmp_path / "absent.sock", sock]) == []
    assert [line.split()[4:6] for line in calls.read_text().splitlines()] == [["tasks", "ls"], ["containers", "ls"]]
