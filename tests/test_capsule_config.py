"""The capsule config records the engine twice (top level and fingerprint): they must agree."""

from __future__ import annotations

import json

import pytest
from helpers import make_capsule

from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule import media
from sparkrun_coldsnap.capsule.store import CapsuleStore, Descriptor
from sparkrun_coldsnap.errors import CompatibilityError, IntegrityError


def republish_with(store: CapsuleStore, cap: capsule_mod.Capsule, **engine) -> None:
    """The same capsule with its config's top-level engine record changed, tagged anew."""
    republish_config(store, cap, "engine", **engine)


def test_a_config_whose_engine_version_differs_from_its_fingerprint_is_refused(tmp_path):
    store = CapsuleStore(tmp_path / "store")
    cap = make_capsule(store, tmp_path, pages_mb=1)
    assert capsule_mod.open_capsule(store, "synthetic:latest").config.engine.version == "0.32.0"
    republish_with(store, cap, version="0.31.0")
    with pytest.raises(IntegrityError) as caught:
        capsule_mod.open_capsule(store, "synthetic:latest")
    assert "engine vllm 0.31.0 disagrees with fingerprint.engine vllm 0.32.0" in caught.value.message


def test_a_config_whose_engine_name_differs_from_its_fingerprint_is_refused(tmp_path):
    store = CapsuleStore(tmp_path / "store")
    cap = make_capsule(store, tmp_path, pages_mb=1)
    republish_with(store, cap, name="sglang")
    with pytest.raises(IntegrityError):
        capsule_mod.open_capsule(store, "synthetic:latest")


def republish_config(store: CapsuleStore, cap: capsule_mod.Capsule, section: str, **fields) -> None:
    """The same capsule with fields of one section of its config changed, tagged anew."""
    doc = cap.config.model_dump(mode="json")
    doc[section].update(fields)
    config_desc = store.put_bytes(json.dumps(doc).encode(), media.CONFIG_MEDIA_TYPE)
    manifest = dict(cap.manifest, config=config_desc.to_json())
    desc = store.put_json(manifest, media.OCI_MANIFEST, artifact_type=media.ARTIFACT_TYPE)
    store.tag(cap.ref or "synthetic:latest", Descriptor(desc.media_type, desc.digest, desc.size, None, desc.artifact_type))


def test_a_config_whose_records_disagree_is_told_in_the_projects_words_not_pydantics(tmp_path):
    store = CapsuleStore(tmp_path / "store")
    cap = make_capsule(store, tmp_path, pages_mb=1)
    republish_with(store, cap, version="0.31.0")
    with pytest.raises(IntegrityError) as caught:
        capsule_mod.open_capsule(store, "synthetic:latest")
    assert "Value error" not in caught.value.message, caught.value.message
    assert caught.value.message.endswith("has an invalid config: engine vllm 0.31.0 disagrees with fingerprint.engine vllm 0.32.0: the config was altered; recapture")


def test_changing_only_the_engine_record_is_a_refusal_as_every_other_one_exit_3(tmp_path):
    store = CapsuleStore(tmp_path / "store")
    cap = make_capsule(store, tmp_path, pages_mb=1)
    republish_with(store, cap, name="sglang", version="0.5.0")
    with pytest.raises(CompatibilityError) as caught:
        capsule_mod.open_capsule(store, "synthetic:latest")
    assert caught.value.exit_code == 3


def test_a_config_whose_weights_revision_differs_from_its_fingerprint_is_refused(tmp_path):
    store = CapsuleStore(tmp_path / "store")
    cap = make_capsule(store, tmp_path, pages_mb=1)
    republish_config(store, cap, "weights", revision="b" * 40)
    with pytest.raises(IntegrityError) as caught:
        capsule_mod.open_capsule(store, "synthetic:latest")
    assert "weights.revision %s disagrees with fingerprint.model_revision %s" % ("b" * 40, cap.config.fingerprint.model_revision) in caught.value.message
    assert caught.value.exit_code == 3
