"""A template capture's engine caches: where they live, the layer that carries them, putting them back.

A pre-CUDA template (the ``n580`` driver) is captured before its engine compiles anything, so
the restored engine compiles again (torch.compile and Inductor, Triton, FlashInfer's JIT)
unless it finds what an earlier run left in its caches. The capture starts the engine with its
cache variables (the adapter's ``compile_caches``) pointing into one directory,
``<COLDSNAP_ENGINE_CACHE_ROOT>/request-<key>``, which the template's memory then holds; once
the engine went on past the boundary and served, the capture packs that directory as a layer of
its own, and a restore unpacks it to the same path before the template goes on.

The key is the capture request's digest: known before the engine starts (the capsule's digest
is not), the same on every host, and fixed by what the caches depend on (the engine's command,
the model's revision, the topology). Captures of one request share the directory; the libraries
name their entries by their own content hashes, so what one left is valid for the other.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sparkrun_coldsnap.capsule import layer_crypto, media
from sparkrun_coldsnap.capsule.jwe import PrivateKey
from sparkrun_coldsnap.capsule.pack import PackedLayer, Tick, pack_files, unpack_layer
from sparkrun_coldsnap.capsule.store import CapsuleStore, Descriptor
from sparkrun_coldsnap.digests import short
from sparkrun_coldsnap.documents.capsule_config import CarriedCache, EngineCaches
from sparkrun_coldsnap.documents.settings import current
from sparkrun_coldsnap.errors import CaptureError, ColdsnapError, RestoreError

#: the folder every member of the layer sits under (the directory's own name differs per request)
PREFIX = "engine-caches"
KEY_CHARS = 32


def directory(request_sha256: str) -> Path:
    """The caches' directory of a capture of the request whose digest is *request_sha256*."""
    return current().engine_cache_root / ("request-" + request_sha256.split(":", 1)[-1][:KEY_CHARS])


@dataclass(frozen=True)
class Pointed:
    """What a capture pointed into *directory*: each carried variable and its cache's folder name,
    and the variables the launch already set (the engine keeps them; those caches stay out)."""

    directory: Path
    carried: Mapping[str, str] = field(default_factory=dict)
    kept: tuple[str, ...] = ()


def point(env: Mapping[str, str], caches: Mapping[str, str], where: Path) -> tuple[dict[str, str], Pointed]:
    """*env* with each of *caches* (variable -> folder name) not set there pointed at its folder
    under *where*, the folders made; and what was pointed."""
    out = dict(env)
    carried: dict[str, str] = {}
    kept = []
    for var, name in caches.items():
        if env.get(var):
            kept.append(var)
            continue
        out[var] = str(where / name)
        carried[var] = name
    try:
        for name in carried.values():
            (where / name).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CaptureError("cannot make the engine's cache directory %s: %s; make it writable, or set COLDSNAP_ENGINE_CACHE_ROOT to a writable folder (the same on every host)" % (
            where, err.strerror or err)) from err  # fmt: skip
    return out, Pointed(where, carried, tuple(sorted(kept)))


def _files(folder: Path) -> list[Path]:
    # Regular files only: a link or a socket the engine left is nothing a restore may write.
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()) if folder.is_dir() else []


def pack(pointed: Pointed, out_dir: Path, *, tick: Tick | None = None) -> tuple[PackedLayer, EngineCaches] | None:
    """The caches in *pointed*'s directory as a staged layer under *out_dir*, and the config's
    record of them; None where the engine left nothing in them."""
    caches = []
    files: list[Path] = []
    for var, name in pointed.carried.items():
        found = _files(pointed.directory / name)
        caches.append(CarriedCache(name=name, env=var, files=len(found), bytes=sum(p.stat().st_size for p in found)))
        files += found
    if not files:
        return None
    annotations = {media.A_ENGINE_CACHES: ",".join(c.name for c in caches if c.files)}
    layer = pack_files(files, pointed.directory, PREFIX, out_dir / "engine-caches.tar", annotations, types=media.ENGINE_CACHE_TYPES, tick=tick)
    record = EngineCaches(
        directory=str(pointed.directory), layer=layer.digest, files=len(files), bytes=sum(c.bytes for c in caches), caches=tuple(caches), kept=pointed.kept,
    )  # fmt: skip
    return layer, record


def is_cache_layer(desc: Descriptor) -> bool:
    return layer_crypto.plain_media_type(desc.media_type) in media.ENGINE_CACHE_TYPES


def _layer(record: EngineCaches | None, layers: Sequence[Descriptor]) -> Descriptor | None:
    # An encrypted layer's digest is its ciphertext's, while the config names the plaintext's
    # (encrypting keeps the config): that one is known by its type, and checked as it is decrypted.
    if record is None:
        return None
    return next((d for d in layers if is_cache_layer(d) and (d.digest == record.layer or layer_crypto.is_encrypted(d))), None)


def problems(store: CapsuleStore, request_sha256: str, record: EngineCaches | None, layers: Sequence[Descriptor]) -> list[str]:
    """Why a capsule's engine caches (its config's *record*, its *layers*, the digest of the
    request it was captured for) cannot be put back here: its record and its layers disagree,
    this host's root differs from the one the engine holds, or the layer is damaged."""
    found = [d for d in layers if is_cache_layer(d)]
    if found and (record is None or len(found) > 1):
        return ["the capsule holds %d engine cache layer(s) its config does not describe: recapture" % len(found)]
    if record is None:
        return []
    desc = _layer(record, layers)
    if desc is None:
        held = " (it holds %s)" % short(found[0].digest) if found else ""
        return ["the capsule's config names engine cache layer %s, which its manifest does not hold%s: recapture" % (short(record.layer), held)]
    expected = directory(request_sha256)
    if Path(record.directory) != expected:
        return ["the captured engine reads its caches in %s, this host would put them in %s: set COLDSNAP_ENGINE_CACHE_ROOT=%s here" % (
            record.directory, expected, Path(record.directory).parent)]  # fmt: skip
    try:
        store.verify_blob(desc)
    except (ColdsnapError, OSError) as err:
        return ["engine cache layer %s is damaged (%s): pull the capsule again or recapture" % (short(desc.digest), err)]
    return []


def install(
    store: CapsuleStore, request_sha256: str, record: EngineCaches | None, layers: Sequence[Descriptor], *, tick: Tick | None = None, keys: list[PrivateKey] | None = None,
) -> dict[str, object]:  # fmt: skip
    """The engine caches a capsule's config records (*record*) unpacked from its *layers*
    (verified, decrypted where encrypted) into the directory the captured engine reads: a file
    already there with the same bytes is left alone, any other is replaced whole; what it did,
    for the receipt. Refused as admission refuses it (:func:`problems`), minus the re-hash."""
    desc = _layer(record, layers)
    if record is None or desc is None:
        return {}
    target = Path(record.directory)
    if target != directory(request_sha256):  # a path a capsule names is written only where this host's root says
        raise RestoreError("the capsule's engine caches name %s, not %s: set COLDSNAP_ENGINE_CACHE_ROOT=%s here" % (target, directory(request_sha256), target.parent))
    try:
        target.mkdir(parents=True, exist_ok=True)
        unpacking = Path(tempfile.mkdtemp(prefix=".unpacking-", dir=target.parent))  # beside it: renames stay on one filesystem
    except OSError as err:
        raise RestoreError("cannot make the engine's cache directory %s: %s; make it writable" % (target, err.strerror or err)) from err
    written = kept = 0
    try:
        unpack_layer(store, desc, unpacking, tick=tick, keys=keys)
        source = unpacking / PREFIX
        for path in _files(source):
            dest = target / path.relative_to(source)
            if not dest.parent.resolve().is_relative_to(target.resolve()):
                raise RestoreError("%s leads out of the engine's cache directory %s (a link): remove it" % (dest.parent, target))
            if dest.is_file() and not dest.is_symlink() and filecmp.cmp(path, dest, shallow=False):
                kept += 1
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.is_dir() and not dest.is_symlink():
                raise RestoreError("%s is a directory where the capsule's engine cache holds a file: remove it" % dest)
            os.replace(path, dest)
            written += 1
    except OSError as err:
        raise RestoreError("putting the engine's caches into %s failed: %s" % (target, err)) from err
    finally:
        shutil.rmtree(unpacking, ignore_errors=True)
    return {"directory": str(target), "files_written": written, "files_kept": kept, "bytes": record.bytes}
