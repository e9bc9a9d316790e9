"""The SGLang adapter against FAKE SGLang (tests/fakes/fake_sglang.py: SGLang's HTTP API, no model).

SGLang has no CPU build; the real server is exercised on the GPU machine.
Here: the adapter's calls in order (release before capture; resume, reload
from disk, resume after restore) and a recipe with ``runtime: sglang`` going
through `sparkrun coldsnap capture` and `sparkrun run` like the vLLM one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import requests
from conftest import RECIPE, hf_home
from registry_fixtures import free_port

from sparkrun_coldsnap import extensions
from sparkrun_coldsnap.engines.base import Endpoint
from sparkrun_coldsnap.errors import EngineError
from sparkrun_coldsnap.host.process_tree import kill_tree
from sparkrun_coldsnap.launch.local import start_unit

FAKE = Path(__file__).parent / "fakes" / "fake_sglang.py"


def model_dir(tmp_path: Path, payload: bytes = b"weights-v1") -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(payload)
    return d


@pytest.fixture
def fake(tmp_path):
    port = free_port()
    mdir = model_dir(tmp_path)
    adapter = extensions.registry().engine_for_runtime("sglang")
    command, env = adapter.prepare_launch("%s %s --model-path %s --port %d --served-model-name test/model" % (sys.executable, FAKE, mdir, port), {}, release_weights=True)
    unit = start_unit(command, env={"PATH": "/usr/bin:/bin"}, log_path=tmp_path / "fake.log")
    yield adapter, Endpoint("http://127.0.0.1:%d" % port, "test/model"), unit, mdir
    kill_tree(unit.root_pid)


def test_sglang_is_the_adapter_of_sparkrun_sglang_runtime(fake):
    adapter, endpoint, unit, _ = fake
    assert adapter.name == "sglang" and "--enable-memory-saver" in " ".join(unit.launcher.args)
    caps = adapter.capabilities()
    assert caps["weight_paths"] == {"cpu": [], "gpu": ["recovery"]}


def test_release_then_hydrate_in_place(fake):
    adapter, endpoint, unit, mdir = fake
    adapter.wait_ready(endpoint, alive=unit.alive, timeout=30)
    first = adapter.validate(endpoint, prompt="hello", max_tokens=6, timeout=30)
    assert first.text and first.first_token_at is not None
    adapter.release_memory(endpoint)
    r = requests.post(endpoint.base_url + "/v1/chat/completions", json={"model": "x", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 500  # nothing to answer with while released
    h = adapter.hydrate(endpoint, path="recovery", model_dir=str(mdir))
    assert h.path == "recovery" and h.seconds >= 0
    assert adapter.validate(endpoint, prompt="hello", max_tokens=6, timeout=30).text == first.text
    with pytest.raises(EngineError, match="weight path 'native' is not built for SGLang"):
        adapter.hydrate(endpoint, path="native", model_dir=str(mdir))


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


def test_hydrating_from_a_missing_directory_is_a_clear_error(fake, tmp_path):
    adapter, endpoint, unit, mdir = fake
    adapter.wait_ready(endpoint, alive=unit.alive, timeout=30)
    adapter.release_memory(endpoint)
    with pytest.raises(EngineError, match=r"update_weights_from_disk failed: HTTP 400: Failed to get weights iterator"):
        adapter.hydrate(endpoint, path="recovery", model_dir=str(tmp_path / "gone"))


def sglang_recipe(tmp_path: Path, store: Path) -> Path:
    snapshot = next((hf_home() / "hub" / "models--coldsnap--tiny-qwen2" / "snapshots").iterdir())
    text = RECIPE.read_text()
    text = text.replace("runtime: vllm", "runtime: sglang")
    text = text[: text.index("command:")]
    text += "command: %s %s --model-path %s --port {port} --startup-seconds 2\n" % (sys.executable, FAKE, snapshot)
    text += "coldsnap:\n  capsule:\n    name: fake-sglang\n    store: %s\n  validation:\n    prompt: hello\n    max_tokens: 8\n" % store
    path = tmp_path / "fake-sglang.yaml"
    path.write_text(text)
    return path


def test_a_runtime_sglang_recipe_captures_and_restores_like_vllm(sparkrun, tmp_path):
    store = tmp_path / "store"
    recipe = sglang_recipe(tmp_path, store)
    sparkrun.coldsnap("capture", str(recipe), "-H", "localhost", "--receipt", str(tmp_path / "c.json"))
    capture = json.loads((tmp_path / "c.json").read_text())
    assert capture["state"] == "succeeded"
    doc = sparkrun.json("inspect", "fake-sglang", "--store", str(store), "--json")
    assert doc["config"]["engine"]["name"] == "sglang" and doc["config"]["workload"]["runtime"] == "sglang"
    try:
        out = sparkrun("run", str(recipe), "-H", "localhost", "--no-follow")
        assert "restored fake-sglang:latest" in out.stderr + out.stdout
        restore = json.loads(sorted((store / "receipts" / "fake-sglang").glob("*-restore.json"))[-1].read_text())
        assert restore["validation"]["passed"] and restore["validation"]["reply"] == capture["validation"]["reply"]
    finally:
        sparkrun("stop", str(recipe), "-H", "localhost", check=False)
