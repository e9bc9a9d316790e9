"""A capsule is bound to the weights it was captured with: the engine is started on exactly
the pinned revision, the files it used belong to that snapshot, and a snapshot whose files
changed since capture is refused, naming the file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import REVISION, make_model, synthetic_workload

from sparkrun_coldsnap import api
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.compat import pinning
from sparkrun_coldsnap.compat.admission import admission
from sparkrun_coldsnap.documents.capsule_config import CapsuleConfig, CapturedValidation, EngineRecord, WeightsRecord
from sparkrun_coldsnap.documents.fingerprint import Fingerprint, TopologyFacts
from sparkrun_coldsnap.documents.request import CapsuleRef, CaptureRequest, RestoreRequest, ValidationSpec
from sparkrun_coldsnap.documents.unit_image import UnitImage
from sparkrun_coldsnap.drivers.cpu import CpuDriver
from sparkrun_coldsnap.engines.vllm import VllmAdapter
from sparkrun_coldsnap.errors import RequestError
from sparkrun_coldsnap.weights import model_files

ROOT = Path(__file__).resolve().parent.parent
OTHER = "cd" * 20


def hf_cache(tmp_path: Path) -> tuple[Path, Path]:
    """A model cache holding the pinned snapshot and another one that refs/main names."""
    repo = tmp_path / "hub" / "models--test--model"
    pinned = make_model(repo / "snapshots" / REVISION, size=1 << 16)
    other = make_model(repo / "snapshots" / OTHER, size=1 << 16)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(OTHER)
    return pinned, other


def workload(command: str, model_dir: Path | None):
    w = synthetic_workload()
    return w.model_copy(update={"launch": w.launch.model_copy(update={"command": command}), "model": w.model.model_copy(update={"path": str(model_dir) if model_dir else None})})


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_sparkrun_finds_no_unpinned_revision_in_our_recipes(recipe):
    from sparkrun.core.bootstrap import get_runtime
    from sparkrun.core.recipe import Recipe
    from sparkrun.core.validation import check_unpinned_model_revision

    r = Recipe.load(str(recipe))
    assert [i.code for i in check_unpinned_model_revision(r, get_runtime(r.runtime))] == []


def test_a_command_without_the_pinned_revision_is_named_with_the_fix(tmp_path):
    pinned, other = hf_cache(tmp_path)
    adapter = VllmAdapter()
    base = "python -m vllm.entrypoints.openai.api_server --model test/model --port 8000"
    assert "add `--revision {model_revision}`" in (pinning.launch_problem(workload(base, pinned), adapter) or "")
    wrong = pinning.launch_problem(workload(base + " --revision " + OTHER, pinned), adapter) or ""
    assert OTHER in wrong and REVISION in wrong
    assert pinning.launch_problem(workload(base + " --revision " + REVISION, pinned), adapter) is None
    # A directory named outright must be the pinned snapshot's own.
    by_dir = "python -m vllm.entrypoints.openai.api_server --model %s --port 8000"
    assert pinning.launch_problem(workload(by_dir % pinned, pinned), adapter) is None
    assert str(other) in (pinning.launch_problem(workload(by_dir % other, pinned), adapter) or "")


def test_capture_refuses_an_unpinned_command_before_starting_anything(criu, tmp_path):
    pinned, _ = hf_cache(tmp_path)
    req = CaptureRequest(
        workload=workload("python -m vllm.entrypoints.openai.api_server --model test/model --port 8000", pinned),
        validation=ValidationSpec(prompt="hi"),
        capsule=CapsuleRef(name="pin"),
        ready_timeout_seconds=5,
    )
    store = CapsuleStore(tmp_path / "store")
    with pytest.raises(RequestError) as caught:
        api.capture(req, store=store)
    assert "--revision {model_revision}" in caught.value.message
    assert caught.value.exit_code == 2
    receipt = caught.value.receipt
    assert receipt is not None and receipt.state == "failed" and [p.name for p in receipt.phases] == ["admission"]
    assert not (store.root / "blobs").exists() or not any((store.root / "blobs").rglob("*"))


def test_files_the_engine_used_from_another_snapshot_are_named(tmp_path):
    pinned, other = hf_cache(tmp_path)
    blob_of_other = os.path.realpath(other / "model.safetensors")
    opened = [str(pinned / "model.safetensors"), blob_of_other, "/usr/lib/x86_64-linux-gnu/libc.so.6"]
    assert pinning.foreign_model_files(opened, pinned) == [blob_of_other]
    assert pinning.foreign_model_files(opened[:1] + opened[2:], pinned) == []


def in_image_config(pinned: Path) -> CapsuleConfig:
    w = workload("python -m vllm.entrypoints.openai.api_server --model test/model --revision %s --port 8000" % REVISION, None)
    return CapsuleConfig(
        name="pin", tag="latest", created="2026-12-01T00:00:00+00:00", request_sha256="sha256:" + "0" * 64, workload=w,
        fingerprint=Fingerprint(
            cpu_arch="x86_64", cpu_features=(), kernel_release="6.18", criu_version="4.2.1", nvidia_driver=None, cuda_version=None, gpus=(),
            engine="vllm", engine_version="0.32.0", python_version="3.11.7", torch_version="2.13.0", image_digest=None, engine_env_digest=None,
            model_revision=REVISION, topology=TopologyFacts(hosts=1, units=1, tensor_parallel=1, pipeline_parallel=1),
        ),
        engine=EngineRecord(name="vllm", version="0.32.0"), driver="cpu", validation=CapturedValidation(prompt="hi", max_tokens=4, reply="hello"),
        weights=WeightsRecord(location="in-image", model_id="test/model", revision=REVISION, files=model_files.record(pinned)),
        units=(UnitImage(name="solo", host="localhost", driver="cpu", root_pid=1000, pids=(2**22 + 1000,), pid_namespace=False),),
    )  # fmt: skip


def test_a_restore_refuses_a_pinned_snapshot_whose_files_changed_since_capture(tmp_path):
    pinned, _ = hf_cache(tmp_path)
    cfg = in_image_config(pinned)
    req = RestoreRequest(
        workload=cfg.workload.model_copy(update={"model": cfg.workload.model.model_copy(update={"path": str(pinned)})}),
        validation=ValidationSpec(prompt="hi"), capsule=CapsuleRef(name="pin"), workload_name="w",
    )  # fmt: skip
    problems, _ = admission(cfg, req, cfg.fingerprint, CpuDriver(), VllmAdapter())
    assert problems == []
    (pinned / "model.safetensors").write_bytes(os.urandom(1 << 16))  # other weights under the pinned name
    problems, _ = admission(cfg, req, cfg.fingerprint, CpuDriver(), VllmAdapter())
    assert len(problems) == 1 and str(pinned / "model.safetensors") in problems[0]


def test_a_vanilla_start_of_a_command_capture_would_refuse_says_so(tmp_path):
    from sparkrun_coldsnap import controller

    pinned, _ = hf_cache(tmp_path)
    base = "python -m vllm.entrypoints.openai.api_server --model test/model --port 8000"
    said = controller.unpinned_vanilla(workload(base, pinned)) or ""
    assert said.startswith("started as the recipe says, though a capture refuses it: the serve command does not pass model_revision"), said
    assert "refs/main" in said and "add `--revision {model_revision}`" in said
    assert controller.unpinned_vanilla(workload(base + " --revision " + REVISION, pinned)) is None
