"""Secrets (API keys, hub tokens, registry passwords) never reach receipts, logs or recorded
commands: requests keep them (the manager's input), everything the plugin writes does not."""

from __future__ import annotations

import json
import logging

import pytest
from helpers import REVISION, synthetic_workload

from sparkrun_coldsnap import api
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.controller.common import Attempt
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
from sparkrun_coldsnap.documents.request import CapsuleRef, CaptureRequest, ValidationSpec
from sparkrun_coldsnap.errors import ColdsnapError, EngineError, ToolError
from sparkrun_coldsnap.host.runner import run

KEY = "sk-live-0123456789abcdef"
TOKEN = "hf_TopSecretTokenValue42"
PASSWORD = "registry-pa55word"


def secret_workload():
    w = synthetic_workload()
    command = "python -m vllm.entrypoints.openai.api_server --model test/model --api-key %s --port 8000" % KEY
    return w.model_copy(update={"launch": w.launch.model_copy(update={"command": command, "env": {"HF_TOKEN": TOKEN, "PLAIN": "visible"}})})


def no_secret(text: str) -> None:
    for s in (KEY, TOKEN, PASSWORD):
        assert s not in text, s


def test_a_recorded_workload_keeps_digests_of_its_secrets():
    w = secret_workload()
    stored = w.redacted()
    no_secret(stored.model_dump_json())
    assert "--api-key sha256:" in stored.launch.command and stored.launch.env["PLAIN"] == "visible"
    assert stored.launch.env["HF_TOKEN"].startswith("sha256:")
    assert set(w.secret_values()) == {KEY, TOKEN}


def test_an_error_quoting_a_secret_is_scrubbed_in_message_and_receipt():
    rb = ReceiptBuilder("capture")
    rb.secrets = secret_workload().secret_values()
    with pytest.raises(EngineError) as caught, Attempt(rb):
        raise EngineError("engine exited; last line: non-default args: {'api_key': '%s', 'hf_token': '%s'}" % (KEY, TOKEN))
    no_secret(caught.value.message)
    assert caught.value.receipt is not None
    no_secret(caught.value.receipt.model_dump_json())
    assert "[redacted]" in caught.value.receipt.error.message  # type: ignore[union-attr]


def test_a_failed_capture_receipt_holds_no_secret(criu, tmp_path):
    w = secret_workload()
    req = CaptureRequest(workload=w, validation=ValidationSpec(prompt="hi"), capsule=CapsuleRef(name="s"), ready_timeout_seconds=5)
    with pytest.raises(ColdsnapError) as caught:
        api.capture(req, store=CapsuleStore(tmp_path / "store"))  # refused: no --revision (nothing starts)
    assert caught.value.receipt is not None
    no_secret(json.dumps(caught.value.receipt.model_dump(mode="json")))
    assert REVISION  # the workload is the synthetic one


def test_commands_in_logs_and_errors_carry_no_secret(caplog):
    caplog.set_level(logging.DEBUG, logger="sparkrun_coldsnap.host.runner")
    argv = ["sh", "-c", "sleep 5", "-e", "REGISTRY_PASSWORD=%s" % PASSWORD, "--api-key", KEY, "HF_TOKEN=%s" % TOKEN]
    with pytest.raises(ToolError) as caught:
        run(argv, timeout=0.2, what="a slow command")
    no_secret(caught.value.message)
    no_secret(caplog.text)
    assert "sha256:" in caplog.text
