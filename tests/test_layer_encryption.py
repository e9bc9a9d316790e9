"""Encrypted capsule layers (OCI ``+encrypted``, keys wrapped as JWE, as containers' ocicrypt does):
encrypted here and decrypted by the real skopeo, encrypted by skopeo and decrypted here, a wrong
key or a changed layer refused, the plaintext only in a restore's staging and never in the store;
and an encrypted capsule through the real registry: published, pulled as ciphertext, read by
skopeo from the registry with its key, and unpacked by a restore here only with the key."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from helpers import make_capsule, one_error_line, synthetic_workload
from registry_fixtures import Registry
from skopeo_fixtures import Skopeo

from sparkrun_coldsnap.capsule import capsule as capsule_mod
from sparkrun_coldsnap.capsule import capsule_crypto, layer_crypto
from sparkrun_coldsnap.capsule.pack import unpack_layer
from sparkrun_coldsnap.capsule.reference import parse
from sparkrun_coldsnap.capsule.store import CapsuleStore, Descriptor
from sparkrun_coldsnap.capsule.transfer import publish
from sparkrun_coldsnap.cli import coldsnap_group
from sparkrun_coldsnap.digests import canonical_json, sha256_bytes
from sparkrun_coldsnap.documents.request import CapsuleRef, RestoreRequest, ValidationSpec
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.errors import CompatibilityError, IntegrityError, RequestError

LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"


def _write_key(key, directory: Path, name: str, private_format=serialization.PrivateFormat.PKCS8) -> tuple[Path, Path]:
    priv, pub = directory / (name + ".pem"), directory / (name + "pub.pem")
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, private_format, serialization.NoEncryption()))
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv, pub


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Private and public PEM files: RSA (PKCS#1), EC P-256 (PKCS#8), EC P-384 (PKCS#8) and
    P-384 again in SEC1 (what `openssl ecparam -genkey` writes; skopeo does not read it, this does)."""
    d = tmp_path_factory.mktemp("keys")
    p384 = ec.generate_private_key(ec.SECP384R1())
    out = {
        "rsa": _write_key(rsa.generate_private_key(65537, 2048), d, "rsa", serialization.PrivateFormat.TraditionalOpenSSL),
        "ec256": _write_key(ec.generate_private_key(ec.SECP256R1()), d, "ec256"),
        "ec384": _write_key(p384, d, "ec384"),
        "other": _write_key(rsa.generate_private_key(65537, 2048), d, "other"),
    }
    out["ec384-sec1"] = (_write_key(p384, d, "ec384-sec1", serialization.PrivateFormat.TraditionalOpenSSL)[0], out["ec384"][1])
    return out


def skopeo_copy(skopeo: str, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    policy = tmp / "policy.json"
    policy.write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))
    return subprocess.run([skopeo, "--policy", str(policy), "copy", *args], capture_output=True, text=True, timeout=120, check=False)


def layout_manifest(root: Path, ref: str) -> dict:
    """The manifest that *ref* names in the OCI layout at *root*."""
    index = json.loads((root / "index.json").read_text())
    (entry,) = [m for m in index["manifests"] if (m.get("annotations") or {}).get("org.opencontainers.image.ref.name") == ref]
    return json.loads((root / "blobs" / "sha256" / entry["digest"].split(":")[1]).read_bytes())


def blob(root: Path, digest: str) -> Path:
    return root / "blobs" / "sha256" / digest.split(":")[1]


def image_layout(root: Path) -> list[dict]:
    """A plain OCI image (two tar+gzip layers, an image config naming their diff_ids) tagged v1; its layers."""
    (root / "blobs" / "sha256").mkdir(parents=True)
    (root / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    layers, diff_ids = [], []
    for i, size in enumerate((3000, 70000)):
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
            info = tarfile.TarInfo("file-%d" % i)
            data = hashlib.sha256(b"%d" % i).digest() * (size // 32)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        diff_ids.append(sha256_bytes(raw.getvalue()))
        packed = gzip.compress(raw.getvalue(), mtime=0)
        blob(root, sha256_bytes(packed)).write_bytes(packed)
        layers.append({"mediaType": LAYER_GZIP, "digest": sha256_bytes(packed), "size": len(packed)})
    config = canonical_json({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": diff_ids}, "config": {}})
    blob(root, sha256_bytes(config)).write_bytes(config)
    manifest = canonical_json({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha256_bytes(config), "size": len(config)}, "layers": layers,
    })  # fmt: skip
    blob(root, sha256_bytes(manifest)).write_bytes(manifest)
    index = {"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": sha256_bytes(manifest), "size": len(manifest), "annotations": {"org.opencontainers.image.ref.name": "v1"}}]}
    (root / "index.json").write_text(json.dumps(index))
    return layers


def encrypted_capsule(tmp: Path, recipients: list[Path], name: str = "secret") -> tuple[CapsuleStore, list[Descriptor], capsule_mod.Capsule]:
    """A capsule captured in the store, then encrypted there in place: the store, its plaintext layers, the encrypted capsule."""
    store = CapsuleStore(tmp / "store")
    plain = make_capsule(store, tmp, name, pages_mb=2)
    enc = capsule_crypto.encrypt(store, name, [layer_crypto.load_public_key(p) for p in recipients])
    return store, plain.layers, enc


@pytest.mark.parametrize("recipients", [["rsa"], ["ec384"], ["rsa", "ec256"]])
def test_skopeo_decrypts_a_capsule_encrypted_here(tmp_path, keys, skopeo, recipients):
    store, plain, enc = encrypted_capsule(tmp_path, [keys[r][1] for r in recipients])
    assert [d.media_type for d in enc.layers] == [d.media_type + "+encrypted" for d in plain]
    assert enc.manifest["config"] == capsule_mod.open_capsule(store, "secret").manifest["config"]  # the config is the plaintext's
    for r in recipients:
        out = tmp_path / ("out-" + r)
        done = skopeo_copy(skopeo, tmp_path, "--decryption-key", str(keys[r][0]), "oci:%s:secret:latest" % store.root, "oci:%s:plain" % out)
        assert done.returncode == 0, done.stderr
        got = layout_manifest(out, "plain")["layers"]
        assert [(l["mediaType"], l["digest"], l["size"]) for l in got] == [(d.media_type, d.digest, d.size) for d in plain]
        assert not any(k.startswith(layer_crypto.A_ENC_PREFIX) for l in got for k in l.get("annotations", {}))
    refused = skopeo_copy(skopeo, tmp_path, "--decryption-key", str(keys["other"][0]), "oci:%s:secret:latest" % store.root, "oci:%s:plain" % (tmp_path / "wrong"))
    assert refused.returncode != 0 and "no suitable key" in refused.stderr, refused.stderr


@pytest.mark.parametrize("recipients", [["rsa"], ["ec256"], ["rsa", "ec384"]])
def test_layers_skopeo_encrypted_are_decrypted_here(tmp_path, keys, skopeo, recipients):
    """skopeo encrypts only the standard image layer types, so an OCI image carries its layers here."""
    src = tmp_path / "image"
    originals = image_layout(src)
    flags = [a for r in recipients for a in ("--encryption-key", "jwe:%s" % keys[r][1])]
    done = skopeo_copy(skopeo, tmp_path, *flags, "oci:%s:v1" % src, "oci:%s:v1" % (tmp_path / "enc"))
    assert done.returncode == 0, done.stderr
    sealed = [Descriptor.from_json(l) for l in layout_manifest(tmp_path / "enc", "v1")["layers"]]
    assert all(layer_crypto.is_encrypted(d) for d in sealed)
    for r in [*recipients, *(["ec384-sec1"] if "ec384" in recipients else [])]:
        for d, original in zip(sealed, originals, strict=True):
            out = io.BytesIO()
            with open(blob(tmp_path / "enc", d.digest), "rb") as f:
                got = layer_crypto.decrypt_stream(f, d, out, layer_crypto.load_private_keys([keys[r][0]]))
            assert (got.media_type, got.digest, got.size) == (original["mediaType"], original["digest"], original["size"])
            assert sha256_bytes(out.getvalue()) == original["digest"] and got.annotations is None
    with open(blob(tmp_path / "enc", sealed[0].digest), "rb") as f, pytest.raises(RequestError, match=r"^none of the 1 decryption key\(s\) given opens layer sha256:[0-9a-f]{12}: give the private key of a recipient"):
        layer_crypto.decrypt_stream(f, sealed[0], io.BytesIO(), layer_crypto.load_private_keys([keys["other"][0]]))


def test_a_restore_decrypts_only_into_staging_and_the_store_keeps_ciphertext(tmp_path, keys):
    store, plain, enc = encrypted_capsule(tmp_path, [keys["ec256"][1]])
    images = tmp_path / "images-secret"
    marker = (images / "pages-1.img").read_bytes()[:4096]  # random: found only where the plaintext is
    on_disk = {p.name for p in store.blobs.iterdir()}
    assert not {d.digest.split(":")[1] for d in plain} & on_disk  # the plaintext layers left the store
    assert {d.digest.split(":")[1] for d in enc.layers} <= on_disk
    assert not any(marker in p.read_bytes() for p in store.root.rglob("*") if p.is_file())
    staging = tmp_path / "staging"
    keyset = layer_crypto.load_private_keys([keys["ec256"][0]])
    for d in enc.layers:
        unpack_layer(store, d, staging / "units", keys=keyset)
    for f in images.iterdir():
        assert (staging / "units" / "solo" / f.name).read_bytes() == f.read_bytes()
    # Admission: the keys are checked before anything is stopped.
    assert capsule_crypto.key_problems(enc, (keys["ec256"][0],)) == []
    (missing,) = capsule_crypto.key_problems(enc, ())
    assert missing == "capsule secret:latest has 2 encrypted layer(s) and no decryption key was given: set COLDSNAP_DECRYPTION_KEY=PRIVATE.pem"
    (wrong,) = capsule_crypto.key_problems(enc, (keys["rsa"][0],))
    assert wrong.startswith("none of the 1 decryption key(s) given opens layer sha256:")


def test_a_restore_takes_its_keys_from_coldsnap_decryption_key(tmp_path, keys):
    """The restore story's unpacking (controller/restore_here.py) with the keys the setting names."""
    from sparkrun_coldsnap.controller.restore_here import unpack_capsule
    from sparkrun_coldsnap.documents import settings as settings_mod
    from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
    from sparkrun_coldsnap.progress import QUIET

    store, _, enc = encrypted_capsule(tmp_path, [keys["rsa"][1], keys["ec384"][1]])
    env = {"COLDSNAP_HOME": str(tmp_path / "home")}
    with settings_mod.using(Settings.from_environ(env)), pytest.raises(RequestError, match="no decryption key was given: set COLDSNAP_DECRYPTION_KEY=PRIVATE.pem$"):
        unpack_capsule(store, enc, tmp_path / "none", ReceiptBuilder("restore"), QUIET)
    with settings_mod.using(Settings.from_environ({**env, "COLDSNAP_DECRYPTION_KEY": "%s:%s" % (keys["other"][0], keys["ec384-sec1"][0])})):
        unpack_capsule(store, enc, tmp_path / "staged", ReceiptBuilder("restore"), QUIET)
    for f in (tmp_path / "images-secret").iterdir():
        assert (tmp_path / "staged" / "units" / "solo" / f.name).read_bytes() == f.read_bytes()


def test_a_wrong_key_a_missing_key_or_a_changed_layer_is_refused(tmp_path, keys):
    store, _, enc = encrypted_capsule(tmp_path, [keys["rsa"][1]])
    d = enc.layers[0]
    right = layer_crypto.load_private_keys([keys["rsa"][0]])
    with pytest.raises(RequestError, match=r"^layer sha256:[0-9a-f]{12} is encrypted and no decryption key was given: set COLDSNAP_DECRYPTION_KEY=PRIVATE.pem$"):
        unpack_layer(store, d, tmp_path / "a")
    with pytest.raises(RequestError, match=r"^none of the 1 decryption key\(s\) given opens layer sha256:[0-9a-f]{12}: "):
        unpack_layer(store, d, tmp_path / "b", keys=layer_crypto.load_private_keys([keys["other"][0]]))
    # One ciphertext byte changed, stored under the digest that now matches it: only the HMAC notices.
    data = bytearray(store.blob_path(d.digest).read_bytes())
    data[len(data) // 2] ^= 1
    changed = store.put_bytes(bytes(data), d.media_type, annotations=d.annotations)
    with pytest.raises(IntegrityError, match=r"^encrypted layer sha256:[0-9a-f]{12} failed its HMAC check .*: discard it and re-pull or re-encrypt the capsule$"):
        unpack_layer(store, changed, tmp_path / "c", keys=right)
    # The HMAC annotation changed instead.
    pub = json.loads(layer_crypto.base64.b64decode(d.annotations[layer_crypto.A_PUBOPTS]))
    pub["hmac"] = layer_crypto.base64.b64encode(b"\0" * 32).decode()
    forged = Descriptor(d.media_type, d.digest, d.size, {**d.annotations, layer_crypto.A_PUBOPTS: layer_crypto.base64.b64encode(json.dumps(pub).encode()).decode()})
    with pytest.raises(IntegrityError, match="failed its HMAC check"):
        unpack_layer(store, forged, tmp_path / "d", keys=right)
    # Keys wrapped twice, joined by a comma (as ocicrypt adds recipients): the part for the key given opens it.
    other_part = layer_crypto.base64.b64encode(layer_crypto.jwe.encrypt(b"{}", [layer_crypto.load_public_key(keys["other"][1])])).decode()
    joined = Descriptor(d.media_type, d.digest, d.size, {**d.annotations, layer_crypto.A_KEYS_JWE: other_part + "," + d.annotations[layer_crypto.A_KEYS_JWE]})
    assert unpack_layer(store, joined, tmp_path / "f", keys=right) > 0
    # The wrapped key changed: no key opens it.
    jwe_doc = json.loads(layer_crypto.base64.b64decode(d.annotations[layer_crypto.A_KEYS_JWE]))
    jwe_doc["ciphertext"] = jwe_doc["ciphertext"][::-1]
    broken = Descriptor(d.media_type, d.digest, d.size, {**d.annotations, layer_crypto.A_KEYS_JWE: layer_crypto.base64.b64encode(json.dumps(jwe_doc).encode()).decode()})
    with pytest.raises(RequestError, match="none of the 1 decryption key"):
        unpack_layer(store, broken, tmp_path / "e", keys=right)


def test_an_encrypted_capsule_holding_credentials_publishes_without_allow_secrets(tmp_path, keys):
    store = CapsuleStore(tmp_path / "store")
    plain = make_capsule(store, tmp_path, "keyed", pages_mb=1)
    config = plain.config.model_copy(update={"credentials": ("--api-key",)})
    config_bytes = canonical_json(config.model_dump(mode="json"))
    config_desc = Descriptor(plain.manifest["config"]["mediaType"], sha256_bytes(config_bytes), len(config_bytes))
    manifest = canonical_json(capsule_mod.build_manifest(config_desc, plain.layers, config))
    store.commit("keyed:latest", Descriptor(plain.descriptor.media_type, sha256_bytes(manifest), len(manifest), artifact_type=plain.descriptor.artifact_type), files=[], documents=[config_bytes, manifest])

    class Unreachable:
        """A registry that must not be reached."""

        def __getattr__(self, name):
            raise AssertionError("the registry was contacted (%s)" % name)

    target = parse("127.0.0.1:9/c:keyed", default_tag=None)
    with pytest.raises(RequestError, match=r"holds credentials in its memory \(--api-key\): .* encrypt it, or pass --allow-secrets$"):
        publish(store, "keyed", target, Unreachable())  # type: ignore[arg-type]
    capsule_crypto.encrypt(store, "keyed", [layer_crypto.load_public_key(keys["rsa"][1])])
    assert capsule_mod.open_capsule(store, "keyed").config.credentials == ("--api-key",)
    with pytest.raises(AssertionError, match="the registry was contacted"):
        publish(store, "keyed", target, Unreachable())  # type: ignore[arg-type]


def test_the_encrypt_verb(tmp_path, keys):
    store = CapsuleStore(tmp_path / "store")
    plain = make_capsule(store, tmp_path, "verb", pages_mb=1)
    runner = CliRunner()
    done = runner.invoke(coldsnap_group, ["encrypt", "verb", "--recipient", str(keys["ec384"][1]), "--as", "verb:sealed", "--store", str(store.root), "--json"])
    assert done.exit_code == 0, done.output
    out = json.loads(done.output)
    assert out["ref"] == "verb:sealed" and all(l["mediaType"].endswith("+encrypted") for l in out["layers"])
    assert capsule_mod.open_capsule(store, "verb").digest == plain.digest  # --as keeps the plaintext capsule
    shown = runner.invoke(coldsnap_group, ["inspect", "verb:sealed", "--store", str(store.root)]).output
    assert "credentials in memory: none; every layer encrypted" in shown and "tar+zstd+encrypted" in shown, shown
    assert "every layer encrypted" not in runner.invoke(coldsnap_group, ["inspect", "verb", "--store", str(store.root)]).output
    line = one_error_line(*_invoke(runner, ["encrypt", "verb", "--recipient", str(keys["rsa"][0]), "--store", str(store.root)]))
    assert line == "Error: recipient key %s is not a PEM public key: it is a private key: give its public half (openssl pkey -in KEY -pubout)" % keys["rsa"][0]
    line = one_error_line(*_invoke(runner, ["encrypt", "verb:sealed", "--recipient", str(keys["rsa"][1]), "--store", str(store.root)]))
    assert line == "Error: capsule verb:sealed has all its layers encrypted already: nothing to do"
    assert not [p for p in store.staging.glob("*") if "encrypt-" in p.name]  # nothing left half-written


def _invoke(runner: CliRunner, args: list[str]) -> tuple[int, str]:
    done = runner.invoke(coldsnap_group, args)
    return done.exit_code, done.output


def test_private_keys_in_every_pem_form_and_a_protected_one_refused(tmp_path, keys):
    for name in ("rsa", "ec256", "ec384", "ec384-sec1"):
        layer_crypto.load_private_key(keys[name][0])
    key = rsa.generate_private_key(65537, 2048)
    locked = tmp_path / "locked.pem"
    locked.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")))
    with pytest.raises(RequestError, match=r"^decryption key .*locked.pem is protected by a passphrase: write an unprotected copy"):
        layer_crypto.load_private_key(locked)
    with pytest.raises(RequestError, match=r"^recipient key .*nowhere.pem cannot be read \(No such file or directory\)"):
        layer_crypto.load_public_key(tmp_path / "nowhere.pem")
    assert Settings.from_environ({"COLDSNAP_DECRYPTION_KEY": "/a.pem:/b.pem"}).decryption_keys == (Path("/a.pem"), Path("/b.pem"))


# -- through the real registry ------------------------------------------------------------------------


@pytest.fixture
def registry(oci_registry, tmp_path):
    r = Registry(tmp_path / "registry").start()
    yield r
    r.stop()


def _files_holding(root: Path, marker: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and marker in p.read_bytes()]


def test_an_encrypted_capsule_goes_through_the_registry_as_ciphertext_and_opens_only_with_its_key(registry, skopeo, criu, keys, tmp_path):
    from sparkrun_coldsnap.controller.restore_here import new_restore_staging, unpack_capsule, unpacked_size
    from sparkrun_coldsnap.documents import settings as settings_mod
    from sparkrun_coldsnap.documents.receipts import ReceiptBuilder
    from sparkrun_coldsnap.host import paths
    from sparkrun_coldsnap.integration.strategy import describe_plan
    from sparkrun_coldsnap.progress import QUIET

    store = CapsuleStore(tmp_path / "store")
    plain = make_capsule(store, tmp_path, "secret", pages_mb=2)
    images = tmp_path / "images-secret"
    marker = (images / "pages-1.img").read_bytes()[:4096]  # random: found only where the plaintext is
    runner = CliRunner()
    sealed_as = runner.invoke(coldsnap_group, ["encrypt", "secret", "--recipient", str(keys["rsa"][1]), "--recipient", str(keys["ec256"][1]), "--store", str(store.root)])
    assert sealed_as.exit_code == 0, sealed_as.output
    sealed = capsule_mod.open_capsule(store, "secret")
    target = "%s/capsules/secret:v1" % registry.host
    published = runner.invoke(coldsnap_group, ["publish", "secret", target, "--store", str(store.root), "--plain-http"])
    assert published.exit_code == 0, published.output
    assert all(registry.blob_file(d.digest).is_file() for d in sealed.layers) and not any(registry.blob_file(d.digest).exists() for d in plain.layers)
    assert _files_holding(registry.storage, marker) == []  # the registry holds ciphertext only

    # Pulled into a fresh store: the same manifest, ciphertext kept as it arrived.
    fresh = CapsuleStore(tmp_path / "pulled")
    pulled = runner.invoke(coldsnap_group, ["pull", target, "--store", str(fresh.root), "--plain-http"])
    assert pulled.exit_code == 0, pulled.output
    cap = capsule_mod.open_capsule(fresh, "secret:v1")
    assert cap.digest == sealed.digest and [d.to_json() for d in cap.layers] == [d.to_json() for d in sealed.layers]
    assert all(layer_crypto.is_encrypted(d) for d in cap.layers) and _files_holding(fresh.root, marker) == []
    verified = runner.invoke(coldsnap_group, ["verify", "secret:v1", "--store", str(fresh.root)])  # the ciphertext's digests, without a key
    assert verified.exit_code == 0 and "manifest, config and 2 layers verified" in verified.output, verified.output
    shown = runner.invoke(coldsnap_group, ["inspect", "secret:v1", "--store", str(fresh.root)]).output
    assert "credentials in memory: none; every layer encrypted" in shown, shown

    # skopeo reads it from the registry with either recipient's key and gets the capsule's own layers back.
    tool = Skopeo(skopeo, registry.host, tmp_path / "skopeo")
    for r in ("rsa", "ec256"):
        out = tmp_path / ("skopeo-" + r)
        done = tool.run("copy", "--src-tls-verify=false", "--decryption-key", str(keys[r][0]), "docker://" + target, "oci:%s:plain" % out)
        assert done.returncode == 0, done.stderr
        got = layout_manifest(out, "plain")["layers"]
        assert [(l["mediaType"], l["digest"], l["size"]) for l in got] == [(d.media_type, d.digest, d.size) for d in plain.layers]
        assert [sha256_bytes(blob(out, l["digest"]).read_bytes()) for l in got] == [d.digest for d in plain.layers]
    kept = tool.run("copy", "--src-tls-verify=false", "docker://" + target, "dir:%s" % (tmp_path / "as-is"))
    assert kept.returncode == 0, kept.stderr
    assert [l["mediaType"] for l in json.loads((tmp_path / "as-is" / "manifest.json").read_text())["layers"]] == [d.media_type for d in sealed.layers]
    refused = tool.run("copy", "--src-tls-verify=false", "--decryption-key", str(keys["other"][0]), "docker://" + target, "oci:%s:plain" % (tmp_path / "wrong"))
    assert refused.returncode != 0 and "no suitable key" in refused.stderr, refused.stderr

    # A restore here: without the key, refused at admission and at unpacking, in one line naming the variable.
    req = RestoreRequest(
        workload=synthetic_workload("secret"), validation=ValidationSpec(prompt="hi"), capsule=CapsuleRef(name="secret", tag="v1"), workload_name="sparkrun_secret_solo",
        on_missing="fail", on_incompatible="fail",
    )  # fmt: skip
    missing = "capsule secret:v1 has 2 encrypted layer(s) and no decryption key was given: set COLDSNAP_DECRYPTION_KEY=PRIVATE.pem"
    home = {"COLDSNAP_HOME": str(tmp_path / "home")}
    with settings_mod.using(Settings.from_environ(home)):
        view = describe_plan(req, fresh)
        assert "refuse capsule secret:v1" in view.text and missing in view.text and isinstance(view.error, CompatibilityError)
        staging = new_restore_staging(fresh, unpacked_size(cap))
        try:
            with pytest.raises(RequestError) as err:
                unpack_capsule(fresh, cap, staging, ReceiptBuilder("restore"), QUIET)
        finally:
            paths.remove_staging(staging)
    assert "\n" not in err.value.message and err.value.message.endswith("no decryption key was given: set COLDSNAP_DECRYPTION_KEY=PRIVATE.pem")
    path = tmp_path / "request.json"
    path.write_text(json.dumps(req.model_copy(update={"request_sha256": req.digest()}).model_dump(mode="json")))
    done = runner.invoke(coldsnap_group, ["restore", "--request", str(path), "--store", str(fresh.root)], env={**home, "COLDSNAP_DECRYPTION_KEY": ""})
    line = one_error_line(done.exit_code, done.output)
    assert done.exit_code == 3 and line.startswith("Error: admission refused for capsule secret:v1: ") and missing in line, line
    # With the key: admission opens every layer, and the restore's staging gets the images back, byte for byte.
    with settings_mod.using(Settings.from_environ({**home, "COLDSNAP_DECRYPTION_KEY": str(keys["ec256"][0])})):
        assert missing not in describe_plan(req, fresh).text
        staging = new_restore_staging(fresh, unpacked_size(cap))
        try:
            unpack_capsule(fresh, cap, staging, ReceiptBuilder("restore"), QUIET)
            for f in images.iterdir():
                assert (staging / "units" / "solo" / f.name).read_bytes() == f.read_bytes()
        finally:
            paths.remove_staging(staging)
    assert not staging.exists() and _files_holding(fresh.root, marker) == []
