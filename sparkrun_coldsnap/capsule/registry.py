"""An OCI registry client: oras-py's registry session and credentials, plus what it lacks.

oras-py (0.2.x) gives the session and finds credentials the usual ways
(``~/.docker/config.json`` with credential helpers, ``ORAS_USER``/``ORAS_PASS``).
It has no ``artifactType``, no referrers, no resumable transfers, and it
retries every error for minutes; so the calls themselves are made here, on its
session: chunked uploads that resume from the registry's recorded offset,
downloads that resume with ``Range``, digests checked on arrival, and each
failure turned into one line that says what to do. Credentials never appear
in messages, logs or receipts.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urljoin

import requests

from sparkrun_coldsnap.capsule import media
from sparkrun_coldsnap.capsule.reference import Reference
from sparkrun_coldsnap.digests import CHUNK, sha256_bytes, short
from sparkrun_coldsnap.documents import settings
from sparkrun_coldsnap.errors import IntegrityError, NotFoundError, RegistryError
from sparkrun_coldsnap.host.atomic import write_bytes

DEFAULT_CHUNK = 16 << 20
MANIFEST_TYPES = (media.OCI_MANIFEST, media.OCI_INDEX)
Tick = Callable[[int], None]


@dataclass(frozen=True)
class Transport:
    plain_http: bool = False
    ca_file: str | None = None
    timeout: float = 60.0


def credential_files() -> list[str]:
    """Where credentials may be, besides ``~/.docker/config.json`` (oras-py reads that one)."""
    return [str(p) for p in settings.current().credential_files if p.exists()]


def _oci_errors(r: requests.Response) -> str:
    try:
        errors = r.json().get("errors") or []
        return "; ".join("%s (%s)" % (e.get("code"), e.get("message")) for e in errors) or r.text[:200].strip()
    except ValueError:
        return r.text[:200].strip() or r.reason


class RegistryClient:
    """One repository of one registry."""

    def __init__(self, ref: Reference, transport: Transport = Transport()) -> None:
        import oras.provider

        self.ref = ref
        self.transport = transport
        scheme = "http" if transport.plain_http else "https"
        self.base = "%s://%s/v2/%s" % (scheme, ref.registry, ref.repository)
        self.root = "%s://%s/v2/" % (scheme, ref.registry)
        self._oras = oras.provider.Registry(hostname=ref.registry, insecure=transport.plain_http, tls_verify=transport.ca_file or True, auth_backend="basic")
        self.session: requests.Session = self._oras.session
        self.session.verify = transport.ca_file or True
        self._credentials = self._find_credentials()
        self._bearer: str | None = None

    # -- credentials and requests ---------------------------------------------

    def _find_credentials(self) -> tuple[str, str] | None:
        auth = self._oras.auth
        try:
            auth.load_configs(self._oras.get_container(str(self.ref.with_tag(self.ref.tag or "latest"))), configs=credential_files())
        except Exception:  # noqa: BLE001 - unreadable credential files: go on anonymously
            pass
        # The basic-auth backend's header carries what it found (ORAS_USER/ORAS_PASS, the
        # credential files, their credential helpers); it has no header when it found nothing.
        try:
            header = auth.get_auth_header()
        except AttributeError:
            return None
        scheme, _, encoded = header.get("Authorization", "").partition(" ")
        if scheme != "Basic" or encoded in ("", "None"):
            return None
        user, _, password = base64.b64decode(encoded).decode(errors="replace").partition(":")
        return user, password

    def _where(self) -> str:
        return self.ref.registry

    def request(self, method: str, url: str, *, ok: tuple[int, ...], what: str, **kw: Any) -> requests.Response:
        """One HTTP call with auth negotiated once; anything not in *ok* becomes a RegistryError."""
        kw.setdefault("timeout", self.transport.timeout)
        # Explicit: requests lets REQUESTS_CA_BUNDLE override a session's setting.
        kw.setdefault("verify", self.transport.ca_file or True)
        headers = dict(kw.pop("headers", None) or {})
        for attempt in range(2):
            if self._bearer:
                headers["Authorization"] = "Bearer " + self._bearer
            auth = self._credentials if (self._credentials and not self._bearer) else None
            try:
                r = self.session.request(method, url, headers=headers, auth=auth, **kw)
            except requests.exceptions.SSLError as err:
                raise RegistryError("TLS verification of registry %s failed: pass its CA certificate (--ca-file / coldsnap.capsule.ca_file), or --plain-http for a plain-HTTP registry" % self._where()) from err
            except requests.exceptions.ConnectionError as err:
                raise RegistryError("cannot reach registry %s: %s; check the address and that the registry is running" % (self._where(), _reason(err))) from err
            except requests.exceptions.Timeout as err:
                raise RegistryError("registry %s did not answer %s within %.0f s" % (self._where(), what, self.transport.timeout)) from err
            if r.status_code == 401 and attempt == 0 and self._authenticate(r):
                continue
            break
        if r.status_code in ok:
            return r
        if r.status_code == 401:
            if self._credentials:
                raise RegistryError("registry %s refused the credentials for %s (%s): check `docker login %s` or ORAS_USER/ORAS_PASS" % (self._where(), what, _oci_errors(r), self._where()))
            raise RegistryError("registry %s requires credentials for %s: log in with `docker login %s`, or set ORAS_USER and ORAS_PASS" % (self._where(), what, self._where()))
        if r.status_code == 403:
            raise RegistryError("registry %s denied %s to these credentials (%s)" % (self._where(), what, _oci_errors(r)))
        if r.status_code == 404:
            raise NotFoundError("%s: not found on %s (%s)" % (what, self._where(), _oci_errors(r)))
        raise RegistryError("registry %s answered HTTP %d to %s: %s" % (self._where(), r.status_code, what, _oci_errors(r)))

    def _authenticate(self, r: requests.Response) -> bool:
        """Answer a 401 challenge: basic credentials, or a bearer token fetched with them."""
        challenge = r.headers.get("Www-Authenticate", "")
        if challenge.lower().startswith("basic"):
            return self._credentials is not None and not getattr(r.request, "headers", {}).get("Authorization")
        if challenge.lower().startswith("bearer"):
            params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
            realm = params.pop("realm", None)
            if not realm:
                return False
            try:
                t = self.session.get(realm, params=params, auth=self._credentials, timeout=self.transport.timeout, verify=self.transport.ca_file or True)
            except requests.RequestException:
                return False
            if t.status_code != 200:
                return False
            body = t.json()
            self._bearer = body.get("token") or body.get("access_token")
            return bool(self._bearer)
        return False

    # -- manifests ----------------------------------------------------------------

    def get_manifest(self, reference: str, *, accept: tuple[str, ...] = MANIFEST_TYPES) -> tuple[bytes, str, str]:
        """(bytes, media type, digest) of a manifest, verified when asked for by digest."""
        r = self.request("GET", "%s/manifests/%s" % (self.base, reference), ok=(200,), what="manifest %s:%s" % (self.ref.repository, reference), headers={"Accept": ", ".join(accept)})
        data = r.content
        digest = sha256_bytes(data)
        if reference.startswith("sha256:") and digest != reference:
            raise IntegrityError("registry %s sent a manifest for %s whose digest is %s: refusing it" % (self._where(), short(reference), short(digest)))
        return data, r.headers.get("Content-Type", "").split(";")[0], digest

    def put_manifest(self, data: bytes, media_type: str, reference: str) -> str:
        r = self.request("PUT", "%s/manifests/%s" % (self.base, reference), ok=(201,), what="push of manifest %s" % reference, data=data, headers={"Content-Type": media_type})
        digest = sha256_bytes(data)
        sent = r.headers.get("Docker-Content-Digest")
        if sent and sent != digest:
            raise IntegrityError("registry %s stored manifest %s as %s" % (self._where(), short(digest), short(sent)))
        return digest

    def tags(self) -> list[str]:
        try:
            r = self.request("GET", "%s/tags/list" % self.base, ok=(200,), what="tags of %s" % self.ref.repository)
        except NotFoundError:
            return []
        return sorted(r.json().get("tags") or [])

    # -- blobs ------------------------------------------------------------------

    def blob_exists(self, digest: str) -> bool:
        try:
            self.request("HEAD", "%s/blobs/%s" % (self.base, digest), ok=(200,), what="blob %s" % short(digest))
            return True
        except NotFoundError:
            return False

    def push_blob(self, source: Path, digest: str, size: int, *, state_dir: Path, chunk: int = DEFAULT_CHUNK, tick: Tick | None = None) -> bool:
        """Upload *source* as blob *digest* in chunks, resuming an interrupted upload; False if already there."""
        if self.blob_exists(digest):
            if tick:
                tick(size)
            return False
        state_path = state_dir / ("upload-%s.json" % hashlib.sha256(("%s/%s@%s" % (self.ref.registry, self.ref.repository, digest)).encode()).hexdigest()[:32])
        location, offset = self._resume_point(state_path)
        if location is None:
            r = self.request("POST", "%s/blobs/uploads/" % self.base, ok=(202,), what="start of an upload of %s" % short(digest), headers={"Content-Length": "0"})
            location, offset = urljoin(self.base + "/", r.headers["Location"]), 0
            self._save_state(state_path, location, offset)
        h = hashlib.sha256()
        with open(source, "rb") as f:
            _hash_prefix(f, h, offset)
            if tick and offset:
                tick(offset)
            while True:
                data = f.read(chunk)
                if not data:
                    break
                h.update(data)
                r = self.request(
                    "PATCH", location, ok=(202,), what="upload of %s" % short(digest), data=data,
                    headers={"Content-Type": "application/octet-stream", "Content-Range": "%d-%d" % (offset, offset + len(data) - 1)},
                )  # fmt: skip
                location, offset = urljoin(location, r.headers["Location"]), offset + len(data)
                self._save_state(state_path, location, offset)
                if tick:
                    tick(len(data))
        if "sha256:" + h.hexdigest() != digest or offset != size:
            self._cancel(location, state_path)
            raise IntegrityError("local blob %s does not match its digest (read %s, %d bytes): the local store is damaged; recapture or re-pull" % (short(digest), short("sha256:" + h.hexdigest()), offset))
        sep = "&" if "?" in location else "?"
        self.request("PUT", "%s%sdigest=%s" % (location, sep, digest), ok=(201,), what="completion of the upload of %s" % short(digest), headers={"Content-Length": "0"})
        state_path.unlink(missing_ok=True)
        return True

    def _resume_point(self, state_path: Path) -> tuple[str | None, int]:
        """The registry's own view of an earlier upload session, if it still has one."""
        try:
            state = json.loads(state_path.read_text())
        except (OSError, ValueError):
            return None, 0
        try:
            r = self.request("GET", state["location"], ok=(204,), what="status of an interrupted upload")
        except (NotFoundError, RegistryError):
            state_path.unlink(missing_ok=True)
            return None, 0
        end = int((r.headers.get("Range") or "0-0").split("-")[1])
        received = 0 if end == 0 and state["offset"] == 0 else end + 1
        if received != state["offset"] and not (end == 0 and state["offset"] <= 1):
            # A chunk was cut half-way: the session cannot continue from a known offset.
            state_path.unlink(missing_ok=True)
            return None, 0
        return urljoin(state["location"], r.headers.get("Location") or state["location"]), state["offset"]

    @staticmethod
    def _save_state(path: Path, location: str, offset: int) -> None:
        write_bytes(path, json.dumps({"location": location, "offset": offset}).encode())

    def _cancel(self, location: str, state_path: Path) -> None:
        try:
            self.request("DELETE", location, ok=(204, 404), what="cancel of an upload")
        except RegistryError:
            pass
        state_path.unlink(missing_ok=True)

    def fetch_blob(self, digest: str, size: int, partial: Path, *, tick: Tick | None = None) -> Path:
        """Download blob *digest* into *partial*, resuming what an earlier attempt left; verified."""
        have = partial.stat().st_size if partial.exists() else 0
        if have > size:
            partial.unlink()
            have = 0
        if have < size:
            headers = {"Range": "bytes=%d-" % have} if have else {}
            r = self.request("GET", "%s/blobs/%s" % (self.base, digest), ok=(200, 206), what="blob %s" % short(digest), headers=headers, stream=True)
            mode = "ab" if r.status_code == 206 else "wb"
            if r.status_code == 200:
                have = 0
            if tick and have:
                tick(have)
            partial.parent.mkdir(parents=True, exist_ok=True)
            try:
                with r, open(partial, mode) as out:
                    # Small reads: what arrived before a break is kept for the resume.
                    for data in r.iter_content(256 << 10):
                        out.write(data)
                        if tick:
                            tick(len(data))
            except requests.RequestException as err:
                raise RegistryError("download of blob %s from %s broke off (%s): run the same command again to resume" % (short(digest), self._where(), _reason(err))) from err
        got = hashlib.sha256()
        with open(partial, "rb") as f:
            for data in iter(lambda: f.read(CHUNK), b""):
                got.update(data)
        if partial.stat().st_size != size or "sha256:" + got.hexdigest() != digest:
            partial.unlink(missing_ok=True)
            raise IntegrityError("blob %s from %s does not match its digest (got %s): refused; try again or check the registry" % (short(digest), self._where(), short("sha256:" + got.hexdigest())))
        return partial

    # -- referrers ----------------------------------------------------------------

    def _referrers_api(self, subject: str) -> list[dict[str, Any]] | None:
        """The registry's referrers API answer, or None where it has none (distribution 2.8: 404)."""
        r = self.request("GET", "%s/referrers/%s" % (self.base, subject), ok=(200, 400, 404, 405), what="referrers of %s" % short(subject), headers={"Accept": media.OCI_INDEX})
        if r.status_code == 200 and r.headers.get("Content-Type", "").startswith(media.OCI_INDEX):
            return list(r.json().get("manifests") or [])
        return None

    def referrers(self, subject: str, artifact_type: str | None = None) -> list[dict[str, Any]]:
        """Descriptors of manifests whose subject is *subject*: the referrers API, else the tag schema."""
        found = self._referrers_api(subject)
        if found is None:
            found = self._fallback_index(subject).get("manifests") or []
        return [d for d in found if artifact_type is None or d.get("artifactType") == artifact_type]

    @staticmethod
    def fallback_tag(subject: str) -> str:
        return subject.replace(":", "-")

    def _fallback_index(self, subject: str) -> dict[str, Any]:
        try:
            data, _, _ = self.get_manifest(self.fallback_tag(subject), accept=(media.OCI_INDEX,))
        except NotFoundError:
            return {"schemaVersion": 2, "mediaType": media.OCI_INDEX, "manifests": []}
        return json.loads(data)

    def add_referrer(self, subject: str, descriptor: dict[str, Any]) -> None:
        """Record *descriptor* as a referrer of *subject* where the registry does not do it itself."""
        if self._referrers_api(subject) is not None:
            return
        index = self._fallback_index(subject)
        manifests = [d for d in index.get("manifests") or [] if d.get("digest") != descriptor["digest"]]
        manifests.append(descriptor)
        index = {"schemaVersion": 2, "mediaType": media.OCI_INDEX, "manifests": manifests}
        self.put_manifest(json.dumps(index, sort_keys=True, separators=(",", ":")).encode(), media.OCI_INDEX, self.fallback_tag(subject))


def _hash_prefix(f: BinaryIO, h, length: int) -> None:
    left = length
    while left:
        data = f.read(min(CHUNK, left))
        if not data:
            break
        h.update(data)
        left -= len(data)


def _reason(err: Exception) -> str:
    text = str(err)
    m = re.search(r"\[Errno -?\d+\] ([^'\)]+)", text)
    if m:
        return m.group(1)
    if "Connection refused" in text:
        return "connection refused"
    return text.split(":")[-1].strip()[:120] or type(err).__name__
