"""The local capsule store: an OCI image layout directory.

Layout (OCI image-spec 1.1 image-layout.md): ``oci-layout``, ``index.json``
and ``blobs/sha256/<hex>``. Index entries carry the capsule reference
(``name:tag``) in ``org.opencontainers.image.ref.name``. Beside the layout the
store keeps ``.staging/`` (private work directories, published by rename),
``.lock`` (serializes index updates) and ``receipts/``.

Every blob is verified against its digest whenever it is read; nothing is
written in place.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from sparkrun_coldsnap.capsule import media
from sparkrun_coldsnap.digests import CHUNK, HashingReader, canonical_json, hex_of, is_digest, sha256_bytes, short
from sparkrun_coldsnap.documents.capsule_ref import CapsuleRef
from sparkrun_coldsnap.errors import IntegrityError, NotFoundError, RequestError, StoreError, UntrustedStoreError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.host.atomic import explain_os_error, fsync_dir, owned_prefix, staging_dir, write_bytes
from sparkrun_coldsnap.host.file_lock import file_lock

LAYOUT_VERSION = {"imageLayoutVersion": "1.0.0"}
# Capsules hold process memory (prompts, keys a process held): read-only, and not for other users.
BLOB_MODE = 0o440


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    annotations: dict[str, str] | None = None
    artifact_type: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.artifact_type:
            out["artifactType"] = self.artifact_type
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        return out

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Descriptor:
        try:
            digest = doc["digest"]
            if not is_digest(digest):
                raise ValueError(digest)
            return cls(
                media_type=str(doc["mediaType"]),
                digest=digest,
                size=int(doc["size"]),
                annotations=dict(doc.get("annotations") or {}) or None,
                artifact_type=doc.get("artifactType"),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise StoreError("malformed OCI descriptor %r: %s" % (doc, err)) from err


@dataclass(frozen=True)
class IndexEntry:
    ref: str | None
    descriptor: Descriptor


def capsule_ref(ref: str | CapsuleRef) -> CapsuleRef:
    """*ref* as a capsule identity: ``name[:tag]`` parsed and checked (the tag ``latest`` when none is written)."""
    return ref if isinstance(ref, CapsuleRef) else CapsuleRef.parse(ref)


class VerifiedReader:
    """A blob stream that raises IntegrityError at EOF if the content is wrong."""

    def __init__(self, f: BinaryIO, digest: str, size: int, path: Path) -> None:
        self._reader = HashingReader(f)
        self._f = f
        self.digest = digest
        self.size = size
        self.path = path

    def read(self, n: int = -1) -> bytes:
        data = self._reader.read(n)
        if (n < 0 or not data) or self._reader.size >= self.size:
            self._check_if_done(data, n)
        return data

    def _check_if_done(self, data: bytes, n: int) -> None:
        if self._reader.size > self.size:
            raise IntegrityError("blob %s is larger than recorded (%d > %d bytes): the store is damaged; delete and re-pull or recapture" % (short(self.digest), self._reader.size, self.size))
        if (not data or n < 0) and (self._reader.size != self.size or self._reader.digest != self.digest):
            raise IntegrityError("blob %s failed verification (got %s, %d bytes): the store is damaged; delete the capsule and re-pull or recapture" % (short(self.digest), short(self._reader.digest), self._reader.size))

    def verify_rest(self) -> None:
        """Read to the end, so the digest check runs even if the consumer stopped early."""
        while self.read(CHUNK):
            pass

    def close(self) -> None:
        self._f.close()


class CapsuleStore:
    """A local OCI image layout holding capsules (and any other OCI artifacts)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).expanduser()

    # -- layout ---------------------------------------------------------

    @property
    def blobs(self) -> Path:
        return self.root / "blobs" / "sha256"

    @property
    def staging(self) -> Path:
        return self.root / ".staging"

    @property
    def receipts(self) -> Path:
        return self.root / "receipts"

    def exists(self) -> bool:
        self.check_directory()
        return (self.root / "oci-layout").is_file() and (self.root / "index.json").is_file()

    def check_directory(self) -> None:
        """A store path that is (or lies under) a regular file is an input error, not an empty store."""
        for p in (self.root, *self.root.parents):
            if p.exists():
                if not p.is_dir():
                    where = "" if p == self.root else " (%s is a file)" % p
                    raise RequestError("capsule store %s is not a directory%s: point --store (or coldsnap.capsule.store) at a directory" % (self.root, where))
                return

    def check_trusted(self) -> None:
        """Refuse a store another user owns or could write: a restore hands what it reads to
        CRIU running as root, so whoever can write the store could run code as root."""
        euid = os.geteuid()
        for path in (self.root, self.root / "index.json", self.root / "blobs", self.blobs):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            if st.st_uid != euid:
                raise UntrustedStoreError("capsule store %s: %s is owned by uid %d, not by the user restoring (uid %d): restore only from a store you own (chown -R %d %s)" % (self.root, path, st.st_uid, euid, euid, self.root))
            if st.st_mode & 0o022:
                raise UntrustedStoreError("capsule store %s: %s is writable by %s: restore only from a store no one else can change (chmod go-w %s)" % (self.root, path, "others" if st.st_mode & 0o002 else "its group", path))

    def init(self) -> CapsuleStore:
        """Create the layout if missing; check it if present."""
        self.check_directory()
        layout = self.root / "oci-layout"
        if layout.exists():
            try:
                doc = json.loads(layout.read_text())
            except (OSError, ValueError) as err:
                raise StoreError("capsule store %s has an unreadable oci-layout file: %s" % (self.root, err)) from err
            if doc.get("imageLayoutVersion") != "1.0.0":
                raise StoreError("capsule store %s has OCI layout version %r; only 1.0.0 is supported" % (self.root, doc.get("imageLayoutVersion")))
        else:
            try:
                # Capsules hold process memory: the store is not for other users to read or change.
                self.root.mkdir(mode=0o750, parents=True, exist_ok=True)
                (self.root / "blobs").mkdir(mode=0o750, exist_ok=True)
                self.blobs.mkdir(mode=0o750, exist_ok=True)
            except OSError as err:
                raise StoreError(explain_os_error(err, self.root)) from err
            write_bytes(layout, json.dumps(LAYOUT_VERSION).encode())
        if not (self.root / "index.json").exists():
            self._write_index([])
        return self

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Serialize changes to the index and ``blobs/`` across processes and their threads
        (reentrant in one thread: another thread of the process, two captures at once, waits its turn)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            lock = file_lock(self.root / ".lock", mode=0o600, per_thread=True)
            lock.acquire()
        except OSError as err:
            raise StoreError(explain_os_error(err, self.root)) from err
        try:
            yield
        finally:
            lock.release()

    # -- blobs ----------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        return self.blobs / hex_of(digest)

    def has_blob(self, digest: str, size: int | None = None) -> bool:
        p = self.blob_path(digest)
        try:
            st = p.stat()
        except FileNotFoundError:
            return False
        return size is None or st.st_size == size

    def publish_blob_file(self, staged: Path, digest: str, size: int) -> None:
        """Move an already-hashed staged file into ``blobs/`` (same filesystem)."""
        target = self.blob_path(digest)
        try:
            if target.exists() and target.stat().st_size == size:
                staged.unlink()
                return
            with open(staged, "rb") as f:
                os.fsync(f.fileno())
            os.chmod(staged, BLOB_MODE)
            os.replace(staged, target)
            fsync_dir(target.parent)
        except OSError as err:
            raise StoreError(explain_os_error(err, target)) from err

    def put_bytes(self, data: bytes, media_type: str, annotations: dict[str, str] | None = None, artifact_type: str | None = None) -> Descriptor:
        """Write a small blob that is referenced already or will be by a tag written under the lock
        (tests and the registry verbs); a capsule's own blobs arrive through ``commit``."""
        with self.locked():
            self._put_bytes_locked(data)
        return Descriptor(media_type, sha256_bytes(data), len(data), annotations, artifact_type)

    def _put_bytes_locked(self, data: bytes) -> None:
        digest = sha256_bytes(data)
        if not self.has_blob(digest, len(data)):
            try:
                self.blobs.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise StoreError(explain_os_error(err, self.blobs)) from err
            write_bytes(self.blob_path(digest), data, mode=BLOB_MODE)

    def put_json(self, doc: dict[str, Any], media_type: str, **kw: Any) -> Descriptor:
        return self.put_bytes(canonical_json(doc), media_type, **kw)

    @contextlib.contextmanager
    def open_blob(self, desc: Descriptor) -> Iterator[VerifiedReader]:
        path = self.blob_path(desc.digest)
        try:
            f = open(path, "rb")
        except FileNotFoundError as err:
            raise NotFoundError("blob %s is missing from the store %s: re-pull the capsule or recapture" % (short(desc.digest), self.root)) from err
        except OSError as err:
            raise StoreError("cannot read blob %s: %s" % (path, err.strerror)) from err
        reader = VerifiedReader(f, desc.digest, desc.size, path)
        try:
            yield reader
        finally:
            reader.close()

    def read_blob(self, desc: Descriptor, *, limit: int = 64 << 20) -> bytes:
        if desc.size > limit:
            raise StoreError("blob %s is %d bytes, too large to read into memory" % (short(desc.digest), desc.size))
        with self.open_blob(desc) as r:
            data = r.read()
        return data

    def read_json(self, desc: Descriptor) -> dict[str, Any]:
        data = self.read_blob(desc)
        try:
            doc = json.loads(data)
        except ValueError as err:
            raise IntegrityError("blob %s is not JSON: %s" % (short(desc.digest), err)) from err
        if not isinstance(doc, dict):
            raise IntegrityError("blob %s is not a JSON object" % short(desc.digest))
        return doc

    def verify_blob(self, desc: Descriptor) -> None:
        with self.open_blob(desc) as r:
            r.verify_rest()

    # -- index ----------------------------------------------------------

    def _read_index(self) -> dict[str, Any]:
        path = self.root / "index.json"
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            return {"schemaVersion": 2, "mediaType": media.OCI_INDEX, "manifests": []}
        except (OSError, ValueError) as err:
            raise StoreError("capsule store index %s is unreadable: %s" % (path, err)) from err
        if doc.get("schemaVersion") != 2 or not isinstance(doc.get("manifests"), list):
            raise StoreError("capsule store index %s is not an OCI image index (schemaVersion 2)" % path)
        return doc

    def _write_index(self, manifests: list[dict[str, Any]]) -> None:
        doc = {"schemaVersion": 2, "mediaType": media.OCI_INDEX, "manifests": manifests}
        write_bytes(self.root / "index.json", (json.dumps(doc, indent=2) + "\n").encode(), mode=0o640)

    def entries(self) -> list[IndexEntry]:
        if not self.exists():
            return []
        out = []
        for m in self._read_index()["manifests"]:
            desc = Descriptor.from_json(m)
            out.append(IndexEntry((desc.annotations or {}).get(media.A_REF_NAME), desc))
        return out

    def tag(self, ref: str | CapsuleRef, desc: Descriptor) -> None:
        """Point *ref* (``name:tag``) at *desc*, replacing what it pointed at."""
        full = capsule_ref(ref).ref
        annotations = dict(desc.annotations or {})
        annotations[media.A_REF_NAME] = full
        entry = Descriptor(desc.media_type, desc.digest, desc.size, annotations, desc.artifact_type).to_json()
        with self.locked():
            manifests = [m for m in self._read_index()["manifests"] if (m.get("annotations") or {}).get(media.A_REF_NAME) != full]
            manifests.append(entry)
            self._write_index(manifests)

    def commit(self, ref: str | CapsuleRef, manifest: Descriptor, *, files: list[tuple[Path, str, int]], documents: list[bytes]) -> None:
        """Move staged blob files into ``blobs/``, write small blobs, and point *ref* at *manifest*,
        all under the store lock.

        A blob enters ``blobs/`` only together with the tag that references it, so under the
        lock a blob nothing references is garbage: left by a write that was interrupted between
        the two (a killed process), and swept here before this write adds its own.
        """
        from sparkrun_coldsnap.capsule import gc

        full = capsule_ref(ref).ref  # refused before anything is written
        with self.locked():
            gc.collect_locked(self, apply=True, transfers=False)
            for path, digest, size in files:
                self.publish_blob_file(path, digest, size)
            for data in documents:
                self._put_bytes_locked(data)
            doc = json.loads(self.read_blob(manifest))
            needed = [Descriptor.from_json(d) for d in [doc.get("config"), *(doc.get("layers") or [])] if isinstance(d, dict)]
            missing = [d.digest for d in needed if not self.has_blob(d.digest, d.size)]
            if missing:
                raise StoreError("blob %s of %s was removed from the store %s while it was being written: run the command again" % (short(missing[0]), full, self.root))
            annotations = dict(manifest.annotations or {})
            annotations[media.A_REF_NAME] = full
            entry = Descriptor(manifest.media_type, manifest.digest, manifest.size, annotations, manifest.artifact_type).to_json()
            manifests = [m for m in self._read_index()["manifests"] if (m.get("annotations") or {}).get(media.A_REF_NAME) != full]
            self._write_index([*manifests, entry])

    def resolve(self, ref: str | CapsuleRef) -> IndexEntry:
        """Find a manifest by ``name[:tag]``, by digest, or by a unique digest prefix."""
        entries = self.entries()
        if isinstance(ref, CapsuleRef):
            ref = ref.ref
        if ref.startswith("sha256:"):
            hits = [e for e in entries if e.descriptor.digest.startswith(ref)]
            uniq = {e.descriptor.digest for e in hits}
            if len(uniq) == 1:
                return hits[0]
            if len(uniq) > 1:
                raise RequestError("digest prefix %s is ambiguous in %s: give more digits" % (ref, self.root))
        else:
            try:
                wanted = capsule_ref(ref).ref
            except RequestError:
                wanted = ref  # not a name a capsule is tagged with now: only an entry written before under it matches
            for e in entries:
                if e.ref == wanted:
                    return e
        known = ", ".join(sorted(e.ref or short(e.descriptor.digest) for e in entries)) or "none"
        raise NotFoundError("capsule %s is not in the store %s (known: %s): capture it with `sparkrun coldsnap capture` or pull it" % (ref, self.root, known))

    def untag(self, ref: str | CapsuleRef) -> IndexEntry:
        entry = self.resolve(ref)
        with self.locked():
            manifests = []
            for m in self._read_index()["manifests"]:
                same_ref = entry.ref is not None and (m.get("annotations") or {}).get(media.A_REF_NAME) == entry.ref
                same_digest = entry.ref is None and m.get("digest") == entry.descriptor.digest
                if not (same_ref or same_digest):
                    manifests.append(m)
            self._write_index(manifests)
        return entry

    # -- garbage collection ---------------------------------------------

    def referenced_blobs(self) -> set[str]:
        """Every blob reachable from the index (manifests, configs, layers, subjects)."""
        seen: set[str] = set()
        stack = [e.descriptor for e in self.entries()]
        while stack:
            desc = stack.pop()
            if desc.digest in seen:
                continue
            seen.add(desc.digest)
            if desc.media_type in (media.OCI_MANIFEST, media.OCI_INDEX) and self.has_blob(desc.digest):
                try:
                    doc = self.read_json(desc)
                except StoreError:
                    continue
                for key in ("config",):
                    if isinstance(doc.get(key), dict):
                        stack.append(Descriptor.from_json(doc[key]))
                for key in ("layers", "manifests", "blobs"):
                    for d in doc.get(key) or []:
                        stack.append(Descriptor.from_json(d))
        return seen

    def staging_dir(self, prefix: str):  # -> contextmanager[Path]
        return staging_dir(self.staging, prefix)

    def new_staging_dir(self, prefix: str) -> Path:
        """A private directory the caller removes itself (it outlives one call)."""
        try:
            self.staging.mkdir(parents=True, exist_ok=True)
            return Path(tempfile.mkdtemp(prefix=owned_prefix(prefix), dir=self.staging))
        except OSError as err:
            raise StoreError(explain_os_error(err, self.staging)) from err


def choose_store(explicit: str | Path | None, configured: str | None) -> CapsuleStore:
    """The store an operation uses: the one asked for (--store), else the recipe's, else the default."""
    chosen = explicit or configured
    return CapsuleStore(Path(chosen).expanduser() if chosen else paths.default_store())
