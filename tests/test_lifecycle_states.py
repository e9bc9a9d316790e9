"""The lifecycle's state machine, its records, its lock and how an interrupted transition is settled.

No engine: the transitions run real code against records in a private COLDSNAP_HOME; a
"crash" is a real process killed with SIGKILL in the middle of a transition; a second
command is a real second process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sparkrun_coldsnap.errors import NotFoundError, RequestError
from sparkrun_coldsnap.lifecycle import records, settle, states
from sparkrun_coldsnap.lifecycle.records import Transition, WorkloadRecord, now_iso

NAME = "sparkrun_0123456789abcdef_fedcba987654_solo"


def record(**changes) -> WorkloadRecord:
    base = dict(
        workload=NAME, recipe="/recipes/tiny.yaml", capsule_name="tiny", store="/store", engine="vllm", driver="n610", executor="local", port=8000,
        served_model="coldsnap/tiny-qwen2", state="active", since=now_iso(), root_pid=os.getpid(), capsule_ref="tiny:latest",
        validation_prompt="hi", validation_max_tokens=4,
    )  # fmt: skip
    base.update(changes)
    return WorkloadRecord(**base)


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def never(_ref: str) -> bool:
    return False


def always(_ref: str) -> bool:
    return True


def nothing(_path: str) -> None:
    return None


# -- the table ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "verb,source,why",
    [
        ("wake", "active", "it is already active"),
        ("sleep", "hibernated", "it is hibernated (no engine runs to sleep): wake it first"),
        ("hibernate", "sleeping", "it is sleeping: wake it first"),
        ("warm", "active", "it is active: hibernate it first"),
        ("sleep", "failed", "an earlier transition was interrupted"),
    ],
)
def test_a_move_not_in_the_table_is_one_line_naming_the_workload_its_state_and_what_to_do(verb, source, why):
    with pytest.raises(RequestError) as err:
        states.move(verb, source, workload=NAME)
    assert err.value.code == "lifecycle.not_allowed"
    assert "\n" not in err.value.message
    assert err.value.message.startswith("cannot %s workload %s: " % (verb, NAME))
    assert why in err.value.message


def test_every_state_but_failed_can_get_back_to_active_and_every_move_is_drawn():
    reachable = {"active"}
    changed = True
    while changed:
        changed = False
        for m in states.MOVES:
            if m.source in reachable and m.target not in reachable:
                reachable.add(m.target)
                changed = True
    assert reachable == set(states.STATES) - {"failed"}
    for s in set(states.STATES) - {"active", "failed"}:
        assert any(m.source == s and m.target == "active" for m in states.MOVES), s
    drawn = states.diagram()
    for m in states.MOVES:
        assert "%s --> %s" % (m.source, m.target) in drawn


def test_the_user_guide_draws_the_state_machine_the_code_has():
    guide = (Path(__file__).parents[1] / "docs" / "lifecycle.md").read_text()
    assert states.diagram() in guide


# -- records and the lock ------------------------------------------------------------------


def test_a_record_round_trips_and_a_missing_workload_names_the_ones_that_are_managed(lifecycle_home):
    records.save(record())
    assert records.require(NAME) == record().model_copy(update={"since": records.require(NAME).since})
    with pytest.raises(NotFoundError) as err:
        records.require("sparkrun_nope_solo")
    assert "no workload sparkrun_nope_solo is managed here (managed: %s)" % NAME in err.value.message


def test_a_damaged_record_is_named_with_the_fix(lifecycle_home):
    records.records_dir().mkdir(parents=True)
    records.record_path(NAME).write_text('{"format": 1, "state": "dozing"}')
    with pytest.raises(Exception) as err:
        records.require(NAME)
    assert str(records.record_path(NAME)) in str(err.value) and "remove it" in str(err.value)


HOLDER = textwrap.dedent(
    """
    import sys, time
    from sparkrun_coldsnap.lifecycle import settle
    with settle.transition(sys.argv[1], sys.argv[2], capsule_present=lambda r: True, drop_staging=lambda p: None):
        print("holding", flush=True)
        time.sleep(60)
    """
)


def holder(home: Path, verb: str) -> subprocess.Popen:
    env = dict(os.environ, COLDSNAP_HOME=str(home))
    p = subprocess.Popen([sys.executable, "-c", HOLDER, NAME, verb], env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "holding"
    return p


def test_a_second_transition_on_the_same_workload_is_refused_at_once_naming_the_first(lifecycle_home):
    records.save(record(state="hibernated", root_pid=None))
    first = holder(lifecycle_home, "warm")
    try:
        t = time.monotonic()
        with pytest.raises(records.Busy) as err, settle.transition(NAME, "wake", capsule_present=always, drop_staging=nothing):
            raise AssertionError("both transitions ran")
        assert time.monotonic() - t < 2.0
        assert "workload %s is busy: a warm (hibernated -> warm, pid %d" % (NAME, first.pid) in err.value.message
        assert err.value.exit_code == 5
        assert records.require(NAME).transition.verb == "warm"  # the first one's record is untouched
    finally:
        first.kill()
        first.wait()


def test_the_workload_lock_is_reentrant_in_its_process_from_any_thread_and_its_file_stays(lifecycle_home):
    import threading

    inner: list[BaseException | None] = []

    def again() -> None:
        try:
            with records.locked(NAME):
                inner.append(None)
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            inner.append(err)

    with records.locked(NAME):  # wake holds it while sparkrun's strategy, in this process, asks again
        t = threading.Thread(target=again)
        t.start()
        t.join(10)
    assert inner == [None]
    assert (records.records_dir() / ("%s.lock" % NAME)).is_file()


def test_a_transition_killed_midway_is_settled_by_the_next_command_with_a_note(lifecycle_home):
    records.save(record(state="active", root_pid=os.getpid()))
    crashed = holder(lifecycle_home, "hibernate")
    os.kill(crashed.pid, signal.SIGKILL)
    crashed.wait()
    rec = records.require(NAME)
    assert rec.transition is not None and rec.transition.pid == crashed.pid  # the crash left it recorded
    # The workload (this test's process stands for it) still runs: the hibernate never stopped it.
    settled = settle.settle(rec, never, nothing)
    assert settled.state == "active" and settled.transition is None
    assert "a hibernate (active -> hibernated) was interrupted (pid %d is gone) before the workload stopped: it still serves" % crashed.pid in settled.note
    assert records.require(NAME) == settled


@pytest.mark.parametrize(
    "verb,source,alive,capsule,state",
    [
        ("hibernate", "active", False, True, "hibernated"),
        ("hibernate", "active", False, False, "failed"),
        ("sleep", "active", True, True, "failed"),
        ("wake", "hibernated", True, True, "active"),
        ("wake", "hibernated", False, True, "hibernated"),
        ("warm", "hibernated", False, True, "hibernated"),
        ("warm", "hibernated", False, False, "failed"),
    ],
)
def test_an_interrupted_transition_settles_into_the_state_that_is_true(verb, source, alive, capsule, state):
    t = Transition(verb=verb, source=source, target="active", pid=dead_pid(), started_at=now_iso())
    got, note = settle.judge(t, settle.Reality(tree_alive=alive, capsule_present=capsule, staging_present=False))
    assert got == state
    assert note.startswith("a %s (%s -> active) was interrupted" % (verb, source))
    if state == "failed":
        assert "sparkrun run" in note  # what to do


def test_a_failed_verb_leaves_the_state_it_started_from_and_says_why(lifecycle_home):
    records.save(record(state="active"))
    with pytest.raises(RuntimeError), settle.transition(NAME, "hibernate", capsule_present=always, drop_staging=nothing):
        raise RuntimeError("criu dump failed")
    rec = records.require(NAME)
    assert rec.state == "active" and rec.transition is None
    assert rec.note == "hibernate failed: criu dump failed"


def test_a_settled_warm_drops_its_kept_images(lifecycle_home, tmp_path):
    staging = tmp_path / "kept"
    (staging / "units" / "solo").mkdir(parents=True)
    warm = records.WarmRestore(capsule_ref="tiny:h", capsule_digest="sha256:0", staging=str(staging), images=str(staging / "units" / "solo"), expires_at=now_iso())
    rec = records.save(record(state="hibernated", root_pid=None, warm=warm, transition=Transition(verb="warm", source="hibernated", target="warm", pid=dead_pid(), started_at=now_iso())))
    dropped: list[str] = []
    settled = settle.settle(rec, always, dropped.append)
    assert settled.state == "hibernated" and settled.warm is None and dropped == [str(staging)]


def test_a_workload_is_found_by_its_intent_when_a_plan_drew_another_placement_token(lifecycle_home):
    from sparkrun_coldsnap.integration.records import intent_pattern, same_intent

    assert intent_pattern(NAME) == "sparkrun_0123456789abcdef_*_solo"
    assert intent_pattern("sparkrun_0123456789abcdef_fedcba987654_node_1") == "sparkrun_0123456789abcdef_*_node_1"
    replanned = "sparkrun_0123456789abcdef_00000000aaaa_solo"
    assert same_intent(replanned, NAME) and not same_intent("sparkrun_ffffffffffffffff_00000000aaaa_solo", NAME)
    assert not same_intent("sparkrun_0123456789abcdef_00000000aaaa_node_0", NAME)  # a rank is not the solo unit
    assert records.find(replanned) is None
    records.save(record())
    found = records.find(replanned)
    assert found is not None and found.workload == NAME
    assert records.find("sparkrun_ffffffffffffffff_00000000aaaa_solo") is None
    # Two deployments of the same intent: neither is taken for the other.
    records.save(record(workload="sparkrun_0123456789abcdef_111111111111_solo"))
    assert records.find(replanned) is None and len(records.alike(replanned)) == 2
    assert records.find(NAME).workload == NAME  # an exact name is always itself


def test_a_hibernate_keeps_the_native_payload_its_weights_came_from_only_while_it_is_intact(lifecycle_home):
    from types import SimpleNamespace

    from sparkrun_coldsnap.controller.capture_here import reused_native
    from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
    from sparkrun_coldsnap.weights import native_payload

    staged = lifecycle_home / "written"
    staged.mkdir(parents=True)
    (staged / "rank0.safetensors").write_bytes(b"tensors" * 1000)
    (staged / "rank0.json").write_text("{}")
    record = native_payload.seal(staged)  # as a capture's export leaves it
    run = SimpleNamespace(native_reuse=record, rb=ReceiptBuilder("hibernate"))
    assert reused_native(run.native_reuse, run.rb) == record and run.rb.details["native_reused"] == record.digest
    (native_payload.directory(record) / "rank0.safetensors").write_bytes(b"other tensors")
    run = SimpleNamespace(native_reuse=record, rb=ReceiptBuilder("hibernate"))
    assert reused_native(run.native_reuse, run.rb) is None and "does not match" in run.rb.details["native_not_reused"]  # written again instead
    assert reused_native(None, ReceiptBuilder("hibernate")) is None


def test_a_warm_tree_is_known_by_its_start_in_ticks_not_by_a_wall_clock_time_that_moves(tmp_path, monkeypatch):
    import subprocess
    import sys
    from types import SimpleNamespace

    import psutil

    from sparkrun_coldsnap.lifecycle import warm

    staging = tmp_path / "restore-x"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        warm._write_tree(staging, child.pid)
        w = SimpleNamespace(tree_pid=child.pid, staging=str(staging))
        # Each reader computes the wall-clock start from the boot time it reads, which moves by a
        # second when the host's clock is adjusted: that is no other process.
        real = psutil.Process.create_time
        monkeypatch.setattr(psutil.Process, "create_time", lambda self: real(self) + 1.0)
        assert warm.tree_alive(w)  # type: ignore[arg-type]
    finally:
        child.kill()
        child.wait()
    assert not warm.tree_alive(w)  # type: ignore[arg-type]
