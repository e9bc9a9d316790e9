"""Keys that sign capsules and keys that verify them, in the formats skopeo and cosign use.

A private key is either a PEM ECDSA key (``PRIVATE KEY``, ``EC PRIVATE KEY``, or a
passphrase-protected ``ENCRYPTED PRIVATE KEY``), or a cosign/sigstore key: a PEM block
``ENCRYPTED SIGSTORE PRIVATE KEY`` (``ENCRYPTED COSIGN PRIVATE KEY`` in older files) whose
body is a JSON envelope: the PKCS#8 key sealed with NaCl's secretbox under a key that
scrypt derives from the passphrase. ``skopeo copy --sign-by-sigstore-private-key`` takes
only the second kind, so :func:`write_key_pair` writes that one (Debian 12's skopeo has no
``generate-sigstore-key``). A public key is a PEM ``PUBLIC KEY``, as a ``sigstoreSigned``
policy takes it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from sparkrun_coldsnap.errors import RequestError
from sparkrun_coldsnap.host.atomic import write_bytes

SIGSTORE_BLOCK = "ENCRYPTED SIGSTORE PRIVATE KEY"
COSIGN_BLOCK = "ENCRYPTED COSIGN PRIVATE KEY"
# scrypt's cost as cosign writes it (N=2^15, r=8, p=1): the envelope records it, so any is read.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 32768, 8, 1
_PEM = re.compile(r"-----BEGIN ([A-Z0-9 ]+)-----\s*(.*?)\s*-----END \1-----", re.S)


@dataclass(frozen=True)
class PublicKey:
    """A verifying key and where it came from (what refusals name)."""

    path: str
    key: ec.EllipticCurvePublicKey

    @property
    def fingerprint(self) -> str:
        """sha256 of the key's DER SubjectPublicKeyInfo, short: the same key gives the same name anywhere."""
        der = self.key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        return "sha256:" + hashlib.sha256(der).hexdigest()[:16]

    def __str__(self) -> str:
        return "%s (%s)" % (self.path, self.fingerprint)


def _read(path: str | Path, what: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as err:
        raise RequestError("cannot read the %s %s: %s; give the path of a PEM file" % (what, path, err.strerror)) from err


def _ecdsa(key: Any, path: str | Path, what: str) -> Any:
    if not isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey):
        raise RequestError("the %s %s is a %s key: capsule signatures use ECDSA keys (make one with `sparkrun coldsnap keygen`)" % (what, path, type(key).__name__.lstrip("_")))
    return key


def load_public_key(path: str | Path) -> PublicKey:
    """The PEM public key at *path*."""
    data = _read(path, "public key")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm) as err:
        raise RequestError("the public key %s is not a PEM public key (-----BEGIN PUBLIC KEY-----): give the .pub file of the key pair" % path) from err
    return PublicKey(str(path), _ecdsa(key, path, "public key"))


def load_private_key(path: str | Path, passphrase: bytes | None) -> ec.EllipticCurvePrivateKey:
    """The ECDSA private key at *path*, opened with *passphrase* where it is encrypted."""
    data = _read(path, "signing key")
    m = _PEM.search(data.decode(errors="replace"))
    if m is None:
        raise RequestError("the signing key %s is not a PEM file: give a cosign/sigstore key or a PEM ECDSA private key" % path)
    if m.group(1) in (SIGSTORE_BLOCK, COSIGN_BLOCK):
        if passphrase is None:
            raise RequestError("the signing key %s is encrypted: give its passphrase (--passphrase-file)" % path)
        der = _open_envelope(base64.b64decode("".join(m.group(2).split())), passphrase, path)
        key: Any = serialization.load_der_private_key(der, password=None)
    else:
        try:
            key = serialization.load_pem_private_key(data, password=passphrase if m.group(1) == "ENCRYPTED PRIVATE KEY" else None)
        except TypeError as err:
            raise RequestError("the signing key %s is encrypted: give its passphrase (--passphrase-file)" % path) from err
        except (ValueError, UnsupportedAlgorithm) as err:
            raise RequestError("cannot open the signing key %s (%s): give a PEM ECDSA private key and, where encrypted, its right passphrase" % (path, str(err).split("\n")[0][:80])) from err
    return _ecdsa(key, path, "signing key")


def _open_envelope(body: bytes, passphrase: bytes, path: str | Path) -> bytes:
    from nacl.exceptions import CryptoError
    from nacl.secret import SecretBox

    try:
        env = json.loads(body)
        kdf, cipher = env["kdf"], env["cipher"]
        if kdf["name"] != "scrypt" or cipher["name"] != "nacl/secretbox":
            raise ValueError("%s with %s" % (kdf["name"], cipher["name"]))
        params = kdf["params"]
        salt, nonce, sealed = (base64.b64decode(x) for x in (kdf["salt"], cipher["nonce"], env["ciphertext"]))
        n, r, p = int(params["N"]), int(params["r"]), int(params["p"])
    except (ValueError, KeyError, TypeError) as err:
        raise RequestError("the signing key %s is not a sigstore key envelope this version reads (%s): make one with `sparkrun coldsnap keygen`" % (path, err)) from err
    secret = hashlib.scrypt(passphrase, salt=salt, n=n, r=r, p=p, maxmem=256 * n * r * p, dklen=32)
    try:
        return SecretBox(secret).decrypt(sealed, nonce)
    except CryptoError as err:
        raise RequestError("the passphrase does not open the signing key %s: give the one it was made with" % path) from err


def _seal_envelope(der: bytes, passphrase: bytes) -> bytes:
    from nacl.secret import SecretBox

    salt, nonce = os.urandom(32), os.urandom(SecretBox.NONCE_SIZE)
    secret = hashlib.scrypt(passphrase, salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, maxmem=256 * SCRYPT_N * SCRYPT_R * SCRYPT_P, dklen=32)
    sealed = SecretBox(secret).encrypt(der, nonce).ciphertext
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    env = {
        "kdf": {"name": "scrypt", "params": {"N": SCRYPT_N, "r": SCRYPT_R, "p": SCRYPT_P}, "salt": b64(salt)},
        "cipher": {"name": "nacl/secretbox", "nonce": b64(nonce)},
        "ciphertext": b64(sealed),
    }
    return json.dumps(env).encode()


def _pem(block: str, body: bytes) -> bytes:
    text = base64.b64encode(body).decode()
    lines = [text[i : i + 64] for i in range(0, len(text), 64)]
    return ("-----BEGIN %s-----\n%s\n-----END %s-----\n" % (block, "\n".join(lines), block)).encode()


def write_key_pair(prefix: str | Path, passphrase: bytes) -> tuple[Path, Path]:
    """A new ECDSA P-256 key pair: ``PREFIX.key`` (sigstore's encrypted format, mode 0600) and ``PREFIX.pub`` (PEM)."""
    key_path, pub_path = Path("%s.key" % prefix), Path("%s.pub" % prefix)
    for p in (key_path, pub_path):
        if p.exists():
            raise RequestError("%s exists already: choose another prefix, or remove it first" % p)
    key = ec.generate_private_key(ec.SECP256R1())
    der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    write_bytes(key_path, _pem(SIGSTORE_BLOCK, _seal_envelope(der, passphrase)), mode=0o600)
    write_bytes(pub_path, public, mode=0o644)
    return key_path, pub_path


def read_passphrase(path: str | Path | None) -> bytes | None:
    """The passphrase in the file at *path* (its first line, as skopeo reads ``--sign-passphrase-file``)."""
    if path is None:
        return None
    data = _read(path, "passphrase file")
    return data.split(b"\n", 1)[0]
