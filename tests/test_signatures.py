"""Capsule signatures: made here and checked by the real skopeo against the real registry, made by
skopeo and checked here, and a trust policy that refuses at pull and at restore admission."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from helpers import make_capsule, one_error_line, synthetic_workload
from registry_fixtures import Registry
from skopeo_fixtures import Skopeo

from sparkrun_coldsnap import api
from sparkrun_coldsnap.capsule import signatures, signing_keys
from sparkrun_coldsnap.capsule.reference import parse
from sparkrun_coldsnap.capsule.registry import RegistryClient, Transport
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.capsule.transfer import publish, pull
from sparkrun_coldsnap.cli import coldsnap_group
from sparkrun_coldsnap.controller.restore import open_trusted
from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
from sparkrun_coldsnap.documents.recipe_block import parse_block
from sparkrun_coldsnap.documents.request import CapsuleRef, RestoreRequest, ValidationSpec
from sparkrun_coldsnap.documents.trust import TrustPolicy
from sparkrun_coldsnap.errors import CompatibilityError, RequestError
from sparkrun_coldsnap.integration.strategy import describe_plan, fetch_capsule

PASSPHRASE = b"correct horse"


@pytest.fixture
def keys(tmp_path):
    """Two key pairs in sigstore's encrypted format, and the passphrase file that opens both."""
    pw = tmp_path / "passphrase"
    pw.write_bytes(PASSPHRASE + b"\n")
    mine = signing_keys.write_key_pair(tmp_path / "mine", PASSPHRASE)
    other = signing_keys.write_key_pair(tmp_path / "other", PASSPHRASE)
    return mine, other, pw


@pytest.fixture
def registry(oci_registry, tmp_path):
    r = Registry(tmp_path / "registry").start()
    yield r
    r.stop()


def client_for(reference: str) -> tuple[RegistryClient, object]:
    ref = parse(reference, default_tag=None)
    return RegistryClient(ref, Transport(plain_http=True)), ref


def restore_request(name: str, trust: TrustPolicy | None, *, on_incompatible: str = "fail") -> RestoreRequest:
    return RestoreRequest(
        workload=synthetic_workload(name), validation=ValidationSpec(prompt="hi"), capsule=CapsuleRef(name=name), workload_name="sparkrun_%s_solo" % name,
        on_incompatible=on_incompatible, trust=trust,
    )  # fmt: skip


# -- keys and signatures, in-process ---------------------------------------------------------------


def test_a_generated_key_opens_with_its_passphrase_and_signs_what_its_public_key_verifies(keys):
    (key_path, pub_path), (_, other_pub), _ = keys
    assert key_path.read_text().startswith("-----BEGIN ENCRYPTED SIGSTORE PRIVATE KEY-----") and oct(key_path.stat().st_mode & 0o777) == "0o600"
    sig = signatures.sign(signing_keys.load_private_key(key_path, PASSPHRASE), "registry.test/capsules/tiny:v1", "sha256:" + "a" * 64)
    assert sig.digest == "sha256:" + "a" * 64 and sig.identity == "registry.test/capsules/tiny:v1"
    assert sig.verifies_with(signing_keys.load_public_key(pub_path)) and not sig.verifies_with(signing_keys.load_public_key(other_pub))
    with pytest.raises(RequestError, match="the passphrase does not open the signing key .*mine.key"):
        signing_keys.load_private_key(key_path, b"wrong")
    with pytest.raises(RequestError, match="is encrypted: give its passphrase"):
        signing_keys.load_private_key(key_path, None)


def test_plain_pem_keys_sign_and_other_kinds_are_refused(tmp_path):
    ecdsa = ec.generate_private_key(ec.SECP256R1())
    pem = tmp_path / "ec.pem"
    pem.write_bytes(ecdsa.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    loaded = signing_keys.load_private_key(pem, None)
    assert loaded.public_key().public_numbers() == ecdsa.public_key().public_numbers()
    rsa_pem = tmp_path / "rsa.pem"
    rsa_pem.write_bytes(rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    with pytest.raises(RequestError, match="rsa.pem is a RSAPrivateKey key: capsule signatures use ECDSA keys"):
        signing_keys.load_private_key(rsa_pem, None)
    with pytest.raises(RequestError, match="not a PEM public key"):
        signing_keys.load_public_key(pem)


def test_the_policy_names_the_capsule_and_the_keys_it_wanted(keys):
    (key_path, pub), (other_key, other_pub), _ = keys
    digest = "sha256:" + "b" * 64
    mine = signatures.sign(signing_keys.load_private_key(key_path, PASSPHRASE), "r.test/c/t:v1", digest)
    theirs = signatures.sign(signing_keys.load_private_key(other_key, PASSPHRASE), "r.test/c/t:v1", digest)
    required = TrustPolicy(keys=(str(pub),))
    assert signatures.refusal("tiny:v1", digest, [theirs, mine], required) is None
    unsigned = signatures.refusal("tiny:v1", digest, [], required)
    assert unsigned and unsigned.startswith("capsule tiny:v1 (sha256:bbbbbbbbbbbb) is not signed") and str(pub) in unsigned and "\n" not in unsigned
    wrong = signatures.refusal("tiny:v1", digest, [theirs], required)
    assert wrong and "none is by a trusted key %s" % pub in wrong and "signed by another key" in wrong
    elsewhere = signatures.refusal("tiny:v1", "sha256:" + "c" * 64, [mine], required)
    assert elsewhere and "signed for another manifest (sha256:bbbbbbbbbbbb)" in elsewhere
    assert "signed for another repository (r.test/c/t)" in (signatures.refusal("tiny:v1", digest, [mine], required, repository="r.test/c/other") or "")
    optional = TrustPolicy(keys=(str(pub),), require=False)
    assert signatures.refusal("tiny:v1", digest, [], optional) is None and signatures.refusal("tiny:v1", digest, [theirs], optional)


def test_the_recipe_block_and_the_restore_request_carry_the_policy(keys):
    (_, pub), _, _ = keys
    block = parse_block({"capsule": {"trust": {"keys": [str(pub)], "require": False}}})
    assert block.capsule.trust == TrustPolicy(keys=(str(pub),), require=False)
    with pytest.raises(RequestError, match=r"coldsnap: capsule\.trust\.keys: .*at least 1 item"):
        parse_block({"capsule": {"trust": {"keys": []}}})
    # Without a policy the request document (and its digest) is the one written before the field.
    assert "trust" not in restore_request("tiny", None).model_dump(mode="json")
    assert restore_request("tiny", block.capsule.trust).model_dump(mode="json")["trust"] == {"keys": [str(pub)], "require": False}


# -- restore admission, from the local store ---------------------------------------------------------


def test_restore_admission_refuses_an_unsigned_or_wrongly_signed_capsule_before_anything_is_stopped(keys, tmp_path):
    (key_path, pub), (other_key, _), pw = keys
    store = CapsuleStore(tmp_path / "store").init()
    cap = make_capsule(store, tmp_path, "tiny", pages_mb=1)
    policy = TrustPolicy(keys=(str(pub),))
    with pytest.raises(CompatibilityError) as unsigned:
        api.prepare(restore_request("tiny", policy), store=store)
    assert unsigned.value.code == "admission.untrusted" and "capsule tiny:latest" in unsigned.value.message and str(pub) in unsigned.value.message
    assert unsigned.value.receipt is not None and unsigned.value.receipt.state == "refused"
    # on_incompatible: vanilla starts the engine the ordinary way instead: the capsule is never restored.
    plan = api.prepare(restore_request("tiny", policy, on_incompatible="vanilla"), store=store)
    assert plan.prepared is None and plan.vanilla_because and "is not signed" in plan.vanilla_because

    out = CliRunner().invoke(coldsnap_group, ["sign", "tiny", "--key", str(other_key), "--passphrase-file", str(pw), "--store", str(store.root)], catch_exceptions=False)
    assert out.exit_code == 0 and "signed tiny:latest" in out.output
    with pytest.raises(CompatibilityError, match="carries 1 signature.*none is by a trusted key .*signed by another key"):
        open_trusted(restore_request("tiny", policy), store, ReceiptBuilder("restore", request_sha256="sha256:" + "0" * 64))
    bad = CliRunner().invoke(coldsnap_group, ["verify-signature", "tiny", "--trust-key", str(pub), "--store", str(store.root)])
    assert bad.exit_code == 3 and "none is by a trusted key" in one_error_line(bad.exit_code, bad.output)

    CliRunner().invoke(coldsnap_group, ["sign", "tiny", "--key", str(key_path), "--passphrase-file", str(pw), "--store", str(store.root)], catch_exceptions=False)
    opened = open_trusted(restore_request("tiny", policy), store, ReceiptBuilder("restore", request_sha256="sha256:" + "0" * 64))
    assert opened.digest == cap.digest and len(signatures.local_signatures(store, cap.digest)) == 2
    good = CliRunner().invoke(coldsnap_group, ["verify-signature", "tiny", "--trust-key", str(pub), "--store", str(store.root)], catch_exceptions=False)
    assert good.exit_code == 0 and "is signed by a trusted key" in good.output


# -- against the real registry, checked by the real skopeo ---------------------------------------------


def test_a_capsule_published_signed_here_is_verified_by_skopeo_and_refused_under_another_key(registry, skopeo, keys, tmp_path):
    (key_path, pub), (_, other_pub), pw = keys
    store = CapsuleStore(tmp_path / "store").init()
    make_capsule(store, tmp_path, "tiny", pages_mb=1)
    target = "%s/capsules/tiny:v1" % registry.host
    out = CliRunner().invoke(
        coldsnap_group, ["publish", "tiny", target, "--store", str(store.root), "--plain-http", "--sign", str(key_path), "--passphrase-file", str(pw)], catch_exceptions=False,
    )  # fmt: skip
    assert out.exit_code == 0 and "signed: sha256-" in out.output
    tool = Skopeo(skopeo, registry.host, tmp_path / "skopeo")
    ok = tool.copy_to_dir(target, tmp_path / "copied", public_key=pub)
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / "copied" / "manifest.json").read_text())["artifactType"] == "application/vnd.sparkrun.coldsnap.capsule.v1"
    refused = tool.copy_to_dir(target, tmp_path / "refused", public_key=other_pub)
    assert refused.returncode != 0 and "Source image rejected" in refused.stderr and "signature" in refused.stderr


def test_an_unsigned_capsule_is_refused_by_skopeo_and_by_pull_then_signed_in_place(registry, skopeo, keys, tmp_path):
    (key_path, pub), _, pw = keys
    store, other = CapsuleStore(tmp_path / "store").init(), CapsuleStore(tmp_path / "other").init()
    cap = make_capsule(store, tmp_path, "tiny", pages_mb=1)
    c, ref = client_for("%s/capsules/tiny:v2" % registry.host)
    publish(store, "tiny", ref, c)
    tool = Skopeo(skopeo, registry.host, tmp_path / "skopeo")
    assert tool.copy_to_dir(str(ref), tmp_path / "unsigned", public_key=pub).returncode != 0
    with pytest.raises(CompatibilityError) as err:
        pull(c, ref, other, trust=TrustPolicy(keys=(str(pub),)))
    assert err.value.code == "admission.untrusted" and err.value.message.startswith("pull refused: capsule %s (" % ref) and str(pub) in err.value.message
    assert other.entries() == [] and not list(other.blobs.iterdir())  # refused before anything was fetched
    # A recipe's coldsnap.capsule.trust refuses the pull sparkrun's strategy makes of a missing capsule.
    block = parse_block({"capsule": {"repository": "%s/capsules/tiny" % registry.host, "tag": "v2", "plain_http": True, "trust": {"keys": [str(pub)]}}})
    with pytest.raises(CompatibilityError, match="pull refused: capsule .*is not signed"):
        fetch_capsule(block, CapsuleRef(name="tiny", tag="v2"), other, None)
    assert other.entries() == []
    # Signed where it was published, by the verb: skopeo now takes it, and so does a pull.
    out = CliRunner().invoke(coldsnap_group, ["sign", "tiny", str(ref), "--key", str(key_path), "--passphrase-file", str(pw), "--store", str(store.root), "--plain-http"], catch_exceptions=False)
    assert out.exit_code == 0 and "signed %s (%s): %s/capsules/tiny:sha256-%s.sig" % (ref, cap.digest[:19], registry.host, cap.digest[7:]) in out.output
    assert tool.copy_to_dir(str(ref), tmp_path / "signed", public_key=pub).returncode == 0
    got = pull(c, ref, other, trust=TrustPolicy(keys=(str(pub),)))
    assert got.capsule.digest == cap.digest and len(signatures.local_signatures(other, cap.digest)) == 1
    # The pulled capsule's signature came with it: a restore under the policy admits it.
    req = restore_request("tiny", TrustPolicy(keys=(str(pub),)))
    req = req.model_copy(update={"capsule": CapsuleRef(name="tiny", tag="v2")})
    assert open_trusted(req, other, ReceiptBuilder("restore", request_sha256="sha256:" + "0" * 64)).digest == cap.digest


def test_a_signature_skopeo_makes_is_verified_here_and_the_cli_pull_refuses_another_key(registry, skopeo, keys, tmp_path):
    (key_path, pub), (_, other_pub), pw = keys
    store = CapsuleStore(tmp_path / "store").init()
    cap = make_capsule(store, tmp_path, "tiny", pages_mb=1)
    c, ref = client_for("%s/capsules/tiny:v1" % registry.host)
    publish(store, "tiny", ref, c)
    tool = Skopeo(skopeo, registry.host, tmp_path / "skopeo")
    made = tool.run("generate-sigstore-key", "--output-prefix", str(tmp_path / "skopeo-key"), "--passphrase-file", str(pw))
    assert made.returncode == 0, made.stderr
    skopeo_key, skopeo_pub = tmp_path / "skopeo-key.private", tmp_path / "skopeo-key.pub"
    copied = "%s/capsules/by-skopeo:v1" % registry.host
    signed = tool.copy_signed(str(ref), copied, skopeo_key, pw)
    assert signed.returncode == 0, signed.stderr
    c2, ref2 = client_for(copied)
    [sig] = signatures.remote_signatures(c2, cap.digest)
    assert sig.identity == copied and sig.digest == cap.digest and sig.verifies_with(signing_keys.load_public_key(skopeo_pub))
    got = pull(c2, ref2, CapsuleStore(tmp_path / "pulled").init(), trust=TrustPolicy(keys=(str(skopeo_pub),)))
    assert got.capsule.digest == cap.digest
    bad = CliRunner().invoke(coldsnap_group, ["pull", copied, "--store", str(tmp_path / "refused"), "--plain-http", "--trust-key", str(other_pub)])
    line = one_error_line(bad.exit_code, bad.output)
    assert bad.exit_code == 3 and "pull refused: capsule %s" % copied in line and str(other_pub) in line and "signed by another key" in line
    assert not (tmp_path / "refused" / "index.json").exists() or CapsuleStore(tmp_path / "refused").entries() == []
    # Each reads the other's private keys: skopeo signs with one `keygen` wrote, and this signs with skopeo's.
    again = "%s/capsules/by-skopeo-with-keygen:v1" % registry.host
    assert tool.copy_signed(str(ref), again, key_path, pw).returncode == 0
    c3, _ = client_for(again)
    assert [s.verifies_with(signing_keys.load_public_key(pub)) for s in signatures.remote_signatures(c3, cap.digest)] == [True]
    ours = signatures.sign(signing_keys.load_private_key(skopeo_key, PASSPHRASE), copied, cap.digest)
    assert ours.verifies_with(signing_keys.load_public_key(skopeo_pub))


def test_a_dry_run_names_the_signature_it_would_refuse(criu, keys, tmp_path):
    (_, pub), _, _ = keys
    store = CapsuleStore(tmp_path / "store").init()
    make_capsule(store, tmp_path, "tiny", pages_mb=1)
    view = describe_plan(restore_request("tiny", TrustPolicy(keys=(str(pub),))), store)
    assert "refuse capsule tiny:latest" in view.text and "is not signed, and the trust policy requires a signature by %s" % pub in view.text
    assert isinstance(view.error, CompatibilityError)
