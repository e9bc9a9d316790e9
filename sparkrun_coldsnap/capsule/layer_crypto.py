"""Encrypted OCI layers, as containers' ocicrypt writes and reads them (``skopeo copy --encryption-key jwe:…``).

A layer is encrypted with a fresh 256-bit key in AES-CTR (the nonce is the whole initial
counter block); an HMAC-SHA256 with the same key covers the ciphertext. Its descriptor gets the
media type suffix ``+encrypted``, the digest and size of the ciphertext (the same length as the
plaintext), and two annotations: ``org.opencontainers.image.enc.keys.jwe`` (base64 of a JWE
whose payload, the layer key and nonce, any one recipient's private key opens; several JWEs may
be joined by commas) and ``org.opencontainers.image.enc.pubopts`` (the cipher and the HMAC).
The image config does not change: its diff_ids name the plaintext. Everything streams in chunks.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import os
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from sparkrun_coldsnap.capsule import jwe
from sparkrun_coldsnap.capsule.store import Descriptor
from sparkrun_coldsnap.digests import CHUNK, short
from sparkrun_coldsnap.errors import IntegrityError, RequestError
from sparkrun_coldsnap.host.threads import ContextPool

SUFFIX = "+encrypted"
A_ENC_PREFIX = "org.opencontainers.image.enc."
A_KEYS_JWE = A_ENC_PREFIX + "keys.jwe"
A_PUBOPTS = A_ENC_PREFIX + "pubopts"
CIPHER = "AES_256_CTR_HMAC_SHA256"
# Where a restore finds the private keys (Settings.decryption_keys reads it).
KEY_ENV = "COLDSNAP_DECRYPTION_KEY"


def is_encrypted(desc: Descriptor) -> bool:
    return desc.media_type.endswith(SUFFIX)


def plain_media_type(media_type: str) -> str:
    return media_type[: -len(SUFFIX)] if media_type.endswith(SUFFIX) else media_type


def plain_annotations(desc: Descriptor) -> dict[str, str] | None:
    """*desc*'s annotations without the encryption's (a decrypted layer carries none of them)."""
    kept = {k: v for k, v in (desc.annotations or {}).items() if not k.startswith(A_ENC_PREFIX)}
    return kept or None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")  # Go's []byte in JSON: standard base64, padded


# -- keys ---------------------------------------------------------------------


def _key_path(spec: str | Path) -> Path:
    text = str(spec)
    return Path(text[4:] if text.startswith("jwe:") else text).expanduser()  # skopeo's spelling, jwe:PATH, too


def load_public_key(spec: str | Path) -> jwe.PublicKey:
    """A recipient's public key: a PEM ``PUBLIC KEY`` (RSA, or EC P-256/P-384/P-521)."""
    path = _key_path(spec)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise RequestError("recipient key %s cannot be read (%s): give the path of a PEM public key (openssl pkey -pubout)" % (path, err.strerror)) from err
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError:
        hint = "it is a private key: give its public half (openssl pkey -in KEY -pubout)" if b"PRIVATE KEY" in data else "write it as a PEM PUBLIC KEY (openssl pkey -pubin -in KEY -pubout)"
        raise RequestError("recipient key %s is not a PEM public key: %s" % (path, hint)) from None
    if not isinstance(key, rsa.RSAPublicKey | ec.EllipticCurvePublicKey) or (isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name not in ("secp256r1", "secp384r1", "secp521r1")):
        raise RequestError("recipient key %s is a %s key: layers are encrypted for RSA or EC P-256/P-384/P-521 keys" % (path, type(key).__name__))
    return key


def load_private_key(spec: str | Path) -> jwe.PrivateKey:
    """A private key in PEM: PKCS#8, PKCS#1 (RSA) or SEC1 (EC), without a passphrase."""
    path = _key_path(spec)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise RequestError("decryption key %s cannot be read (%s): give the path of the PEM private key the capsule was encrypted for" % (path, err.strerror)) from err
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise RequestError("decryption key %s is protected by a passphrase: write an unprotected copy where only you can read it (openssl pkey -in KEY -out PLAIN)" % path) from None
    except ValueError:
        raise RequestError("decryption key %s is not a PEM private key: give the private key (PKCS#8, PKCS#1 or SEC1 PEM) the capsule was encrypted for" % path) from None
    if not isinstance(key, rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey):
        raise RequestError("decryption key %s is a %s key: encrypted layers are opened with RSA or EC keys" % (path, type(key).__name__))
    return key


def load_private_keys(specs: Iterable[str | Path]) -> list[jwe.PrivateKey]:
    return [load_private_key(s) for s in specs]


# -- encryption ---------------------------------------------------------------


def encrypt_stream(src: BinaryIO, desc: Descriptor, out: BinaryIO, recipients: list[jwe.PublicKey]) -> Descriptor:
    """Encrypt the blob *desc* read from *src* into *out* for *recipients*; the ciphertext's descriptor."""
    if is_encrypted(desc):
        raise RequestError("layer %s is encrypted already" % short(desc.digest))
    if not recipients:
        raise RequestError("no recipient to encrypt layer %s for: give at least one public key" % short(desc.digest))
    key, nonce = os.urandom(32), os.urandom(16)
    enc = Cipher(algorithms.AES(key), modes.CTR(nonce)).encryptor()
    mac = hmac.new(key, digestmod="sha256")
    digest = hashlib.sha256()
    size = 0
    while chunk := src.read(CHUNK):
        ct = enc.update(chunk)
        mac.update(ct)
        digest.update(ct)
        out.write(ct)
        size += len(ct)
    tail = enc.finalize()  # CTR keeps nothing back; written for form's sake
    if tail:
        mac.update(tail)
        digest.update(tail)
        out.write(tail)
        size += len(tail)
    private = json.dumps({"symkey": _b64(key), "digest": desc.digest, "cipheroptions": {"nonce": _b64(nonce)}}, separators=(",", ":")).encode()
    public = json.dumps({"cipher": CIPHER, "hmac": _b64(mac.digest()), "cipheroptions": {}}, separators=(",", ":")).encode()
    annotations = {**(desc.annotations or {}), A_KEYS_JWE: _b64(jwe.encrypt(private, recipients)), A_PUBOPTS: _b64(public)}
    return Descriptor(desc.media_type + SUFFIX, "sha256:" + digest.hexdigest(), size, annotations, desc.artifact_type)


def encrypt_file(src: Path, desc: Descriptor, out: Path, recipients: list[jwe.PublicKey]) -> Descriptor:
    with open(src, "rb") as f, open(out, "wb") as o:
        result = encrypt_stream(f, desc, o, recipients)
        o.flush()
        os.fsync(o.fileno())
    return result


# -- decryption ---------------------------------------------------------------


@dataclass(frozen=True)
class LayerKey:
    """What opens one encrypted layer: its key, nonce and expected HMAC, and the plaintext digest ocicrypt recorded."""

    key: bytes
    nonce: bytes
    hmac: bytes
    recorded_digest: str | None


def _annotation_json(desc: Descriptor, name: str) -> dict[str, object]:
    value = (desc.annotations or {}).get(name)
    if not value:
        raise IntegrityError("encrypted layer %s has no %s annotation: it cannot be decrypted; re-encrypt it" % (short(desc.digest), name))
    try:
        doc = json.loads(base64.b64decode(value, validate=True))
    except ValueError as err:
        raise IntegrityError("encrypted layer %s has an unreadable %s annotation: %s; re-encrypt it" % (short(desc.digest), name, err)) from err
    if not isinstance(doc, dict):
        raise IntegrityError("encrypted layer %s has an unreadable %s annotation: not a JSON object; re-encrypt it" % (short(desc.digest), name))
    return doc


def open_layer_key(desc: Descriptor, keys: list[jwe.PrivateKey]) -> LayerKey:
    """Unwrap *desc*'s layer key with the first of *keys* a JWE of it was made for.
    Raises RequestError naming the layer when none is, IntegrityError when the annotations are damaged."""
    if not keys:
        raise RequestError("layer %s is encrypted and no decryption key was given: set %s=PRIVATE.pem" % (short(desc.digest), KEY_ENV))
    pub = _annotation_json(desc, A_PUBOPTS)
    if pub.get("cipher") != CIPHER:
        raise IntegrityError("encrypted layer %s uses cipher %r; only %s is read: re-encrypt it with ocicrypt's default" % (short(desc.digest), pub.get("cipher"), CIPHER))
    wrapped = (desc.annotations or {}).get(A_KEYS_JWE, "")
    if not wrapped:
        raise RequestError("encrypted layer %s has no key wrapped as JWE (only other schemes: pgp, pkcs7, pkcs11 are not read): re-encrypt it for a jwe: recipient" % short(desc.digest))
    for part in wrapped.split(","):
        try:
            serialized = base64.b64decode(part, validate=True)
        except ValueError:
            continue
        for k in keys:
            try:
                payload = jwe.decrypt(serialized, k)
            except jwe.NotForThisKey:
                continue
            try:
                private = json.loads(payload)
                options = private.get("cipheroptions") or {}
                key, nonce = base64.b64decode(private["symkey"]), base64.b64decode(options["nonce"])
                mac = base64.b64decode(str(pub["hmac"]))
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise IntegrityError("encrypted layer %s has unreadable key options (%s): re-encrypt it" % (short(desc.digest), err)) from err
            if len(key) != 32 or len(nonce) != 16:
                raise IntegrityError("encrypted layer %s has a %d-byte key and a %d-byte nonce, not 32 and 16: re-encrypt it" % (short(desc.digest), len(key), len(nonce)))
            recorded = private.get("digest")
            return LayerKey(key, nonce, mac, recorded if isinstance(recorded, str) else None)
    raise RequestError("none of the %d decryption key(s) given opens layer %s: give the private key of a recipient it was encrypted for" % (len(keys), short(desc.digest)))


class DecryptingReader:
    """Plaintext read from the ciphertext stream *src*; at its end the HMAC is checked
    (a mismatch raises IntegrityError: whatever was read from it must be discarded).

    The HMAC is computed on a thread of its own, a few chunks behind the reads: it is a second
    pass of SHA-256 over the layer (the digest check is the first), and hashing releases the GIL,
    so a restore's unpacking does not wait for it. Close it when done (or abandoned)."""

    AHEAD = 8  # chunks handed to the HMAC thread and not yet hashed, at most

    def __init__(self, src: BinaryIO, layer_key: LayerKey, digest: str, *, hash_plain: bool = False) -> None:
        self._src = src
        self._dec = Cipher(algorithms.AES(layer_key.key), modes.CTR(layer_key.nonce)).decryptor()
        self._mac = hmac.new(layer_key.key, digestmod="sha256")
        self._hashing: deque[Future[None]] = deque()
        self._pool = ContextPool(1)
        self._expected = layer_key.hmac
        self._digest = digest
        self._checked = False
        # Of the plaintext, for callers that rewrite the descriptor (an unpacking has no use for it).
        self.plain = hashlib.sha256() if hash_plain else None

    def read(self, n: int = -1) -> bytes:
        ct = self._src.read(n)
        if not ct:
            self._check()
            return b""
        if len(self._hashing) >= self.AHEAD:
            self._hashing.popleft().result()
        self._hashing.append(self._pool.submit(self._mac.update, ct))  # one thread: in order
        data = self._dec.update(ct)
        if self.plain is not None:
            self.plain.update(data)
        return data

    def _check(self) -> None:
        if self._checked:
            return
        self._dec.finalize()
        while self._hashing:
            self._hashing.popleft().result()
        self._pool.shutdown()
        if not hmac.compare_digest(self._mac.digest(), self._expected):
            raise IntegrityError("encrypted layer %s failed its HMAC check (the ciphertext or its annotations were changed): discard it and re-pull or re-encrypt the capsule" % short(self._digest))
        self._checked = True

    def verify_rest(self) -> None:
        while self.read(CHUNK):
            pass

    def close(self) -> None:
        """Stop the HMAC thread (the ciphertext stream is its owner's to close)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._hashing.clear()


def decrypt_stream(src: BinaryIO, desc: Descriptor, out: BinaryIO, keys: list[jwe.PrivateKey]) -> Descriptor:
    """Decrypt blob *desc* from *src* into *out*; the plaintext's descriptor (digest computed here:
    a layer recompressed while encrypted carries the source's digest in its key options)."""
    reader = DecryptingReader(src, open_layer_key(desc, keys), desc.digest, hash_plain=True)
    size = 0
    with contextlib.closing(reader):
        while data := reader.read(CHUNK):
            out.write(data)
            size += len(data)
    assert reader.plain is not None
    return Descriptor(plain_media_type(desc.media_type), "sha256:" + reader.plain.hexdigest(), size, plain_annotations(desc), desc.artifact_type)
