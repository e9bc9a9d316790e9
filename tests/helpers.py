"""Helpers the tests share (fixtures live in conftest.py, the real registry in registry_fixtures.py).

Capsules built through the real packing and publishing code from synthetic images, for
tests of the store and of registry transfers where what the process images hold does not
matter (the engine tests capture real ones); and the one-line error rule of the verbs.
"""

from __future__ import annotations

import os
from pathlib import Path

from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule.pack import pack_unit
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.documents.capsule_config import CapsuleConfig, CapturedValidation, EngineRecord, NativePayload, WeightsRecord
from sparkrun_coldsnap.documents.fingerprint import Fingerprint, TopologyFacts
from sparkrun_coldsnap.documents.request import Launch, LaunchUnit, ModelRef, Topology, Workload
from sparkrun_coldsnap.documents.unit_image import UnitImage
from sparkrun_coldsnap.weights import model_files

REVISION = "ab" * 20


def make_model(directory: Path, size: int = 3 << 20) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text('{"model_type": "test"}\n')
    (directory / "model.safetensors").write_bytes(os.urandom(size))
    return directory


def synthetic_workload(name: str = "synthetic") -> Workload:
    """A one-unit CPU workload on this host, as a recipe would make it."""
    return Workload(
        recipe=name,
        engine="vllm",
        runtime="vllm-distributed",
        model=ModelRef(id="test/model", revision=REVISION),
        topology=Topology(hosts=("localhost",), units=(LaunchUnit(name="solo", host="localhost"),)),
        launch=Launch(executor="local", command="python -m vllm.entrypoints.openai.api_server", port=8000),
        driver="cpu",
    )


# fmt: off
#: the host a made capsule says it was captured on
FINGERPRINT = Fingerprint(
    cpu_arch="x86_64", cpu_features=(), kernel_release="6.18", criu_version="4.2.1", nvidia_driver=None, cuda_version=None, gpus=(),
    engine="vllm", engine_version="0.32.0", python_version="3.11.7", torch_version="2.13.0", image_digest=None, engine_env_digest=None,
    model_revision=REVISION, topology=TopologyFacts(hosts=1, units=1, tensor_parallel=1, pipeline_parallel=1),
)
# fmt: on


def make_capsule(
    store: CapsuleStore, tmp: Path, name: str = "synthetic", *, tag: str = "latest", pages_mb: int = 6, model_dir: Path | None = None,
    native: NativePayload | None = None, images: Path | None = None,
) -> capsule_mod.Capsule:  # fmt: skip
    """A capsule of one unit whose images are *images*, or (none given) a few synthetic ones of about 2 x *pages_mb*."""
    if images is None:
        images = tmp / ("images-" + name)
        images.mkdir(parents=True, exist_ok=True)
        (images / "core-1.img").write_bytes(os.urandom(4096))
        (images / ("pages-1.img")).write_bytes(os.urandom(pages_mb << 20))  # incompressible: a plain tar layer
        with open(images / "pages-2.img", "wb") as f:  # mostly zeros: a zstd layer
            f.write(os.urandom(8192))
            f.truncate(pages_mb << 20)
    store.init()
    layers = pack_unit(images, "solo", store.new_staging_dir("factory-"))
    files = model_files.record(model_dir) if model_dir else ()
    workload = synthetic_workload(name)
    config = CapsuleConfig(
        name=name,
        tag=tag,
        created=capsule_mod.now_iso(),
        request_sha256="sha256:" + "0" * 64,
        workload=workload,
        fingerprint=FINGERPRINT,
        engine=EngineRecord(name="vllm", version="0.32.0"),
        driver="cpu",
        validation=CapturedValidation(prompt="hi", max_tokens=4, reply="hello"),
        weights=WeightsRecord(location="external" if model_dir else "in-image", model_id="test/model", revision=REVISION, files=files, native=native),
        units=(UnitImage(name="solo", host="localhost", driver="cpu", root_pid=1000, pids=(2**22 + 1000,), pid_namespace=False),),
    )
    capsule_mod.publish(store, layers, config)
    return capsule_mod.open_capsule(store, "%s:%s" % (name, tag))


def one_error_line(returncode: int, output: str) -> str:
    """A failed verb's output holds exactly one ``Error:`` line and no traceback: that line."""
    assert returncode != 0, output
    lines = [l for l in output.strip().splitlines() if l.startswith("Error:")]
    assert len(lines) == 1, output
    assert "Traceback" not in output
    return lines[0]
