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


# -- what a captured engine is given ------------------------------------------------------------


def test_a_captured_engine_gets_no_fetch_credential_and_no_stray_one():
    from sparkrun_coldsnap.secrets import for_capture

    env = {"HF_TOKEN": TOKEN, "HF_TOKEN_PATH": "/keys/hub", "REGISTRY_PASSWORD": PASSWORD, "SHELL_GITHUB_TOKEN": "gh", "VLLM_API_KEY": KEY, "APP_SECRET": "s", "PATH": "/bin", "HF_HUB_OFFLINE": "0"}
    command = "vllm serve m --hf-token %s --api-key %s --hf-token=%s --port 8000" % (TOKEN, KEY, TOKEN)
    launch = for_capture(command, env, given={"HF_TOKEN", "HF_TOKEN_PATH", "REGISTRY_PASSWORD", "APP_SECRET"}, serving={"VLLM_API_KEY"})
    assert launch.env == {"VLLM_API_KEY": KEY, "APP_SECRET": "s", "PATH": "/bin", "HF_HUB_OFFLINE": "1"}  # offline: no token file is read either
    assert launch.command == "vllm serve m --api-key %s --port 8000" % KEY
    assert launch.withheld == ("--hf-token", "HF_TOKEN", "HF_TOKEN_PATH", "REGISTRY_PASSWORD", "SHELL_GITHUB_TOKEN")
    assert launch.held == ("--api-key", "APP_SECRET", "VLLM_API_KEY")


def test_a_command_without_fetch_credentials_is_left_as_written():
    from sparkrun_coldsnap.secrets import for_capture

    command = "vllm serve m  --port 8000 'quoted arg'"
    assert for_capture(command, {}, given=()).command == command
    assert for_capture(command, {}, given=()).held == ()


@pytest.mark.parametrize(("name", "fetches"), [("HF_TOKEN", True), ("HUGGING_FACE_HUB_TOKEN", True), ("--hf-token", True), ("DOCKER_PASSWORD", True), ("ORAS_PASS", False), ("VLLM_API_KEY", False), ("--api-key", False), ("HF_HOME", False)])
def test_which_credentials_fetch_weights_or_images(name, fetches):
    from sparkrun_coldsnap.secrets import is_fetch_credential

    assert is_fetch_credential(name) is fetches


def test_a_capsule_holding_credentials_is_published_only_when_allowed(tmp_path):
    from helpers import make_capsule

    from sparkrun_coldsnap.capsule import capsule as capsule_mod
    from sparkrun_coldsnap.capsule.reference import parse
    from sparkrun_coldsnap.capsule.transfer import publish
    from sparkrun_coldsnap.errors import RequestError

    store = CapsuleStore(tmp_path / "store")
    plain = make_capsule(store, tmp_path, "keyed")
    assert plain.config.credentials == ()
    capsule_mod.publish(store, [], plain.config.model_copy(update={"credentials": ("--api-key",)}))

    class Unreachable:
        """A registry that must not be reached."""

        def __getattr__(self, name):
            raise AssertionError("the registry was contacted (%s)" % name)

    with pytest.raises(RequestError, match=r"^capsule keyed holds credentials in its memory \(--api-key\): .* pass --allow-secrets$"):
        publish(store, "keyed", parse("127.0.0.1:9/c:keyed", default_tag=None), Unreachable())  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="the registry was contacted"):
        publish(store, "keyed", parse("127.0.0.1:9/c:keyed", default_tag=None), Unreachable(), allow_secrets=True)  # type: ignore[arg-type]


def test_a_running_process_is_named_by_the_credentials_it_was_started_with():
    """What a hibernate records: the names found in the live tree's environment and command line."""
    import subprocess
    import sys

    from sparkrun_coldsnap.host.process_tree import environ_and_argv
    from sparkrun_coldsnap.secrets import held_by

    code = "import time; print('up', flush=True); time.sleep(30)"
    p = subprocess.Popen([sys.executable, "-c", code, "--api-key=%s" % KEY, "--port", "1"], env={"APP_TOKEN": TOKEN, "PLAIN": "1"}, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "up\n"  # exec'd: /proc shows its own environment, not the parent's
        env, argv = environ_and_argv(p.pid)
        assert env.get("PLAIN") == "1" and argv[-2:] == ["--port", "1"]
        assert held_by(env, argv) == ("--api-key", "APP_TOKEN")
    finally:
        p.kill()
        p.wait()
    assert environ_and_argv(p.pid) == ({}, [])
