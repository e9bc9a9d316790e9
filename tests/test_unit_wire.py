"""The wire between the coordinator and a unit's host: framed messages, typed steps checked at
both ends, and the agent run for real as a program on this host."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from fakes.fake_unit_hosts import FakeUnitHosts

from sparkrun_coldsnap.documents.request import LaunchUnit
from sparkrun_coldsnap.errors import CaptureError, ToolError
from sparkrun_coldsnap.units import agent, framing, remote
from sparkrun_coldsnap.units.local import LocalHost
from sparkrun_coldsnap.units.steps import STEPS, FilesAnswer, FilesStep, RestoreStep, RootAnswer, RootStep

UNIT = LaunchUnit(name="rank-1", host="b", rank=1)


def test_a_frame_is_read_past_the_lines_around_it():
    noise = b'WARNING: a library had something to say\n{"answer": {"pid": 1}}\n'
    assert remote.answer(RootStep(name="x"), noise + framing.answer(RootAnswer(pid=7)) + b"more noise\n", unit="u", host="h") == RootAnswer(pid=7)


def test_a_frame_over_the_cap_is_refused_both_ways():
    with pytest.raises(framing.FrameError, match="over the frame cap of 100 bytes"):
        framing.encode({"x": "y" * 200}, limit=100)
    with pytest.raises(framing.FrameError, match="over the cap of 100 bytes"):
        framing.decode(framing.encode({"x": "y" * 200}), limit=100)


@pytest.mark.parametrize(
    ("out", "why"),
    [
        (framing.MARK + b"{not json\n", "a frame that is not JSON"),
        (framing.MARK + b"[1, 2]\n", "a frame that is not a JSON object"),
        (framing.MARK + b'{"answer": {}, "extra": 1}\n', "an answer frame holds exactly answer or error"),
        (framing.MARK + b'{"error": "killed"}\n', "an error frame without a code and a message"),
        (framing.answer(RootAnswer(pid=1)) * 2, "2 frames where one was expected"),
    ],
)
def test_a_damaged_answer_is_one_error_naming_the_unit_the_host_and_the_step(out, why):
    with pytest.raises(ToolError) as err:
        remote.answer(RootStep(name="x"), out, unit="rank-1", host="b")
    assert err.value.code == "host.bad_answer" and "\n" not in err.value.message
    assert err.value.message.startswith("unit rank-1 on host b: step root answered with %s" % why), err.value.message


def test_no_answer_at_all_names_the_transport_failure():
    with pytest.raises(ToolError) as err:
        remote.answer(RootStep(name="x"), "Connection refused\n", unit="rank-1", host="b", returncode=255, tail="Connection refused")
    assert err.value.code == "host.bad_answer"
    assert err.value.message == "unit rank-1 on host b: step root gave no answer (ssh to b failed): Connection refused"


def test_an_error_frame_keeps_the_hosts_code_and_its_one_line():
    with pytest.raises(ToolError) as err:
        remote.answer(RootStep(name="x"), framing.error("restore.failed", "pid 200 is in use:\n  stop it"), unit="rank-1", host="b")
    assert err.value.code == "restore.failed" and err.value.message == "unit rank-1 on host b: pid 200 is in use: stop it"


def test_a_missing_field_is_refused_by_the_agent():
    frame, ok = agent.handle(framing.encode({"step": "files", "request": {"name": "cluster_node_1"}}), LocalHost(records=None))  # type: ignore[arg-type]
    assert not ok
    with pytest.raises(ToolError) as err:
        remote.answer(FilesStep(root_pid=1), frame, unit="rank-1", host="b")
    assert err.value.code == "host.bad_request"
    assert err.value.message == "unit rank-1 on host b: step files: the request: root_pid: field required"


def test_an_unknown_step_or_key_is_refused_by_the_agent():
    for request, why in (({"step": "format_disk", "request": {}}, "unknown step 'format_disk'"), ({"step": "root", "request": {"name": "x", "pid": 1}}, "unknown key 'pid'")):
        frame, ok = agent.handle(framing.encode(request), LocalHost(records=None))  # type: ignore[arg-type]
        assert not ok and why in framing.decode(frame)["error"]["message"]


def test_a_missing_field_is_refused_by_the_coordinator():
    frame = framing.encode({"answer": {"details": {}}})  # a restore's answer without the restored root
    with pytest.raises(ToolError) as err:
        remote.answer(RestoreStep.model_construct(), frame, unit="rank-1", host="b")
    assert err.value.code == "host.bad_answer"
    assert err.value.message.startswith("unit rank-1 on host b: step restore answered with the answer: pid: field required"), err.value.message


def test_every_step_names_its_answer_and_the_host_end_carries_it_out():
    for verb, step in STEPS.items():
        assert step.verb == verb and step.answer_type().model_config.get("extra") == "forbid"
        assert callable(getattr(LocalHost, verb)), verb


def test_a_driver_that_cannot_cut_across_hosts_refuses_the_remote_dump(tmp_path):
    from sparkrun_coldsnap.drivers.base import SnapshotDriver

    class Single(SnapshotDriver):
        name = "single"
        support = precheck = checkpoint = admission = restore = lambda *a, **k: None  # type: ignore[assignment]

    with pytest.raises(CaptureError, match="^snapshot driver single does not dump a unit at a cut across hosts"):
        Single().dump_at_cut(1, tmp_path, unit="u", host="h", progress=print)


def test_a_step_through_the_fake_hosts_crosses_the_same_wire():
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        hosts = FakeUnitHosts()
        answer = hosts.call(UNIT, FilesStep(root_pid=sleeper.pid))
        assert isinstance(answer, FilesAnswer) and any(f.path.endswith("/sleep") for f in answer.files)
        assert hosts.log == [("files", "b")]
    finally:
        sleeper.kill()
        sleeper.wait()


def _agent(request: bytes, *, code: str = "") -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "sparkrun_coldsnap.integration.unit_agent"] if not code else [sys.executable, "-c", code]
    return subprocess.run(argv, input=request, capture_output=True, timeout=120)


def test_one_step_round_trip_through_the_agent_program():
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        step = FilesStep(root_pid=sleeper.pid, name="coldsnap_test_no_such_rank_solo")
        done = _agent(remote.request(step))
        assert done.returncode == 0, done.stderr
        answer = remote.answer(step, done.stdout, unit="solo", host="localhost", returncode=done.returncode)
        assert any(f.path.endswith("/sleep") for f in answer.files)
        root = RootStep(name="coldsnap_test_no_such_rank_solo")
        assert remote.answer(root, _agent(remote.request(root)).stdout, unit="solo", host="localhost") == RootAnswer(pid=None)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_what_a_step_prints_goes_to_standard_error_and_the_answer_stays_whole():
    code = textwrap.dedent("""
        import subprocess, sys
        from pathlib import Path
        from sparkrun_coldsnap.units import agent

        class Chatty:
            def pid(self, name):
                print("a library's banner on standard output")
                subprocess.run(["echo", "a tool's output"], check=True)
                return None
            def log_path(self, name): return Path("/dev/null")
            def named(self, pattern): return []
            def register(self, name, pid): raise AssertionError

        raise SystemExit(agent.serve(Chatty()))
    """)
    done = _agent(remote.request(RootStep(name="x")), code=code)
    assert done.returncode == 0, done.stderr
    assert done.stdout == framing.answer(RootAnswer(pid=None))
    assert b"a library's banner" in done.stderr and b"a tool's output" in done.stderr


def test_a_request_over_the_cap_is_answered_with_an_error_frame():
    done = _agent(framing.MARK + b'{"step": "root", "request": {"name": "' + b"x" * (framing.MAX_BYTES + 10) + b'"}}\n')
    assert done.returncode == 1
    with pytest.raises(ToolError) as err:
        remote.answer(RootStep(name="x"), done.stdout, unit="solo", host="localhost", returncode=done.returncode)
    assert err.value.code == "host.bad_request" and "over the cap" in err.value.message


def test_a_layer_named_by_anything_but_a_digest_is_refused_before_the_host_reads_it():
    request = {"step": "stage", "request": {"inbox": "/tmp/x", "unit": "u", "layers": [{"media_type": "m", "digest": "../../etc/passwd", "size": 1}]}}
    frame, ok = agent.handle(framing.encode(request), LocalHost(records=None))  # type: ignore[arg-type]
    assert not ok and "is not a sha256 digest" in framing.decode(frame)["error"]["message"]
