"""A capsule's layers encrypted for recipients in the store, and what a restore of one needs.

``encrypt`` writes a new manifest whose layers are the ciphertext (layer_crypto.py says the
format); the config does not change. Tagged over the plaintext capsule (the default), the
plaintext layers no other tag references are removed from the store at once: the store then
keeps only ciphertext, and decrypted bytes exist only in a restore's staging directory.
"""

from __future__ import annotations

from pathlib import Path

from sparkrun_coldsnap.capsule import gc, jwe, layer_crypto
from sparkrun_coldsnap.capsule.capsule import Capsule, open_capsule
from sparkrun_coldsnap.capsule.store import CapsuleStore, Descriptor, capsule_ref
from sparkrun_coldsnap.digests import canonical_json, sha256_bytes, short
from sparkrun_coldsnap.errors import ColdsnapError, RequestError
from sparkrun_coldsnap.progress import QUIET, Progress


def encrypted_layers(cap: Capsule) -> list[Descriptor]:
    return [d for d in cap.layers if layer_crypto.is_encrypted(d)]


def fully_encrypted(cap: Capsule) -> bool:
    """Every layer (all of the captured memory) is ciphertext: publishing hands no secret out."""
    layers = cap.layers
    return bool(layers) and all(layer_crypto.is_encrypted(d) for d in layers)


def encrypt(
    store: CapsuleStore, ref: str, recipients: list[jwe.PublicKey], *, target: str | None = None, progress: Progress = QUIET,
) -> Capsule:  # fmt: skip
    """Encrypt *ref*'s plaintext layers for *recipients*; tag the result *target* (default: *ref* itself)."""
    if not recipients:
        raise RequestError("no recipient given: pass --recipient PUBLIC.pem at least once")
    cap = open_capsule(store, ref)
    name = capsule_ref(target).ref if target else (cap.ref or "")
    if not name:
        raise RequestError("capsule %s has no tag to write the encrypted capsule under: pass --as NAME:TAG" % ref)
    plain = [d for d in cap.layers if not layer_crypto.is_encrypted(d)]
    if not plain:
        raise RequestError("capsule %s has all its layers encrypted already: nothing to do" % ref)
    layers: list[Descriptor] = []
    files: list[tuple[Path, str, int]] = []
    with store.staging_dir("encrypt-") as work, progress.transfer("encrypting %s" % ref, sum(d.size for d in plain)) as tick:
        for i, d in enumerate(cap.layers):
            if layer_crypto.is_encrypted(d):
                layers.append(d)
                continue
            out = work / ("layer-%d" % i)
            with store.open_blob(d) as blob, open(out, "wb") as f:
                enc = layer_crypto.encrypt_stream(blob, d, f, recipients)  # type: ignore[arg-type]
            tick(d.size)
            layers.append(enc)
            files.append((out, enc.digest, enc.size))
        manifest = {**cap.manifest, "layers": [d.to_json() for d in layers]}
        data = canonical_json(manifest)
        desc = Descriptor(cap.descriptor.media_type, sha256_bytes(data), len(data), artifact_type=cap.descriptor.artifact_type)
        store.commit(name, desc, files=files, documents=[data])
    with store.locked():
        # The plaintext layers only the replaced tag referenced: gone now, not at the next write.
        gc.collect_locked(store, apply=True, transfers=False)
    return open_capsule(store, name)


def decryption_keys(paths: tuple[Path, ...]) -> list[jwe.PrivateKey]:
    return layer_crypto.load_private_keys(paths)


def key_problems(cap: Capsule, paths: tuple[Path, ...]) -> list[str]:
    """Why *cap*'s encrypted layers could not be decrypted with the keys at *paths* (admission:
    refused before anything is stopped); empty when every layer opens, or none is encrypted."""
    layers = encrypted_layers(cap)
    if not layers:
        return []
    if not paths:
        return ["capsule %s has %d encrypted layer(s) and no decryption key was given: set %s=PRIVATE.pem" % (cap.ref or short(cap.digest), len(layers), layer_crypto.KEY_ENV)]
    try:
        keys = decryption_keys(paths)
        for d in layers:
            layer_crypto.open_layer_key(d, keys)
    except ColdsnapError as err:
        return [err.message]
    return []
