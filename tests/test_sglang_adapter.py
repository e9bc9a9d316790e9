"""The SGLang adapter against FAKE SGLang (tests/fakes/fake_sglang.py: SGLang's HTTP API, no model).

SGLang has no CPU build; the real server is exercised on the GPU machine. The
fake is as strict as the real one (three processes, a slow /health, released
weights dropped, work on released memory fatal, unknown flags refused) and logs
every call, so these tests check what the adapter asks and in which order; and
a recipe with ``runtime: sglang`` is refused with the cpu driver, which captures
engines running on the CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from conftest import RECIPE, hf_home
from helpers import one_error_line
from registry_fixtures import free_port

from sparkrun_coldsnap import extensions
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.engines.base import Endpoint
from sparkrun_coldsnap.errors import EngineError
from sparkrun_coldsnap.host.process_tree import kill_tree, tree_pids
from sparkrun_coldsnap.launch.local import start_unit

FAKE = Path(__file__).parent / "fakes" / "fake_sglang.py"
RELOAD_SECONDS = 0.3


def model_dir(tmp_path: Path, payload: bytes = b"weights-v1", name: str = "model") -> Path:
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(payload)
    return d


def calls(log: Path, after: int = 0) -> list[tuple[str, str, object]]:
    """The calls the fake logged, in order (from the *after*-th on)."""
    out = []
    for line in log.read_text().splitlines():
        if line.startswith("fake-sglang call: "):
            doc = json.loads(line.split(": ", 1)[1])
            out.append((doc["method"], doc["path"], doc["body"]))
    return out[after:]


@pytest.fixture
def fake(tmp_path):
    port = free_port()
    mdir = model_dir(tmp_path)
    adapter = extensions.registry().engine_for_runtime("sglang")
    command, env = adapter.prepare_launch(
        "%s %s --model-path %s --port %d --served-model-name test/model --fake-startup-seconds 0.5 --fake-reload-seconds %s" % (sys.executable, FAKE, mdir, port, RELOAD_SECONDS),
        {}, release_weights=True,
    )  # fmt: skip
    unit = start_unit(command, env={"PATH": "/usr/bin:/bin"}, log_path=tmp_path / "fake.log")
    yield adapter, Endpoint("http://127.0.0.1:%d" % port, "test/model"), unit, mdir
    kill_tree(unit.root_pid)


def test_sglang_is_the_adapter_of_sparkrun_sglang_runtime(fake):
    adapter, endpoint, unit, _ = fake
    assert adapter.name == "sglang" and "--enable-memory-saver" in " ".join(unit.launcher.args)
    caps = adapter.capabilities()
    assert caps["weight_paths"] == {"cpu": [], "gpu": ["recovery"]}


def test_readiness_waits_out_a_health_check_that_generates_a_token(fake):
    """The real /health answers only after generating a token (seconds on a cold GPU); each
    poll must be given that long, or readiness never comes."""
    adapter, endpoint, unit, _ = fake
    waited = adapter.wait_ready(endpoint, alive=unit.alive, timeout=30)
    assert 2.5 <= waited < 15 and len(tree_pids(unit.root_pid)) >= 3  # server, scheduler, detokenizer


def test_release_then_hydrate_asks_in_the_order_sglang_needs(fake, tmp_path):
    adapter, endpoint, unit, mdir = fake
    log = tmp_path / "fake.log"
    adapter.wait_ready(endpoint, alive=unit.alive, timeout=30)
    first = adapter.validate(endpoint, prompt="hello", max_tokens=6, timeout=30)
    assert first.text and first.first_token_at is not None
    seen = len(calls(log))
    adapter.release_memory(endpoint)
    h = adapter.hydrate(endpoint, path="recovery", model_dir=str(mdir))
    assert h.path == "recovery" and h.seconds >= RELOAD_SECONDS  # the reload is inside the timed hydration
    # Weights back in memory before they are loaded into it; the KV cache only after.
    assert calls(log, seen) == [
        ("POST", "/release_memory_occupation", {"tags": ["weights", "kv_cache"]}),
        ("POST", "/resume_memory_occupation", {"tags": ["weights"]}),
        ("POST", "/update_weights_from_disk", {"model_path": str(mdir)}),
        ("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}),
    ]
    assert adapter.validate(endpoint, prompt="hello", max_tokens=6, timeout=30).text == first.text
    with pytest.raises(EngineError, match="weight path 'native' is not built for SGLang"):
        adapter.hydrate(endpoint, path="native", model_dir=str(mdir))


def test_hydrating_from_other_weights_changes_the_reply(fake, tmp_path):
    """Hydration really loads the files it is given: other bytes, another reply; the same bytes again, the same reply."""
    adapter, endpoint, unit, mdir = fake
    adapter.wait_ready(endpoint, alive=unit.alive, timeout=30)
    first = adapter.validate(endpoint, prompt="hello", max_tokens=8, timeout=30).text
    other = model_dir(tmp_path, b"weights-v2", name="other")
    adapter.release_memory(endpoint)
    adapter.hydrate(endpoint, path="recovery", model_dir=str(other))
    assert adapter.validate(endpoint, prompt="hello", max_tokens=8, timeout=30).text != first
    adapter.release_memory(endpoint)
    adapter.hydrate(endpoint, path="recovery", model_dir=str(mdir))
    assert adapter.validate(endpoint, prompt="hello", max_tokens=8, timeout=30).text == first


def test_resuming_released_weights_without_a_reload_answers_empty_text(fake):
    """As the real server did on the GPU machine: a release drops the weights, a resume gives back
    only the memory; a restore that skipped the reload would serve nothing and fail validation."""
    adapter, endpoint, unit, _ = fake
    adapter.wait_ready(endpoint, alive=unit.alive, timeout=30)
    assert adapter.validate(endpoint, prompt="hello", max_tokens=6, timeout=30).text
    adapter.release_memory(endpoint)
    for tags in (["weights"], ["kv_cache"]):
        requests.post(endpoint.base_url + "/resume_memory_occupation", json={"tags": tags}, timeout=30).raise_for_status()
    with pytest.raises(EngineError, match="answered the validation prompt with an empty reply"):
        adapter.validate(endpoint, prompt="hello", max_tokens=6, timeout=30)


def test_work_on_released_memory_is_fatal_as_in_sglang(fake):
    """Loading weights into memory still released kills the server (the fake, as the real one)."""
    adapter, endpoint, unit, mdir = fake
    adapter.wait_ready(endpoint, alive=unit.alive, timeout=30)
    adapter.release_memory(endpoint)
    with pytest.raises(requests.RequestException):
        requests.post(endpoint.base_url + "/update_weights_from_disk", json={"model_path": str(mdir)}, timeout=30)
    unit.launcher.wait(timeout=10)
    assert not unit.alive()


def test_a_request_while_memory_is_released_kills_the_server_instead_of_answering(fake):
    """The real scheduler does not answer a generation on released memory with a clean error: it
    hits an illegal memory access and the server exits. A client that sent one has lost it."""
    adapter, endpoint, unit, _ = fake
    adapter.wait_ready(endpoint, alive=unit.alive, timeout=30)
    adapter.release_memory(endpoint)
    with pytest.raises(requests.RequestException):
        requests.post(endpoint.base_url + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}, timeout=30)
    unit.launcher.wait(timeout=10)
    assert not unit.alive()


def test_hydrating_from_a_missing_directory_is_a_clear_error(fake, tmp_path):
    adapter, endpoint, unit, mdir = fake
    adapter.wait_ready(endpoint, alive=unit.alive, timeout=30)
    adapter.release_memory(endpoint)
    with pytest.raises(EngineError, match=r"update_weights_from_disk failed: HTTP 400: Failed to get weights iterator"):
        adapter.hydrate(endpoint, path="recovery", model_dir=str(tmp_path / "gone"))


def test_the_fake_refuses_a_flag_sglang_does_not_have(tmp_path):
    cp = subprocess.run([sys.executable, str(FAKE), "--model-path", str(model_dir(tmp_path)), "--no-such-flag"], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 2 and "unrecognized arguments: --no-such-flag" in cp.stderr


def sglang_recipe(tmp_path: Path, store: Path) -> Path:
    snapshot = next((hf_home() / "hub" / "models--coldsnap--tiny-qwen2" / "snapshots").iterdir())
    text = RECIPE.read_text()
    text = text.replace("runtime: vllm", "runtime: sglang")
    text = text[: text.index("command:")]
    text += "command: %s %s --model-path %s --port {port} --fake-startup-seconds 2\n" % (sys.executable, FAKE, snapshot)
    text += "coldsnap:\n  capsule:\n    name: fake-sglang\n    store: %s\n  validation:\n    prompt: hello\n    max_tokens: 8\n" % store
    path = tmp_path / "fake-sglang.yaml"
    path.write_text(text)
    return path


def test_a_runtime_sglang_recipe_is_refused_by_the_cpu_driver(sparkrun, tmp_path):
    """SGLang has no CPU build: neither driver: auto nor driver: cpu captures it on a CPU host."""
    store = tmp_path / "store"
    recipe = sglang_recipe(tmp_path, store)
    auto = sparkrun.coldsnap("capture", str(recipe), "-H", "localhost", check=False)
    line = one_error_line(auto.returncode, auto.stderr + auto.stdout)
    assert "cpu: sglang has no CPU build, and the cpu driver captures engines running on the CPU" in line, line
    recipe.write_text(recipe.read_text().replace("coldsnap:\n", "coldsnap:\n  driver: cpu\n"))
    cpu = sparkrun.coldsnap("capture", str(recipe), "-H", "localhost", check=False)
    assert "sglang has no CPU build" in one_error_line(cpu.returncode, cpu.stderr + cpu.stdout)
    (receipt,) = [json.loads(r.read_text()) for r in (store / "receipts" / "fake-sglang").glob("*-capture.json")]
    assert receipt["state"] == "failed" and "sglang has no CPU build" in receipt["error"]["message"]
    assert CapsuleStore(store).entries() == []  # refused before anything started
