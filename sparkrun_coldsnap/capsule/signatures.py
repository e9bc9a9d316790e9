"""Capsule signatures in sigstore's "simple signing" format: what cosign and skopeo write and check.

A signature signs a small JSON payload that names the image and the digest of its manifest::

    {"critical": {"identity": {"docker-reference": "REGISTRY/REPO:TAG"},
                  "image": {"docker-manifest-digest": "sha256:..."},
                  "type": "cosign container image signature"},
     "optional": {"creator": "...", "timestamp": ...}}

with ECDSA over its SHA-256, DER-encoded and base64'd. In a registry the signatures of
manifest ``sha256:<hex>`` are the layers of one OCI manifest tagged ``sha256-<hex>.sig``
in the same repository: each layer is a payload (media type
``application/vnd.dev.cosign.simplesigning.v1+json``) carrying its signature in the
annotation ``dev.cosignproject.cosign/signature``. skopeo reads them with
``use-sigstore-attachments`` and checks them with a ``sigstoreSigned`` policy; skopeo's
``--sign-by-sigstore-private-key`` writes the same.

The local store keeps a capsule's signatures beside the layout, in
``signatures/<hex>.json`` (``{"signatures": [{"payload": b64, "signature": b64}]}``):
a pull keeps those it found, ``sign`` adds its own. A signature file needs no protection
of its own: it is bound to the manifest digest, and one that does not verify is refused.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from sparkrun_coldsnap import __version__
from sparkrun_coldsnap.capsule import media
from sparkrun_coldsnap.capsule.capsule import Capsule
from sparkrun_coldsnap.capsule.reference import Reference
from sparkrun_coldsnap.capsule.registry import RegistryClient
from sparkrun_coldsnap.capsule.signing_keys import PublicKey, load_public_key
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.digests import canonical_json, hex_of, sha256_bytes, short
from sparkrun_coldsnap.documents.trust import TrustPolicy
from sparkrun_coldsnap.errors import IntegrityError, NotFoundError, RequestError, StoreError
from sparkrun_coldsnap.host.atomic import write_bytes

SIMPLE_SIGNING = "application/vnd.dev.cosign.simplesigning.v1+json"
A_SIGNATURE = "dev.cosignproject.cosign/signature"
SIGNATURE_TYPE = "cosign container image signature"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"


@dataclass(frozen=True)
class Signature:
    payload: bytes
    signature: bytes  # DER ECDSA

    @property
    def critical(self) -> dict[str, Any]:
        try:
            doc = json.loads(self.payload)
            critical = doc["critical"]
            if critical["type"] != SIGNATURE_TYPE:
                raise ValueError(critical["type"])
            critical["image"]["docker-manifest-digest"], critical["identity"]["docker-reference"]  # noqa: B018 - both must be there
            return critical
        except (ValueError, KeyError, TypeError) as err:
            raise IntegrityError("a signature's payload is not a simple-signing payload (%s)" % err) from err

    @property
    def digest(self) -> str:
        return str(self.critical["image"]["docker-manifest-digest"])

    @property
    def identity(self) -> str:
        return str(self.critical["identity"]["docker-reference"])

    def verifies_with(self, key: PublicKey) -> bool:
        try:
            key.key.verify(self.signature, self.payload, ec.ECDSA(hashes.SHA256()))
            return True
        except InvalidSignature:
            return False

    def to_json(self) -> dict[str, str]:
        return {"payload": base64.b64encode(self.payload).decode(), "signature": base64.b64encode(self.signature).decode()}


def sign(key: ec.EllipticCurvePrivateKey, identity: str, digest: str) -> Signature:
    """A signature of manifest *digest* as the image *identity* (``REGISTRY/REPO:TAG``, or a local name)."""
    payload = canonical_json(
        {
            "critical": {"identity": {"docker-reference": identity}, "image": {"docker-manifest-digest": digest}, "type": SIGNATURE_TYPE},
            "optional": {"creator": "sparkrun-coldsnap %s" % __version__, "timestamp": int(time.time())},
        }
    )
    return Signature(payload, key.sign(payload, ec.ECDSA(hashes.SHA256())))


def repository_of(identity: str) -> str:
    """``REGISTRY/REPO`` of a docker reference, without its tag or digest."""
    name = identity.split("@", 1)[0]
    head, sep, tail = name.rpartition(":")
    return head if sep and "/" not in tail else name


# -- in a registry ------------------------------------------------------------------------------


def signature_tag(digest: str) -> str:
    return "sha256-%s.sig" % hex_of(digest)


def _signature_manifest(client: RegistryClient, digest: str) -> dict[str, Any] | None:
    try:
        data, _, _ = client.get_manifest(signature_tag(digest), accept=(media.OCI_MANIFEST, "application/vnd.docker.distribution.manifest.v2+json"))
    except NotFoundError:
        return None
    try:
        doc = json.loads(data)
        if not isinstance(doc.get("layers"), list):
            raise ValueError("no layers")
        return doc
    except ValueError as err:
        raise IntegrityError("the signatures of %s in %s are not an OCI manifest (%s)" % (short(digest), client.ref.registry, err)) from err


def remote_signatures(client: RegistryClient, digest: str) -> list[Signature]:
    """The simple-signing signatures attached to manifest *digest* in the client's repository."""
    doc = _signature_manifest(client, digest)
    out: list[Signature] = []
    for layer in (doc or {}).get("layers") or []:
        sig = (layer.get("annotations") or {}).get(A_SIGNATURE)
        if layer.get("mediaType") != SIMPLE_SIGNING or not sig or int(layer.get("size", 0)) > 1 << 20:
            continue
        data = _blob(client, layer["digest"])
        if sha256_bytes(data) != layer["digest"]:
            raise IntegrityError("a signature payload of %s in %s does not match its digest" % (short(digest), client.ref.registry))
        out.append(Signature(data, base64.b64decode(sig)))
    return out


def _blob(client: RegistryClient, digest: str) -> bytes:
    return client.request("GET", "%s/blobs/%s" % (client.base, digest), ok=(200,), what="signature payload %s" % short(digest)).content


def published_digest(client: RegistryClient, ref: Reference, cap: Capsule) -> str:
    """The digest of the manifest at *ref*, which must be capsule *cap* as published (its manifest,
    or that manifest with the weights artifact as its subject: the same config)."""
    data, _, digest = client.get_manifest(ref.reference)
    try:
        config = json.loads(data).get("config") or {}
    except ValueError:
        config = {}
    if digest != cap.digest and config.get("digest") != cap.manifest["config"]["digest"]:
        raise RequestError("%s holds another capsule (%s) than %s (%s): publish it there first, or name where it was published" % (ref, short(digest), cap.ref or short(cap.digest), short(cap.digest)))
    return digest


def _push_small_blob(client: RegistryClient, data: bytes) -> None:
    """A blob of a few hundred bytes in one request (the monolithic upload of the distribution spec)."""
    digest = sha256_bytes(data)
    if client.blob_exists(digest):
        return
    r = client.request("POST", "%s/blobs/uploads/" % client.base, ok=(202,), what="start of a signature upload", headers={"Content-Length": "0"})
    location = urljoin(client.base + "/", r.headers["Location"])
    sep = "&" if "?" in location else "?"
    client.request("PUT", "%s%sdigest=%s" % (location, sep, digest), ok=(201,), what="upload of a signature", data=data, headers={"Content-Type": "application/octet-stream"})


def push_signature(client: RegistryClient, digest: str, sig: Signature) -> str:
    """Attach *sig* to manifest *digest* in the client's repository, beside any already there; the tag."""
    doc = _signature_manifest(client, digest) or {"schemaVersion": 2, "mediaType": media.OCI_MANIFEST, "layers": []}
    layer = {"mediaType": SIMPLE_SIGNING, "digest": sha256_bytes(sig.payload), "size": len(sig.payload), "annotations": {A_SIGNATURE: base64.b64encode(sig.signature).decode()}}
    layers = [l for l in doc["layers"] if l != layer] + [layer]
    config = canonical_json({"architecture": "", "config": {}, "os": "", "rootfs": {"type": "layers", "diff_ids": [l["digest"] for l in layers]}})
    for data in (sig.payload, config):
        _push_small_blob(client, data)
    manifest = {"schemaVersion": 2, "mediaType": media.OCI_MANIFEST, "config": {"mediaType": OCI_CONFIG, "digest": sha256_bytes(config), "size": len(config)}, "layers": layers}
    tag = signature_tag(digest)
    client.put_manifest(canonical_json(manifest), media.OCI_MANIFEST, tag)
    return tag


# -- in the local store -------------------------------------------------------------------------


def _local_path(store: CapsuleStore, digest: str) -> Path:
    return store.root / "signatures" / ("%s.json" % hex_of(digest))


def local_signatures(store: CapsuleStore, digest: str) -> list[Signature]:
    path = _local_path(store, digest)
    try:
        doc = json.loads(path.read_text())
        return [Signature(base64.b64decode(s["payload"]), base64.b64decode(s["signature"])) for s in doc["signatures"]]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise StoreError("the signatures of %s in %s are unreadable (%s): remove the file and sign or pull again" % (short(digest), path, err)) from err


def keep(store: CapsuleStore, digest: str, sigs: list[Signature]) -> None:
    """Add *sigs* to those the store keeps for manifest *digest* (each once)."""
    if not sigs:
        return
    with store.locked():
        have = local_signatures(store, digest)
        merged = have + [s for s in sigs if s not in have]
        if merged != have:
            write_bytes(_local_path(store, digest), (json.dumps({"signatures": [s.to_json() for s in merged]}, indent=1) + "\n").encode(), mode=0o640)


# -- a trust policy -----------------------------------------------------------------------------


def trusted_keys(policy: TrustPolicy) -> list[PublicKey]:
    return [load_public_key(p) for p in policy.keys]


def refusal_in_store(store: CapsuleStore, capsule: str, digest: str, policy: TrustPolicy) -> str | None:
    """Why *policy* refuses capsule *capsule* (manifest *digest*) with the signatures *store* keeps; None: it admits it."""
    return refusal(capsule, digest, local_signatures(store, digest), policy)


def refusal(capsule: str, digest: str, sigs: list[Signature], policy: TrustPolicy, *, repository: str | None = None) -> str | None:
    """Why *policy* refuses capsule *capsule* (manifest *digest*) with signatures *sigs*; None: it admits it.

    A signature counts when a trusted key verifies it, it names *digest*, and (for a capsule
    from a registry) it names *repository*, as skopeo's ``matchRepository`` identity does."""
    keys = trusted_keys(policy)
    named = ", ".join(str(k) for k in keys)
    why: list[str] = []
    for sig in sigs:
        signer = next((k for k in keys if sig.verifies_with(k)), None)
        if signer is None:
            why.append("signed by another key")
        elif sig.digest != digest:
            why.append("signed for another manifest (%s)" % short(sig.digest))
        elif repository is not None and repository_of(sig.identity) != repository:
            why.append("signed for another repository (%s)" % repository_of(sig.identity))
        else:
            return None
    if not sigs:
        if not policy.require:
            return None
        return "capsule %s (%s) is not signed, and the trust policy requires a signature by %s: sign it with `sparkrun coldsnap sign` and that key, or pull it from where it was published signed" % (capsule, short(digest), named)
    return "capsule %s (%s) carries %d signature(s) and none is by a trusted key %s (%s): sign it with one of them, or trust the key that signed it" % (
        capsule, short(digest), len(sigs), named, "; ".join(sorted(set(why))),
    )  # fmt: skip
