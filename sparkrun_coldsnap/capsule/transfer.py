"""Publish capsules to an OCI registry, pull them back; weights as their own artifact.

Push order follows the distribution spec: blobs, then the manifest by digest,
then the tag (a registry rejects a manifest whose blobs it lacks). A pull
downloads into the store's private staging area, verifies every blob, and
only then moves it into ``blobs/`` and writes the tag: an interrupted pull
leaves nothing in the layout, and the next one resumes where it stopped.

Model weights never travel inside a capsule. ``publish --with-weights`` pushes
the model files as a content-addressed weights artifact (one layer per file,
no timestamps: the same files give the same digest) and publishes the capsule
manifest with that artifact as its ``subject``; the capsule is then listed
among the weights artifact's referrers (the registry's referrers API, or the
``sha256-<digest>`` tag schema where it has none).

A capsule's native weight payload (the engine's loaded tensors, written at capture)
is bound to that capsule, so ``publish --with-native`` pushes it as an artifact
whose ``subject`` is the published capsule manifest; ``pull --with-native`` finds
it among the capsule's referrers and installs it where restores look for it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkrun_coldsnap.capsule import capsule_crypto, media, signatures
from sparkrun_coldsnap.capsule.capsule import Capsule, open_capsule, parse_config, parse_manifest
from sparkrun_coldsnap.capsule.reference import Reference
from sparkrun_coldsnap.capsule.registry import DEFAULT_CHUNK, RegistryClient
from sparkrun_coldsnap.capsule.store import CapsuleStore, Descriptor, capsule_ref
from sparkrun_coldsnap.digests import canonical_json, sha256_bytes, short
from sparkrun_coldsnap.documents.capsule_config import ModelFile, NativePayload, WeightsRecord
from sparkrun_coldsnap.documents.capsule_ref import CapsuleRef
from sparkrun_coldsnap.documents.trust import TrustPolicy
from sparkrun_coldsnap.errors import ColdsnapError, CompatibilityError, IntegrityError, RequestError, StoreError
from sparkrun_coldsnap.progress import QUIET, Progress
from sparkrun_coldsnap.weights import model_files, native_payload, packed_payload

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric import ec

A_WEIGHTS_ARTIFACT = media.PREFIX + ".weights-artifact"


@dataclass(frozen=True)
class PublishResult:
    reference: str
    digest: str
    blobs_pushed: int
    blobs_present: int
    weights: str | None = None
    native: str | None = None
    #: the tag the capsule's signature was attached under, when it was signed.
    signature: str | None = None


def weights_tag(revision: str) -> str:
    return "weights-" + revision[:40]


def files_artifact(artifact_type: str, config_type: str, file_type: str, files: tuple[ModelFile, ...], config: bytes, annotations: dict[str, str]) -> dict[str, Any]:
    """An artifact manifest with one layer per file, named by its title; no timestamps."""
    return {
        "schemaVersion": 2,
        "mediaType": media.OCI_MANIFEST,
        "artifactType": artifact_type,
        "config": {"mediaType": config_type, "digest": sha256_bytes(config), "size": len(config)},
        "layers": [{"mediaType": file_type, "digest": f.sha256, "size": f.size, "annotations": {media.A_TITLE: f.name}} for f in files],
        "annotations": annotations,
    }


def weights_artifact(record: WeightsRecord) -> tuple[dict[str, Any], bytes]:
    """The weights artifact's manifest and config: deterministic, so identical files give one digest."""
    config = canonical_json({"model_id": record.model_id, "revision": record.revision, "files": [f.model_dump() for f in record.files]})
    annotations = {media.A_MODEL: "%s@%s" % (record.model_id, record.revision)}
    return files_artifact(media.WEIGHTS_ARTIFACT_TYPE, media.WEIGHTS_CONFIG_MEDIA_TYPE, media.WEIGHTS_FILE_MEDIA_TYPE, record.files, config, annotations), config


def native_artifact(record: NativePayload, subject: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """The native payload's manifest (its subject: the capsule it was written with) and config."""
    config = canonical_json(record.model_dump(mode="json"))
    manifest = files_artifact(media.NATIVE_ARTIFACT_TYPE, media.NATIVE_CONFIG_MEDIA_TYPE, media.NATIVE_FILE_MEDIA_TYPE, record.files, config, {media.A_NATIVE: record.digest})
    manifest["subject"] = subject
    return manifest, config


def _push_bytes(client: RegistryClient, data: bytes, staging: Path, tick) -> bool:
    staging.mkdir(parents=True, exist_ok=True)
    path = staging / ("bytes-%s" % sha256_bytes(data).split(":")[1])
    path.write_bytes(data)
    try:
        return client.push_blob(path, sha256_bytes(data), len(data), state_dir=staging, tick=tick)
    finally:
        path.unlink(missing_ok=True)


def _push_files(client: RegistryClient, files: tuple[ModelFile, ...], directory: Path, config: bytes, *, staging: Path, chunk: int, tick) -> None:
    for f in files:
        client.push_blob(directory / f.name, f.sha256, f.size, state_dir=staging, chunk=chunk, tick=tick)
    _push_bytes(client, config, staging, tick)


def push_weights(client: RegistryClient, record: WeightsRecord, model_dir: Path, *, staging: Path, chunk: int, progress: Progress) -> Descriptor:
    problems = model_files.verify(model_dir, record.files)
    if problems:
        raise IntegrityError("cannot publish the weights: %s" % "; ".join(problems))
    manifest, config = weights_artifact(record)
    total = sum(f.size for f in record.files) + len(config)
    with progress.transfer("pushing weights %s@%s" % (record.model_id, record.revision[:12]), total) as tick:
        _push_files(client, record.files, model_dir, config, staging=staging, chunk=chunk, tick=tick)
    data = canonical_json(manifest)
    digest = client.put_manifest(data, media.OCI_MANIFEST, sha256_bytes(data))
    client.put_manifest(data, media.OCI_MANIFEST, weights_tag(record.revision))
    return Descriptor(media.OCI_MANIFEST, digest, len(data), artifact_type=media.WEIGHTS_ARTIFACT_TYPE)


def native_to_publish(cap: Capsule) -> NativePayload:
    """The capsule's native payload, present and intact on this host, or why it cannot be published."""
    record = cap.config.weights.native
    if record is None:
        raise RequestError("capsule %s has no native weight payload (captured with weights: recovery, in a container, or on the CPU): publish it without --with-native" % cap.ref)
    problems = native_payload.problems(record)
    if problems:
        raise IntegrityError("cannot publish the native weight payload: %s; publish from the host that captured it, or without --with-native" % problems[0])
    return record


def push_native(client: RegistryClient, record: NativePayload, subject: dict[str, Any], *, staging: Path, chunk: int, progress: Progress) -> str:
    """Push *record*'s files and its manifest, and list it among *subject*'s referrers."""
    manifest, config = native_artifact(record, subject)
    with progress.transfer("pushing native weight payload %s" % short(record.digest), sum(f.size for f in record.files) + len(config)) as tick:
        _push_files(client, record.files, native_payload.directory(record), config, staging=staging, chunk=chunk, tick=tick)
    data = canonical_json(manifest)
    digest = client.put_manifest(data, media.OCI_MANIFEST, sha256_bytes(data))
    client.add_referrer(subject["digest"], {"mediaType": media.OCI_MANIFEST, "digest": digest, "size": len(data), "artifactType": media.NATIVE_ARTIFACT_TYPE, "annotations": manifest["annotations"]})
    return digest


def publish(
    store: CapsuleStore, capsule_ref: str, target: Reference, client: RegistryClient, *, model_dir: Path | None = None, with_native: bool = False,
    chunk: int = DEFAULT_CHUNK, progress: Progress = QUIET, allow_secrets: bool = False, sign_with: ec.EllipticCurvePrivateKey | None = None,
) -> PublishResult:  # fmt: skip
    """Push a local capsule (given *model_dir*, its weights as its subject; *with_native*, its native payload as a referrer) to *target*.
    A capsule whose memory holds credentials is refused unless *allow_secrets* or all its layers are encrypted: whoever can pull it could read them.
    With *sign_with*, the published manifest is signed as *target* and the signature attached (and kept locally)."""
    cap = open_capsule(store, capsule_ref)
    # Encrypted throughout, the memory is readable only by the recipients' private keys.
    if cap.config.credentials and not allow_secrets and not capsule_crypto.fully_encrypted(cap):
        raise RequestError("capsule %s holds credentials in its memory (%s): publishing hands them to whoever can pull it; capture it without them, encrypt it, or pass --allow-secrets" % (
            capsule_ref, ", ".join(cap.config.credentials)))  # fmt: skip
    native = native_to_publish(cap) if with_native else None  # refused before anything is pushed
    staging = store.staging / "uploads"
    blobs = [Descriptor.from_json(cap.manifest["config"]), *cap.layers]
    pushed = present = 0
    with progress.transfer("pushing %s to %s" % (capsule_ref, target), sum(d.size for d in blobs)) as tick:
        for d in blobs:
            if client.push_blob(store.blob_path(d.digest), d.digest, d.size, state_dir=staging, chunk=chunk, tick=tick):
                pushed += 1
            else:
                present += 1
    manifest_bytes = store.read_blob(cap.descriptor)
    weights_digest = None
    if model_dir is not None:
        subject = push_weights(client, cap.config.weights, model_dir, staging=staging, chunk=chunk, progress=progress)
        weights_digest = subject.digest
        doc = dict(cap.manifest)
        doc["subject"] = {"mediaType": subject.media_type, "digest": subject.digest, "size": subject.size}
        doc["annotations"] = {**doc.get("annotations", {}), A_WEIGHTS_ARTIFACT: subject.digest}
        manifest_bytes = canonical_json(doc)
    digest = client.put_manifest(manifest_bytes, media.OCI_MANIFEST, sha256_bytes(manifest_bytes))
    tag = target.tag or cap.config.tag
    client.put_manifest(manifest_bytes, media.OCI_MANIFEST, tag)
    if weights_digest:
        annotations = {k: v for k, v in json.loads(manifest_bytes).get("annotations", {}).items() if k.startswith(("org.opencontainers", media.PREFIX))}
        client.add_referrer(weights_digest, {"mediaType": media.OCI_MANIFEST, "digest": digest, "size": len(manifest_bytes), "artifactType": media.ARTIFACT_TYPE, "annotations": annotations})
    native_digest = None
    if native is not None:
        capsule_subject: dict[str, Any] = {"mediaType": media.OCI_MANIFEST, "digest": digest, "size": len(manifest_bytes)}
        native_digest = push_native(client, native, capsule_subject, staging=staging, chunk=chunk, progress=progress)
    signature_tag = None
    if sign_with is not None:
        sig = signatures.sign(sign_with, str(target.with_tag(tag)), digest)
        signature_tag = signatures.push_signature(client, digest, sig)
        signatures.keep(store, digest, [sig])
    return PublishResult(str(target.with_tag(tag)), digest, pushed, present, weights_digest, native_digest, signature_tag)


def _fetch(client: RegistryClient, store: CapsuleStore, d: Descriptor, tick) -> Path | None:
    """Download blob *d* into the store's staging unless the store has it (None); the verified
    file stays there until the pull commits it with its tag."""
    if store.has_blob(d.digest, d.size):
        if tick:
            tick(d.size)
        return None
    partial = store.staging / "downloads" / (d.digest.split(":")[1] + ".partial")
    client.fetch_blob(d.digest, d.size, partial, tick=tick)
    return partial


@dataclass(frozen=True)
class PullResult:
    capsule: Capsule
    blobs_fetched: int
    blobs_present: int


def admit_signatures(client: RegistryClient, ref: Reference, digest: str, trust: TrustPolicy | None) -> list[signatures.Signature]:
    """The signatures attached to manifest *digest*, refused (before anything is fetched) where *trust* refuses them.
    Without a policy they are only kept: a restore under one checks them later."""
    try:
        found = signatures.remote_signatures(client, digest)
    except ColdsnapError:
        if trust is not None:
            raise
        return []
    if trust is not None:
        why = signatures.refusal(str(ref), digest, found, trust, repository="%s/%s" % (ref.registry, ref.repository))
        if why:
            raise CompatibilityError("pull refused: %s" % why, code="admission.untrusted")
    return found


def pull(
    client: RegistryClient, ref: Reference, store: CapsuleStore, *, local_ref: str | None = None, progress: Progress = QUIET, trust: TrustPolicy | None = None,
) -> PullResult:  # fmt: skip
    """Pull the capsule at *ref* into *store*; tag it *local_ref* (default: its name:tag).
    Under *trust*, a capsule without a signature the policy accepts is refused before its blobs are fetched."""
    local = capsule_ref(local_ref) if local_ref else None  # refused before anything is fetched
    data, media_type, digest = client.get_manifest(ref.reference)
    if media_type and media_type not in (media.OCI_MANIFEST,):
        raise StoreError("%s is a %s, not a coldsnap capsule manifest (%s)" % (ref, media_type, media.OCI_MANIFEST))
    try:
        doc = json.loads(data)
    except ValueError as err:
        raise IntegrityError("%s: the registry sent a manifest that is not JSON" % ref) from err
    desc = Descriptor(media.OCI_MANIFEST, digest, len(data), artifact_type=media.ARTIFACT_TYPE)
    parse_manifest(desc, doc)
    sigs = admit_signatures(client, ref, digest, trust)
    store.init()
    config_desc = Descriptor.from_json(doc["config"])
    layers = [Descriptor.from_json(d) for d in doc.get("layers") or []]
    files: list[tuple[Path, str, int]] = []
    with progress.transfer("pulling %s" % ref, sum(d.size for d in [config_desc, *layers])) as tick:
        got = _fetch(client, store, config_desc, tick)
        config_bytes = got.read_bytes() if got is not None else store.read_blob(config_desc)
        config = parse_config(digest, _json_object(config_bytes, config_desc))
        files += [(got, config_desc.digest, config_desc.size)] if got is not None else []
        for d in layers:
            got = _fetch(client, store, d, tick)
            files += [(got, d.digest, d.size)] if got is not None else []
    target = local or CapsuleRef.of(config.name, ref.tag or config.tag, what="the capsule %s names itself" % ref, fix="pull it with a local name (NAME[:TAG])")
    # Kept before the tag: a signature of a digest the store lacks is inert.
    signatures.keep(store, digest, sigs)
    # Blobs and tag in one step under the store lock: until then the pull is invisible.
    store.commit(target, Descriptor(media.OCI_MANIFEST, digest, len(data), artifact_type=media.ARTIFACT_TYPE), files=files, documents=[data])
    return PullResult(open_capsule(store, target.ref), len(files), len(layers) + 1 - len(files))


def _json_object(data: bytes, d: Descriptor) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError as err:
        raise IntegrityError("blob %s is not JSON: %s" % (short(d.digest), err)) from err
    if not isinstance(doc, dict):
        raise IntegrityError("blob %s is not a JSON object" % short(d.digest))
    return doc


def weights_subject(cap: Capsule) -> str | None:
    subject = cap.manifest.get("subject") or {}
    return subject.get("digest")


def pull_weights(client: RegistryClient, cap: Capsule, model_dir: Path, *, progress: Progress = QUIET) -> int:
    """Fetch the capsule's weights artifact into *model_dir*, file by file, skipping files already right."""
    digest = weights_subject(cap)
    if not digest:
        raise RequestError("capsule %s was published without its weights: publish it with --with-weights, or download revision %s" % (short(cap.digest), cap.config.weights.revision))
    data, _, _ = client.get_manifest(digest)
    doc = json.loads(data)
    if doc.get("artifactType") != media.WEIGHTS_ARTIFACT_TYPE:
        raise StoreError("the subject of capsule %s is a %s, not a weights artifact" % (short(cap.digest), doc.get("artifactType")))
    wanted = {f.name: f for f in cap.config.weights.files}
    model_dir.mkdir(parents=True, exist_ok=True)
    missing = [f for f in wanted.values() if model_files.verify(model_dir, (f,))]
    fetched = 0
    with progress.transfer("pulling weights %s" % cap.config.weights.model_id, sum(f.size for f in missing)) as tick:
        for f in missing:
            target = model_dir / f.name
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(target.name + ".partial")
            client.fetch_blob(f.sha256, f.size, partial, tick=tick)
            if target.is_symlink() or target.exists():
                target.unlink()
            os.replace(partial, target)
            fetched += 1
    return fetched


def pull_native(client: RegistryClient, cap: Capsule, *, progress: Progress = QUIET) -> int:
    """Fetch the capsule's native payload from its referrers into this host's payloads; 0 if already here."""
    record = cap.config.weights.native
    if record is None:
        raise RequestError("capsule %s has no native weight payload: pull it without --with-native (restores take the recovery path)" % cap.ref)
    if not native_payload.problems(record):
        return 0
    published = [d for d in client.referrers(cap.digest, media.NATIVE_ARTIFACT_TYPE) if (d.get("annotations") or {}).get(media.A_NATIVE) == record.digest]
    if not published:
        raise RequestError("capsule %s was published without its native weight payload: publish it with --with-native from the host that captured it (until then restores take the recovery path)" % short(cap.digest))
    shutil.rmtree(native_payload.directory(record), ignore_errors=True)  # a damaged copy is replaced
    # Kept when interrupted: the next pull resumes each file where this one stopped.
    staged = native_payload.download_dir(record)
    with progress.transfer("pulling native weight payload %s" % short(record.digest), sum(f.size for f in record.files)) as tick:
        for f in record.files:
            target = staged / f.name
            target.parent.mkdir(parents=True, exist_ok=True)
            client.fetch_blob(f.sha256, f.size, target, tick=tick)
    native_payload.install(staged, record)
    packed_payload.keep_packed(native_payload.directory(record), record.files, progress)
    return len(record.files)


@dataclass
class CompanionPull:
    """A capsule pulled with what was asked of its companions: weight files, native payload."""

    result: PullResult
    weight_files: int = 0
    native_files: int = 0
    #: why the native payload was not fetched, when it was optional.
    native_error: str | None = None


def pull_with_companions(
    client: RegistryClient, ref: Reference, store: CapsuleStore, *, local_ref: str | None, model_dir_of: Callable[[Capsule], Path],
    want_weights: Callable[[Capsule], bool], want_native: Callable[[Capsule], bool], native_optional: bool = False, progress: Progress = QUIET,
    trust: TrustPolicy | None = None,
) -> CompanionPull:  # fmt: skip
    """The one pull sequence: the capsule, then (as *want_weights* / *want_native* decide for
    the capsule that arrived) its model files into *model_dir_of(capsule)* and its native payload."""
    out = CompanionPull(pull(client, ref, store, local_ref=local_ref, progress=progress, trust=trust))
    cap = out.result.capsule
    if want_weights(cap):
        out.weight_files = pull_weights(client, cap, model_dir_of(cap), progress=progress)
    if want_native(cap):
        try:
            out.native_files = pull_native(client, cap, progress=progress)
        except ColdsnapError as err:
            if not native_optional:
                raise
            out.native_error = str(err)
    return out


def remote_capsules(client: RegistryClient) -> list[dict[str, Any]]:
    """Capsules in the client's repository: by tag, and as referrers of its weights artifacts."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for tag in client.tags():
        if tag.startswith("sha256-"):
            continue
        try:
            data, _, digest = client.get_manifest(tag)
        except Exception:  # noqa: BLE001 - a broken tag is listed as such
            out.append({"tag": tag, "error": "unreadable manifest"})
            continue
        doc = json.loads(data)
        kind = doc.get("artifactType")
        if kind == media.ARTIFACT_TYPE and digest not in seen:
            seen.add(digest)
            out.append({"tag": tag, "digest": digest, "found_by": "tag", "annotations": doc.get("annotations") or {}})
        elif kind == media.WEIGHTS_ARTIFACT_TYPE:
            for d in client.referrers(digest, media.ARTIFACT_TYPE):
                if d["digest"] not in seen:
                    seen.add(d["digest"])
                    out.append({"tag": None, "digest": d["digest"], "found_by": "referrer of %s" % tag, "annotations": d.get("annotations") or {}})
    return out
