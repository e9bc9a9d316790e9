"""The native weight payload against the real CPU vLLM engine.

vLLM has no sleep mode on the CPU, so restores there keep weights in the image; the
payload's engine side (a vLLM worker extension called through ``/collective_rpc``) is
the same code on both platforms, so it is exercised here for real: the engine writes
its loaded tensors, the plugin seals them under their digest, and reading a payload
back really replaces the weights the engine serves with.
"""

from __future__ import annotations

import shutil
import threading
import time

import pytest
from conftest import hf_home, require_engine
from registry_fixtures import free_port

from sparkrun_coldsnap import extensions
from sparkrun_coldsnap.documents.capsule_config import ModelFile, NativePayload
from sparkrun_coldsnap.engines.base import Endpoint
from sparkrun_coldsnap.errors import EngineError
from sparkrun_coldsnap.host.process_tree import kill_tree
from sparkrun_coldsnap.launch.engine_env import EngineEnv
from sparkrun_coldsnap.launch.local import start_unit
from sparkrun_coldsnap.weights import native_payload, weight_paths, weights_memory

PROMPT = "Reply with one short sentence: what is a cold start?"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    require_engine()
    tmp = tmp_path_factory.mktemp("native")
    model = next((hf_home() / "hub").glob("models--coldsnap--tiny-qwen2/snapshots/*"))
    port = free_port()
    adapter = extensions.registry().engine("vllm")
    base = "python -m vllm.entrypoints.openai.api_server --model %s --served-model-name tiny --port %d --max-model-len 512 --dtype bfloat16" % (model, port)
    command, env = adapter.prepare_launch(base, {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "HOME": str(tmp)}, release_weights=False, native_weights=True)
    unit = start_unit(command, env=EngineEnv.named("vllm-cpu").apply(env), log_path=tmp / "engine.log")
    endpoint = Endpoint("http://127.0.0.1:%d" % port, "tiny")
    try:
        adapter.wait_ready(endpoint, alive=unit.alive, timeout=600)
        yield adapter, endpoint, tmp
    finally:
        kill_tree(unit.root_pid)


def reply(adapter, endpoint) -> str:
    return adapter.validate(endpoint, prompt=PROMPT, max_tokens=16, timeout=120).text


def test_launch_mixes_the_extension_into_vllm_workers():
    adapter = extensions.registry().engine("vllm")
    command, env = adapter.prepare_launch("vllm serve m", {"PYTHONPATH": "/engine/site"}, release_weights=True, native_weights=True)
    assert "--enable-sleep-mode" in command and "--worker-extension-cls coldsnap_worker.ColdsnapWorker" in command
    assert env["PYTHONPATH"].endswith(":/engine/site") and env["VLLM_SERVER_DEV_MODE"] == "1"
    # A recipe's own extension is kept; the native path is then unavailable, not forced.
    command, _ = adapter.prepare_launch("vllm serve m --worker-extension-cls my.Ext", {}, release_weights=True, native_weights=True)
    assert command.count("--worker-extension-cls") == 1


@pytest.mark.engine
def test_export_seal_and_read_back_replace_the_served_weights(engine, use_settings, tmp_path):
    adapter, endpoint, _ = engine
    use_settings(home=tmp_path / "home")
    before = reply(adapter, endpoint)

    record, reports = native_payload.export(adapter, endpoint)
    d = native_payload.directory(record)
    assert sorted(f.name for f in record.files) == ["rank-0.bin", "rank-0.json"]
    assert reports[0]["bytes"] == next(f.size for f in record.files if f.name == "rank-0.bin") > 500_000
    assert native_payload.problems(record) == [] and not list(native_payload.root().glob(".staging-*"))

    # Reading back a payload whose bytes differ changes what the engine says...
    damaged = tmp_path / "damaged"
    shutil.copytree(d, damaged)
    with open(damaged / "rank-0.bin", "r+b") as f:
        f.write(bytes(256 << 10))  # zero the start of the embedding table
    adapter._rpc(endpoint, "coldsnap_load_native", str(damaged))
    assert reply(adapter, endpoint) != before
    # ...and the sealed payload brings the captured weights back, byte for byte.
    loaded = adapter._rpc(endpoint, "coldsnap_load_native", str(d))
    assert loaded[0]["bytes"] == reports[0]["bytes"]
    assert reply(adapter, endpoint) == before
    # Read into the page cache by preparation: buffered reads copy it from memory.
    adapter._rpc(endpoint, "coldsnap_load_native", str(damaged))
    cached = adapter._rpc(endpoint, "coldsnap_load_native", str(d), True)
    assert cached[0]["direct_io"] is False and cached[0]["bytes"] == reports[0]["bytes"]
    assert reply(adapter, endpoint) == before

    # Copied into memory by preparation, the payload is mapped by the engine and read in place;
    # the copy of the damaged one changes the reply just the same.
    for source, same in ((damaged, False), (d, True)):
        staged = weights_memory.copy_into_memory(sorted(source.iterdir()))
        try:
            # as hydration calls it, with the registration's settings (no GPU here: nothing to register)
            mapped = adapter._load_native(endpoint, str(source), False, str(staged.directory))
        finally:
            staged.release()
        assert mapped[0]["mapped"] is True and mapped[0]["bytes"] == reports[0]["bytes"] and mapped[0]["pieces"] == 0, mapped
        assert mapped[0]["kept"] is False  # nothing registered on the CPU: nothing kept for later
        assert (reply(adapter, endpoint) == before) is same
    assert adapter._rpc(endpoint, "coldsnap_release_mapped")[0]["released_bytes"] == 0

    # Followed while the copy into memory is still under way (a node with nothing prepared):
    # the engine copies each tensor once the copy's marks say its bytes are in place.
    adapter._rpc(endpoint, "coldsnap_load_native", str(damaged))
    assert reply(adapter, endpoint) != before
    hydration: dict = {}

    def hydrate_behind(staged) -> None:
        def run() -> None:
            hydration["out"] = adapter._load_native(endpoint, str(d), False, str(staged.directory), lambda: True)

        hydration["thread"] = threading.Thread(target=run)
        hydration["thread"].start()
        time.sleep(0.5)  # nothing is filled yet: the engine waits

    staged = weights_memory.copy_into_memory(sorted(d.iterdir()), on_ready=hydrate_behind)
    try:
        hydration["thread"].join(120)
    finally:
        staged.release()
    (followed,) = hydration["out"]
    assert followed["followed"] is True and followed["fill_wait_seconds"] > 0.3 and followed["bytes"] == reports[0]["bytes"], followed
    assert reply(adapter, endpoint) == before

    # The same bytes seal to the same address; a damaged payload is refused by digest.
    again, _ = native_payload.export(adapter, endpoint)
    assert again == record
    with open(d / "rank-0.bin", "r+b") as f:
        f.seek(123)
        f.write(b"\x01")
    (problem,) = native_payload.problems(record)
    assert record.digest[:19] in problem and "does not match" in problem


@pytest.mark.engine
def test_the_same_extension_detaches_and_attaches_communicators_in_the_real_worker(engine):
    """One rank on the CPU holds no NCCL communicator: the extension's walk over vLLM's groups
    and torch's process groups runs for real and finds none to rebuild; attach before detach
    makes nothing, detach twice is refused, and the engine serves on."""
    adapter, endpoint, _ = engine
    before = reply(adapter, endpoint)
    assert [d["attached"] for d in adapter.attach_communicators(endpoint)] == [[]]
    detached = adapter.detach_communicators(endpoint)
    assert [(d["rank"], d["detached"]) for d in detached] == [(0, [])]
    assert [d["attached"] for d in adapter.attach_communicators(endpoint)] == [[]]
    adapter.detach_communicators(endpoint)
    with pytest.raises(EngineError, match="already detached"):
        adapter.detach_communicators(endpoint)
    adapter.attach_communicators(endpoint)
    assert reply(adapter, endpoint) == before


@pytest.mark.engine
def test_a_payload_of_another_model_is_refused_by_the_engine(engine, tmp_path):
    adapter, endpoint, _ = engine
    (tmp_path / "rank-0.json").write_text('{"format": 1, "rank": 0, "bytes": 4, "tensors": [{"name": "x", "offset": 0, "nbytes": 4}]}')
    (tmp_path / "rank-0.bin").write_bytes(bytes(4))
    with pytest.raises(EngineError, match="does not fit this model"):
        adapter._rpc(endpoint, "coldsnap_load_native", str(tmp_path))


def test_auto_falls_back_to_recovery_and_says_why(use_settings, tmp_path):
    from sparkrun_coldsnap.documents.capsule_config import WeightsRecord

    use_settings(home=tmp_path)
    adapter = extensions.registry().engine("vllm")
    gone = NativePayload(digest="sha256:" + "ab" * 32, files=(ModelFile(name="rank-0.bin", size=1, sha256="sha256:00"),))

    class Cfg:
        weights = WeightsRecord(location="external", model_id="m", revision="r", files=(), native=gone)
        units = ()

    auto = weight_paths.choose(Cfg, "auto", adapter)
    assert (auto.path, auto.problem) == ("recovery", None) and "not on this host" in auto.note
    native = weight_paths.choose(Cfg, "native", adapter)
    assert native.problem.startswith("weights: native: native weight payload sha256:abababab") and "weights: auto or recovery" in native.problem
    assert weight_paths.choose(Cfg, "recovery", adapter).path == "recovery"
    assert "not a weight path" in weight_paths.choose(Cfg, "in-image", adapter).problem


def test_inspect_says_whether_the_native_payload_is_here(use_settings, tmp_path):
    from click.testing import CliRunner
    from helpers import make_capsule, make_model

    from sparkrun_coldsnap.capsule.store import CapsuleStore
    from sparkrun_coldsnap.cli.store_verbs import inspect

    use_settings(home=tmp_path / "home")
    staged = tmp_path / "home" / "native" / ".staging-test"
    staged.mkdir(parents=True)
    (staged / "rank-0.bin").write_bytes(bytes(3000))
    (staged / "rank-0.json").write_text("{}")
    record = native_payload.seal(staged)
    store = CapsuleStore(tmp_path / "store")
    make_capsule(store, tmp_path, "withnative", model_dir=make_model(tmp_path / "model"), native=record)
    out = CliRunner().invoke(inspect, ["withnative", "--store", str(store.root)])
    assert out.exit_code == 0 and "native weights: %s" % record.digest[:19] in out.output
    assert "on this host, in %s" % native_payload.directory(record) in out.output
    shutil.rmtree(native_payload.directory(record))
    out = CliRunner().invoke(inspect, ["withnative", "--store", str(store.root)])
    assert "not on this host (restores take recovery)" in out.output


def test_the_mapping_is_let_go_after_validation_and_a_failure_there_is_recorded_not_raised():
    from types import SimpleNamespace

    from sparkrun_coldsnap.controller.restore_here import after_hydration
    from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
    from sparkrun_coldsnap.engines.base import HydrationResult
    from sparkrun_coldsnap.engines.vllm import VllmAdapter

    calls: list[str] = []

    class Vllm(VllmAdapter):
        def _rpc(self, endpoint, method, *args):
            calls.append(method)
            raise EngineError("vLLM %s failed: HTTP 500" % method)

    endpoint = Endpoint("http://127.0.0.1:1", "m")
    released: list[bool] = []
    choice = SimpleNamespace(release_memory=lambda: released.append(True))
    # Nothing kept (a reader that could not keep it, or SGLang): no call, the copy in memory still goes.
    rb = ReceiptBuilder("restore", request_sha256="0" * 64)
    after_hydration(SimpleNamespace(adapter=Vllm()), endpoint, HydrationResult("native", 1.0, ({"kept": False},)), choice, rb)  # type: ignore[arg-type]
    assert calls == [] and released == [True] and "hydrate_release_error" not in rb.details
    # Kept: the workers are asked to let go; their failure is recorded and the restore stands.
    after_hydration(SimpleNamespace(adapter=Vllm()), endpoint, HydrationResult("native", 1.0, ({"kept": True},)), choice, rb)  # type: ignore[arg-type]
    assert calls == ["coldsnap_release_mapped"] and released == [True, True]
    assert rb.details["hydrate_release_error"] == "vLLM coldsnap_release_mapped failed: HTTP 500"
    assert [p.name for p in rb.phases] == ["hydrate.release", "hydrate.release"]
