"""Strict requests and the coldsnap: block: unknown keys, immutable revisions, digests."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sparkrun_coldsnap.documents.recipe_block import parse_block
from sparkrun_coldsnap.documents.request import CapsuleRef, CaptureRequest, Launch, LaunchUnit, ModelRef, Topology, ValidationSpec, Workload
from sparkrun_coldsnap.errors import RequestError

REV = "973ff5dd93da77ddc2a1bffa8e29d4d207f245dd"


def workload(**launch) -> Workload:
    return Workload(
        recipe="tiny",
        engine="vllm",
        runtime="vllm-distributed",
        model=ModelRef(id="coldsnap/tiny-qwen2", revision=REV),
        topology=Topology(hosts=("localhost",), units=(LaunchUnit(name="solo", host="localhost"),)),
        launch=Launch(executor="local", command="python -m vllm.entrypoints.openai.api_server", port=8000, **launch),
        driver="cpu",
    )


def request(**launch) -> CaptureRequest:
    return CaptureRequest(workload=workload(**launch), validation=ValidationSpec(prompt="hi"), capsule=CapsuleRef(name="tiny"))


def test_digest_is_canonical_and_changes_with_content():
    a = request(env={"A": "1", "B": "2"})
    b = request(env={"B": "2", "A": "1"})
    assert a.digest() == b.digest()
    assert a.digest() != request(env={"A": "1", "B": "3"}).digest()
    assert a.digest().startswith("sha256:") and len(a.digest()) == 71


def test_unknown_keys_are_refused_at_every_level():
    doc = request().model_dump()
    doc["workload"]["launch"]["surprise"] = 1
    with pytest.raises(ValidationError, match="surprise"):
        CaptureRequest.model_validate(doc)


@pytest.mark.parametrize("revision", ["main", "v1.0", "abc123", "g" * 40])
def test_mutable_revisions_are_refused(revision):
    with pytest.raises(ValidationError, match="not immutable"):
        ModelRef(id="x/y", revision=revision)


def test_images_must_be_pinned_by_digest():
    with pytest.raises(ValidationError, match="not pinned by digest"):
        request(image="vllm/vllm-openai:latest")
    pinned = "vllm/vllm-openai@sha256:" + "a" * 64
    assert request(image=pinned).workload.launch.image == pinned


def test_credentials_never_reach_stored_documents_or_the_digest():
    req = request(env={"HF_TOKEN": "hf_secret", "OTHER": "plain"})
    stored = req.workload.redacted().launch.env
    assert stored["OTHER"] == "plain"
    assert stored["HF_TOKEN"].startswith("sha256:") and "hf_secret" not in stored["HF_TOKEN"]
    # The digest is computed on the redacted form: publishing it reveals nothing.
    assert req.digest() == request(env={"HF_TOKEN": "hf_secret", "OTHER": "plain"}).digest()
    assert req.workload.launch.env["HF_TOKEN"] == "hf_secret"  # the launch itself still gets the value


def test_block_unknown_key_names_the_input_and_the_allowed_keys():
    with pytest.raises(RequestError) as e:
        parse_block({"validaton": {}}, source="recipes/x.yaml")
    msg = str(e.value)
    assert msg.startswith("recipes/x.yaml: coldsnap: unknown key 'validaton'")
    assert "validation" in msg and "capsule" in msg and "\n" not in msg


def test_block_nested_unknown_key_and_bad_values():
    with pytest.raises(RequestError, match=r"unknown key 'capsule.repo'.*allowed keys: ca_file, name, plain_http, pull_native, pull_weights, repository, store, tag"):
        parse_block({"capsule": {"repo": "x"}}, source="r.yaml")
    with pytest.raises(RequestError, match="on_missing"):
        parse_block({"on_missing": "sometimes"}, source="r.yaml")
    with pytest.raises(RequestError, match="must be a mapping"):
        parse_block(["not", "a", "mapping"], source="r.yaml")
    with pytest.raises(RequestError, match="capsule name"):
        parse_block({"capsule": {"name": "Upper Case"}}, source="r.yaml")


def test_block_defaults():
    b = parse_block(None)
    assert b.driver == "auto" and b.on_missing == "vanilla" and b.capsule.tag == "latest"


def test_a_capsule_reference_is_one_value_parsed_and_written_in_one_place():
    from sparkrun_coldsnap.documents.capsule_ref import CapsuleRef

    assert CapsuleRef.parse("tiny") == CapsuleRef(name="tiny") == CapsuleRef(name="tiny", tag="latest")
    ref = CapsuleRef.parse("tiny:hibernated-w_1")
    assert (ref.name, ref.tag, ref.ref, str(ref)) == ("tiny", "hibernated-w_1", "tiny:hibernated-w_1", "tiny:hibernated-w_1")
    assert ref.with_tag("v2").ref == "tiny:v2"
    assert request().model_dump()["capsule"] == {"name": "tiny", "tag": "latest"}  # the document's shape


def test_the_recipe_block_and_a_request_refuse_a_capsule_name_with_the_same_rule():
    with pytest.raises(RequestError) as block:
        parse_block({"capsule": {"name": "../../x"}}, source="r.yaml")
    with pytest.raises(ValidationError) as doc:
        CapsuleRef(name="../../x")
    rule = "capsule name '../../x' must be lower-case letters, digits and . _ - separators"
    assert rule in block.value.message and rule in str(doc.value)
    with pytest.raises(ValidationError, match="tag 'a b' must match"):
        CapsuleRef(name="ok").with_tag("a b")
    assert parse_block({"capsule": {"tag": "v1"}}).capsule.ref("recipe-name").ref == "recipe-name:v1"
