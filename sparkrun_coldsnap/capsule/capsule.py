"""A capsule as an OCI artifact: publish into a store, open and verify from one."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError as PydanticValidationError

from sparkrun_coldsnap import __version__
from sparkrun_coldsnap.capsule import media
from sparkrun_coldsnap.capsule.pack import PackedLayer
from sparkrun_coldsnap.capsule.store import CapsuleStore, Descriptor, IndexEntry
from sparkrun_coldsnap.digests import canonical_json, sha256_bytes, short
from sparkrun_coldsnap.documents.capsule_config import CAPSULE_FORMAT, CapsuleConfig, RecordsDisagree
from sparkrun_coldsnap.errors import ContradictoryCapsuleError, IntegrityError, StoreError


@dataclass(frozen=True)
class Capsule:
    ref: str | None
    descriptor: Descriptor
    manifest: dict[str, Any]
    config: CapsuleConfig

    @property
    def digest(self) -> str:
        return self.descriptor.digest

    @property
    def layers(self) -> list[Descriptor]:
        return [Descriptor.from_json(d) for d in self.manifest.get("layers") or []]

    @property
    def size(self) -> int:
        return self.descriptor.size + int(self.manifest["config"]["size"]) + sum(d.size for d in self.layers)


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def build_manifest(config_desc: Descriptor, layers: list[Descriptor], config: CapsuleConfig) -> dict[str, Any]:
    w = config.workload
    return {
        "schemaVersion": 2,
        "mediaType": media.OCI_MANIFEST,
        "artifactType": media.ARTIFACT_TYPE,
        "config": config_desc.to_json(),
        "layers": [d.to_json() for d in layers],
        "annotations": {
            media.A_CREATED: config.created,
            media.A_TITLE: config.name,
            media.A_VERSION: config.tag,
            media.A_DESCRIPTION: "%s serving %s@%s, captured with the %s driver" % (w.engine, w.model.id, w.model.revision[:12], config.driver),
            media.A_LICENSES: "AGPL-3.0-only",
            media.A_ENGINE: " ".join(filter(None, (config.engine.name, config.engine.version))),
            media.A_DRIVER: config.driver,
            media.A_MODEL: "%s@%s" % (w.model.id, w.model.revision),
            media.A_REQUEST: config.request_sha256,
            media.A_WEIGHTS: config.weights.location,
            media.PREFIX + ".tool-version": __version__,
        },
    }


def publish(store: CapsuleStore, layers: list[PackedLayer], config: CapsuleConfig) -> Descriptor:
    """Move staged layers into the store, write config and manifest, then tag (last)."""
    config_bytes = canonical_json(config.model_dump(mode="json"))
    config_desc = Descriptor(media.CONFIG_MEDIA_TYPE, sha256_bytes(config_bytes), len(config_bytes))
    manifest_bytes = canonical_json(build_manifest(config_desc, [l.descriptor() for l in layers], config))
    desc = Descriptor(media.OCI_MANIFEST, sha256_bytes(manifest_bytes), len(manifest_bytes), artifact_type=media.ARTIFACT_TYPE)
    # One step under the store lock, the tag last: until it is written no reader sees the
    # capsule, and a write killed before it leaves blobs the next write (or gc) frees.
    store.commit("%s:%s" % (config.name, config.tag), desc, files=[(l.path, l.digest, l.size) for l in layers], documents=[config_bytes, manifest_bytes])
    return desc


def parse_manifest(desc: Descriptor, doc: dict[str, Any]) -> None:
    if doc.get("mediaType") not in (None, media.OCI_MANIFEST) or doc.get("schemaVersion") != 2:
        raise IntegrityError("%s is not an OCI image manifest" % short(desc.digest))
    if doc.get("artifactType") != media.ARTIFACT_TYPE:
        raise StoreError("%s is an artifact of type %r, not a coldsnap capsule (%s)" % (short(desc.digest), doc.get("artifactType"), media.ARTIFACT_TYPE))
    if not isinstance(doc.get("config"), dict) or doc["config"].get("mediaType") != media.CONFIG_MEDIA_TYPE:
        raise StoreError("%s has no coldsnap capsule config" % short(desc.digest))


def parse_config(digest: str, doc: dict[str, Any]) -> CapsuleConfig:
    fmt = doc.get("format")
    if fmt != CAPSULE_FORMAT:
        raise StoreError("capsule %s has format %r; this version reads format %d: recapture it" % (short(digest), fmt, CAPSULE_FORMAT))
    try:
        return CapsuleConfig.model_validate(doc)
    except PydanticValidationError as err:
        first = err.errors()[0]
        # A check of the config's own raised this: its words, without pydantic's "Value error, ".
        raised = first.get("ctx", {}).get("error")
        if isinstance(raised, RecordsDisagree):
            raise ContradictoryCapsuleError("capsule %s has an invalid config: %s" % (short(digest), raised)) from err
        raise IntegrityError("capsule %s has an invalid config: %s" % (short(digest), raised if isinstance(raised, ValueError) else first["msg"])) from err


def open_entry(store: CapsuleStore, entry: IndexEntry) -> Capsule:
    manifest = store.read_json(entry.descriptor)
    parse_manifest(entry.descriptor, manifest)
    config_desc = Descriptor.from_json(manifest["config"])
    config = parse_config(entry.descriptor.digest, store.read_json(config_desc))
    return Capsule(entry.ref, entry.descriptor, manifest, config)


def open_capsule(store: CapsuleStore, ref: str) -> Capsule:
    """Resolve *ref* and read its manifest and config, both verified by digest."""
    return open_entry(store, store.resolve(ref))


def verify(store: CapsuleStore, capsule: Capsule, *, on_blob: Callable[[Descriptor], None] | None = None) -> int:
    """Re-hash every layer blob; returns bytes verified. Raises on the first bad blob."""
    total = 0
    for d in capsule.layers:
        if on_blob:
            on_blob(d)
        store.verify_blob(d)
        total += d.size
    return total
