"""A template capture's engine caches (capsule/engine_caches.py): pointed at a directory of the
capsule's, packed as a layer of their own, put back by a restore's unpacking, and refused by
admission when damaged or not placeable here. The template itself is in test_criu_driver.py."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

import pytest
from helpers import make_capsule

from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule import engine_caches, media
from sparkrun_coldsnap.capsule.pack import pack_unit
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.controller.restore_here import unpack_capsule, unpacked_size
from sparkrun_coldsnap.documents import settings as settings_mod
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
from sparkrun_coldsnap.engines.vllm import VllmAdapter
from sparkrun_coldsnap.errors import RestoreError
from sparkrun_coldsnap.progress import QUIET

REQUEST = "sha256:" + "5e" * 32


@pytest.fixture
def cache_root(tmp_path):
    root = tmp_path / "engine-caches"
    with settings_mod.using(settings_mod.current().replace(engine_cache_root=root)):
        yield root


def compiled(pointed: engine_caches.Pointed) -> dict[str, bytes]:
    """What an engine's compile leaves in two of the caches (a torch.compile artifact, a Triton kernel)."""
    out = {
        "vllm/torch_compile_cache/abc123/rank_0_0/model.py": b"graph = 1\n" * 100,
        "triton/QX7/kernel.cubin": os.urandom(4096),
    }
    for rel, data in out.items():
        (pointed.directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (pointed.directory / rel).write_bytes(data)
    return out


def test_the_launch_points_each_cache_the_recipe_left_unset_into_the_requests_directory(cache_root):
    where = engine_caches.directory(REQUEST)
    assert where == cache_root / ("request-" + "5e" * 16)
    env, pointed = engine_caches.point({"PATH": "/usr/bin", "TRITON_CACHE_DIR": "/recipe/triton"}, VllmAdapter.compile_caches, where)
    assert env["VLLM_CACHE_ROOT"] == str(where / "vllm") and env["TORCHINDUCTOR_CACHE_DIR"] == str(where / "torchinductor")
    assert env["FLASHINFER_WORKSPACE_BASE"] == str(where / "flashinfer")
    assert env["TRITON_CACHE_DIR"] == "/recipe/triton" and pointed.kept == ("TRITON_CACHE_DIR",)  # the recipe's own: kept, not carried
    assert "TRITON_CACHE_DIR" not in pointed.carried and all((where / name).is_dir() for name in pointed.carried.values())


def test_an_unwritable_root_is_one_line_naming_the_setting(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(Exception, match="COLDSNAP_ENGINE_CACHE_ROOT"):
        engine_caches.point({}, VllmAdapter.compile_caches, blocker / "request-x")


def test_nothing_compiled_is_no_layer(cache_root, tmp_path):
    _, pointed = engine_caches.point({}, VllmAdapter.compile_caches, engine_caches.directory(REQUEST))
    assert engine_caches.pack(pointed, tmp_path) is None


def cached_capsule(tmp_path: Path, store: CapsuleStore) -> tuple[capsule_mod.Capsule, dict[str, bytes]]:
    """A capsule whose config records engine caches and whose manifest carries their layer."""
    _, pointed = engine_caches.point({}, VllmAdapter.compile_caches, engine_caches.directory(REQUEST))
    files = compiled(pointed)
    base = make_capsule(store, tmp_path, name="plain")
    staging = store.new_staging_dir("test-")
    packed = engine_caches.pack(pointed, staging)
    assert packed is not None
    layer, record = packed
    images = tmp_path / "images"
    images.mkdir()
    (images / "core-1.img").write_bytes(os.urandom(4096))
    layers = [*pack_unit(images, "solo", staging), layer]
    config = base.config.model_copy(update={"name": "cached", "request_sha256": REQUEST, "driver": "n580", "engine_caches": record})
    capsule_mod.publish(store, layers, config)
    return capsule_mod.open_capsule(store, "cached:latest"), files


def test_the_caches_travel_as_a_layer_and_come_back_to_the_same_path_on_an_empty_node(cache_root, tmp_path):
    store = CapsuleStore(tmp_path / "store")
    cap, files = cached_capsule(tmp_path, store)
    record = cap.config.engine_caches
    assert record is not None and record.files == 2 and record.bytes == sum(len(d) for d in files.values())
    assert {c.name: c.files for c in record.caches if c.files} == {"vllm": 1, "triton": 1}
    (desc,) = [d for d in cap.layers if engine_caches.is_cache_layer(d)]
    assert desc.media_type in media.ENGINE_CACHE_TYPES and desc.annotations[media.A_ENGINE_CACHES] == "vllm,triton"
    with tarfile.open(store.blob_path(desc.digest)) as tar:  # the bytes are in the capsule itself
        assert {m.name for m in tar.getmembers() if m.isfile()} == {"engine-caches/" + rel for rel in files}
    assert engine_caches.problems(store, cap.config.request_sha256, record, cap.layers) == []
    assert unpacked_size(cap) < sum(int(d.annotations[media.A_UNPACKED_SIZE]) for d in cap.layers)  # not staged with the images

    shutil.rmtree(cache_root)  # a node whose caches are empty
    rb = ReceiptBuilder("restore")
    staging = tmp_path / "staging"
    unpack_capsule(store, cap, staging, rb, QUIET)
    where = engine_caches.directory(REQUEST)
    assert {rel: (where / rel).read_bytes() for rel in files} == files
    assert not (staging / "units" / "engine-caches").exists() and (staging / "units" / "solo" / "core-1.img").is_file()
    assert rb.details["engine_caches"]["files_written"] == 2
    assert [p.name for p in cache_root.iterdir()] == [where.name]  # no unpacking folder left beside it

    # An identical cache already there is left alone; a changed file is replaced whole.
    kept = where / "triton/QX7/kernel.cubin"
    inode = kept.stat().st_ino
    (where / "vllm/torch_compile_cache/abc123/rank_0_0/model.py").write_bytes(b"stale")
    done = engine_caches.install(store, REQUEST, record, cap.layers)
    assert (done["files_kept"], done["files_written"]) == (1, 1) and kept.stat().st_ino == inode
    assert (where / "vllm/torch_compile_cache/abc123/rank_0_0/model.py").read_bytes() == files["vllm/torch_compile_cache/abc123/rank_0_0/model.py"]


def test_admission_refuses_a_damaged_cache_layer_and_a_root_the_engine_does_not_read(cache_root, tmp_path):
    store = CapsuleStore(tmp_path / "store")
    cap, _ = cached_capsule(tmp_path, store)
    record = cap.config.engine_caches
    assert record is not None
    with settings_mod.using(settings_mod.current().replace(engine_cache_root=tmp_path / "elsewhere")):
        (why,) = engine_caches.problems(store, REQUEST, record, cap.layers)
        assert "COLDSNAP_ENGINE_CACHE_ROOT=%s" % cache_root in why
        with pytest.raises(RestoreError, match="COLDSNAP_ENGINE_CACHE_ROOT"):
            engine_caches.install(store, REQUEST, record, cap.layers)
    (desc,) = [d for d in cap.layers if engine_caches.is_cache_layer(d)]
    blob = store.blob_path(desc.digest)
    os.chmod(blob, 0o644)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    (why,) = engine_caches.problems(store, REQUEST, record, cap.layers)
    assert "engine cache layer" in why and "damaged" in why
    others = [d for d in cap.layers if not engine_caches.is_cache_layer(d)]
    assert "does not hold" in engine_caches.problems(store, REQUEST, record, others)[0]
    assert "does not describe" in engine_caches.problems(store, REQUEST, None, cap.layers)[0]


def test_a_capsule_without_caches_is_written_as_before(tmp_path):
    cap = make_capsule(CapsuleStore(tmp_path / "store"), tmp_path)
    assert cap.config.engine_caches is None
    assert "engine_caches" not in json.loads(json.dumps(cap.config.model_dump(mode="json")))


def test_an_encrypted_capsule_puts_its_caches_back_with_the_key(cache_root, tmp_path):
    """Encrypting keeps the config, whose record names the plaintext layer: the encrypted one is
    known by its type, admitted, and decrypted into the directory with the key the setting names."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from sparkrun_coldsnap.capsule import capsule_crypto, layer_crypto

    key = ec.generate_private_key(ec.SECP256R1())
    private, public = tmp_path / "key.pem", tmp_path / "key.pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    store = CapsuleStore(tmp_path / "store")
    plain, files = cached_capsule(tmp_path, store)
    enc = capsule_crypto.encrypt(store, "cached:latest", [layer_crypto.load_public_key(public)])
    (desc,) = [d for d in enc.layers if engine_caches.is_cache_layer(d)]
    assert layer_crypto.is_encrypted(desc) and enc.config.engine_caches == plain.config.engine_caches
    assert engine_caches.problems(store, REQUEST, enc.config.engine_caches, enc.layers) == []
    shutil.rmtree(cache_root)
    with settings_mod.using(settings_mod.current().replace(decryption_keys=(private,))):
        unpack_capsule(store, enc, tmp_path / "staging", ReceiptBuilder("restore"), QUIET)
    where = engine_caches.directory(REQUEST)
    assert {rel: (where / rel).read_bytes() for rel in files} == files


def test_an_n580_capture_carries_what_its_engine_compiled_and_a_restore_on_an_empty_node_finds_it(criu, tmp_path):
    """The whole story through the API, real CRIU, the FAKE SGLang server as the engine (it
    compiles FAKE kernels into its Inductor and Triton caches after the template's boundary) on a
    FAKE GPU host: the capture's engine compiles (miss); the caches' root is emptied, as on a
    node that never ran the engine; the restored template finds every kernel (hit); a damaged
    cache layer is refused at admission."""
    import requests
    from conftest import hf_home
    from gpu_fixtures import engine_env, fake_gpu_host
    from registry_fixtures import free_port

    from sparkrun_coldsnap import api
    from sparkrun_coldsnap.documents.request import CapsuleRef, CaptureRequest, Launch, LaunchUnit, ModelRef, RestoreRequest, Topology, ValidationSpec, Workload
    from sparkrun_coldsnap.documents.settings import Settings
    from sparkrun_coldsnap.errors import CompatibilityError
    from sparkrun_coldsnap.host.process_tree import kill_tree

    snap = next((hf_home() / "hub" / "models--coldsnap--tiny-qwen2" / "snapshots").iterdir())
    port, root = free_port(), tmp_path / "engine-caches"
    v, name = ValidationSpec(prompt="hello", max_tokens=8), CapsuleRef(name="template-caches")
    with fake_gpu_host(tmp_path / "fake-cuda"):
        env = engine_env()
        env["PYTHONPATH"] = "%s:%s" % (env["PYTHONPATH"], Path(__file__).parent / "fakes")
        command = "%s -m fake_sglang --model-path %s --port %d --fake-compile-cache" % (sys.executable, snap, port)
        w = Workload(
            recipe="template-caches", engine="sglang", runtime="sglang", model=ModelRef(id="coldsnap/tiny-qwen2", revision=snap.name, path=str(snap)),
            topology=Topology(hosts=("localhost",), units=(LaunchUnit(name="solo", host="localhost"),)),
            launch=Launch(executor="local", command=command, port=port, env=env), driver="n580",
        )  # fmt: skip
        # The FAKE engine imports no torch: the template's boundary comes after what it does import.
        settings = Settings.from_environ({**os.environ, "COLDSNAP_ENGINE_CACHE_ROOT": str(root), "COLDSNAP_TEMPLATE_PRELOAD": "json,http.server"})
        with settings_mod.using(settings):
            store = CapsuleStore(tmp_path / "store")
            out = api.capture(CaptureRequest(workload=w, validation=v, capsule=name, ready_timeout_seconds=60), store=store)
            assert out.capsule is not None and out.receipt.state == "succeeded"
            record = out.capsule.config.engine_caches
            assert record is not None and Path(record.directory) == engine_caches.directory(out.capsule.config.request_sha256)
            assert {c.name: c.files for c in record.caches if c.files} == {"torchinductor": 1, "triton": 1}
            assert out.receipt.details["engine_caches"]["layer"] == record.layer and "pack_engine_caches" in {p.name for p in out.receipt.phases}
            assert any(d.digest == record.layer for d in out.capsule.layers)
            shutil.rmtree(root)  # a node whose caches are empty
            req = RestoreRequest(workload=w, validation=v, capsule=name, on_missing="fail", on_incompatible="fail", workload_name="coldsnap-template-caches")
            done = api.restore(req, store=store)
            try:
                assert requests.get("http://127.0.0.1:%d/fake/compile_cache" % port, timeout=10).json() == {"TORCHINDUCTOR_CACHE_DIR": "hit", "TRITON_CACHE_DIR": "hit"}
                assert done.how == "restored" and done.outcome.receipt.details["engine_caches"]["files_written"] == 2
            finally:
                kill_tree(done.outcome.root_pid, grace=2.0)
            blob = store.blob_path(record.layer)
            blob.chmod(0o644)
            data = bytearray(blob.read_bytes())
            data[len(data) // 2] ^= 0xFF
            blob.write_bytes(bytes(data))
            with pytest.raises(CompatibilityError, match="engine cache layer .* is damaged"):
                api.restore(req, store=store)
