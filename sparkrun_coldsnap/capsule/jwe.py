"""JSON Web Encryption (RFC 7516) of a small payload for public keys, as OCI layer encryption uses it.

Only what containers' ocicrypt writes and reads: content encryption ``A256GCM``, the key wrapped
per recipient with ``RSA-OAEP`` (an RSA key) or ``ECDH-ES+A256KW`` (an EC P-256/P-384/P-521 key,
Concat KDF without party info, RFC 7518 4.6). One recipient gives the flattened JSON
serialization, several the general one, as ocicrypt's JWE library does; reading accepts both
(and ``RSA-OAEP-256``, which skopeo reads too).
"""

from __future__ import annotations

import base64
import json
import os
import struct
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.concatkdf import ConcatKDFHash
from cryptography.hazmat.primitives.keywrap import InvalidUnwrap, aes_key_unwrap, aes_key_wrap

PublicKey = rsa.RSAPublicKey | ec.EllipticCurvePublicKey
PrivateKey = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey

ENC = "A256GCM"
RSA_OAEP = "RSA-OAEP"
ECDH_ES_A256KW = "ECDH-ES+A256KW"
_CURVES: dict[str, type[ec.EllipticCurve]] = {"P-256": ec.SECP256R1, "P-384": ec.SECP384R1, "P-521": ec.SECP521R1}
_CURVE_NAMES = {"secp256r1": "P-256", "secp384r1": "P-384", "secp521r1": "P-521"}  # cryptography's names to JWK's


class NotForThisKey(Exception):
    """The JWE is not addressed to the key tried (or was damaged): try the next key."""


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _oaep(alg: str) -> padding.OAEP:
    h: hashes.HashAlgorithm = hashes.SHA256() if alg == "RSA-OAEP-256" else hashes.SHA1()  # RSA-OAEP is SHA-1 by definition (RFC 7518 4.3)
    return padding.OAEP(mgf=padding.MGF1(h), algorithm=h, label=None)


def _kek(shared: bytes) -> bytes:
    """Concat KDF of RFC 7518 4.6.2 for ECDH-ES+A256KW: AlgorithmID is the alg, no PartyU/V info."""
    alg = ECDH_ES_A256KW.encode("ascii")
    other = struct.pack(">I", len(alg)) + alg + struct.pack(">I", 0) + struct.pack(">I", 0) + struct.pack(">I", 256)
    return ConcatKDFHash(hashes.SHA256(), 32, other).derive(shared)


def _coordinate(value: int, curve: ec.EllipticCurve) -> str:
    return b64url(value.to_bytes((curve.key_size + 7) // 8, "big"))


def _wrap(key: PublicKey, cek: bytes) -> tuple[dict[str, Any], bytes]:
    """The per-recipient header and encrypted key for *key*."""
    if isinstance(key, rsa.RSAPublicKey):
        return {"alg": RSA_OAEP}, key.encrypt(cek, _oaep(RSA_OAEP))
    curve = key.curve
    if curve.name not in _CURVE_NAMES:
        raise ValueError("EC curve %s is not one JWE names (P-256, P-384, P-521)" % curve.name)
    eph = ec.generate_private_key(curve)
    nums = eph.public_key().public_numbers()
    epk = {"kty": "EC", "crv": _CURVE_NAMES[curve.name], "x": _coordinate(nums.x, curve), "y": _coordinate(nums.y, curve)}
    return {"alg": ECDH_ES_A256KW, "epk": epk}, aes_key_wrap(_kek(eph.exchange(ec.ECDH(), key)), cek)


def encrypt(payload: bytes, recipients: list[PublicKey]) -> bytes:
    """*payload* as a JWE (JSON serialization) that any one of *recipients* can open."""
    if not recipients:
        raise ValueError("a JWE needs at least one recipient")
    cek = AESGCM.generate_key(256)
    iv = os.urandom(12)
    wrapped = [_wrap(k, cek) for k in recipients]
    if len(wrapped) == 1:
        header, ek = wrapped[0]
        protected = b64url(json.dumps({**header, "enc": ENC}, separators=(",", ":")).encode())
        doc: dict[str, Any] = {"protected": protected, "encrypted_key": b64url(ek)}
    else:
        protected = b64url(json.dumps({"enc": ENC}, separators=(",", ":")).encode())
        doc = {"protected": protected, "recipients": [{"header": h, "encrypted_key": b64url(ek)} for h, ek in wrapped]}
    sealed = AESGCM(cek).encrypt(iv, payload, protected.encode("ascii"))
    doc.update(iv=b64url(iv), ciphertext=b64url(sealed[:-16]), tag=b64url(sealed[-16:]))
    return json.dumps(doc, separators=(",", ":")).encode()


def _unwrap(key: PrivateKey, header: dict[str, Any], ek: bytes) -> bytes:
    alg = header.get("alg")
    try:
        if isinstance(key, rsa.RSAPrivateKey) and alg in (RSA_OAEP, "RSA-OAEP-256"):
            return key.decrypt(ek, _oaep(str(alg)))
        if isinstance(key, ec.EllipticCurvePrivateKey) and alg == ECDH_ES_A256KW:
            epk = header.get("epk") or {}
            curve = _CURVES.get(str(epk.get("crv")))
            if curve is None or curve.name != key.curve.name:
                raise NotForThisKey
            x, y = (int.from_bytes(unb64url(str(epk[c])), "big") for c in ("x", "y"))
            peer = ec.EllipticCurvePublicNumbers(x, y, curve()).public_key()
            return aes_key_unwrap(_kek(key.exchange(ec.ECDH(), peer)), ek)
    except (ValueError, KeyError, TypeError, InvalidUnwrap) as err:
        raise NotForThisKey from err
    raise NotForThisKey


def decrypt(serialized: bytes, key: PrivateKey) -> bytes:
    """The payload of JWE *serialized* (flattened or general JSON), opened with *key*.
    Raises NotForThisKey when no recipient's key is *key*, or the JWE was changed."""
    try:
        doc = json.loads(serialized)
        protected_text = str(doc["protected"])
        protected = json.loads(unb64url(protected_text))
        shared = {**protected, **(doc.get("unprotected") or {})}
        recipients = doc.get("recipients") or [{"header": doc.get("header") or {}, "encrypted_key": doc.get("encrypted_key", "")}]
        iv, ciphertext, tag = (unb64url(str(doc[k])) for k in ("iv", "ciphertext", "tag"))
        aad = protected_text + ("." + str(doc["aad"]) if doc.get("aad") else "")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise NotForThisKey from err
    for r in recipients:
        header = {**shared, **(r.get("header") or {})}
        if header.get("enc") != ENC:
            continue
        try:
            cek = _unwrap(key, header, unb64url(str(r.get("encrypted_key", ""))))
            return AESGCM(cek).decrypt(iv, ciphertext + tag, aad.encode("ascii"))
        except (NotForThisKey, InvalidTag, ValueError):
            continue
    raise NotForThisKey
