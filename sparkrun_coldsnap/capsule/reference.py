"""OCI references: ``registry[:port]/repository[:tag][@sha256:...]``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from sparkrun_coldsnap.digests import is_digest
from sparkrun_coldsnap.errors import RequestError

_REPO_RE = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class Reference:
    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def reference(self) -> str:
        """What goes after /manifests/: the digest when there is one, else the tag."""
        return self.digest or self.tag or "latest"

    def with_tag(self, tag: str) -> Reference:
        return Reference(self.registry, self.repository, tag, None)

    def with_digest(self, digest: str) -> Reference:
        return Reference(self.registry, self.repository, None, digest)

    def __str__(self) -> str:
        out = "%s/%s" % (self.registry, self.repository)
        if self.tag:
            out += ":" + self.tag
        if self.digest:
            out += "@" + self.digest
        return out


def parse(text: str, *, default_tag: str | None = "latest") -> Reference:
    """Parse an OCI reference; the registry part is required (no implicit default registry)."""
    raw = text.strip()
    for scheme in ("oci://", "https://", "http://"):
        if raw.startswith(scheme):
            raw = raw[len(scheme) :]
    digest = None
    if "@" in raw:
        raw, digest = raw.split("@", 1)
        if not is_digest(digest):
            raise RequestError("reference %r has a malformed digest: use @sha256:<64 hex digits>" % text)
    if "/" not in raw:
        raise RequestError("reference %r names no registry: write it as REGISTRY[:PORT]/REPOSITORY[:TAG]" % text)
    registry, path = raw.split("/", 1)
    if not ("." in registry or ":" in registry or registry == "localhost"):
        raise RequestError("reference %r: %r is not a registry host: write it as REGISTRY[:PORT]/REPOSITORY[:TAG]" % (text, registry))
    tag = None
    name, sep, maybe_tag = path.rpartition(":")
    if sep and "/" not in maybe_tag:
        path, tag = name, maybe_tag
        if not _TAG_RE.match(tag):
            raise RequestError("reference %r has an invalid tag %r" % (text, tag))
    if not _REPO_RE.match(path):
        raise RequestError("reference %r has an invalid repository name %r: lower-case letters, digits, separators and '/'" % (text, path))
    if tag is None and digest is None:
        tag = default_tag
    return Reference(registry, path, tag, digest)
