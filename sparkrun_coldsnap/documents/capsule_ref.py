"""A capsule's identity in a store: its name and tag, checked once, written ``name:tag``.

The recipe block, the request documents, the store and the lifecycle's records all name a
capsule with this one type, so a name that climbs out of a directory (``../../x``) or a tag
with a space is refused where it enters, with the field it came in, and ``name:tag`` is
parsed and written in one place.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field

from sparkrun_coldsnap.documents.strict import Strict
from sparkrun_coldsnap.documents.values import shown
from sparkrun_coldsnap.errors import RequestError

NAME_PATTERN = r"^[a-z0-9]+(?:[._-][a-z0-9]+)*$"
TAG_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$"
_NAME_RE = re.compile(NAME_PATTERN)
_TAG_RE = re.compile(TAG_PATTERN)
DEFAULT_TAG = "latest"
#: longest capsule name: a path component of the store with room for what is added to it
MAX_NAME = 128


def check_capsule_name(value: str) -> str:
    if len(value) > MAX_NAME:
        raise ValueError("capsule name %s is longer than %d characters" % (shown(value), MAX_NAME))
    if not _NAME_RE.match(value):
        raise ValueError("capsule name %s must be lower-case letters, digits and . _ - separators" % shown(value))
    return value


def check_tag(value: str) -> str:
    if not _TAG_RE.match(value):
        raise ValueError("tag %s must match [A-Za-z0-9_][A-Za-z0-9._-]{0,127}" % shown(value))
    return value


#: a capsule name, as a field of a document (the pattern goes into its JSON Schema too)
CapsuleNameField = Annotated[str, AfterValidator(check_capsule_name), Field(json_schema_extra={"pattern": NAME_PATTERN, "maxLength": MAX_NAME})]
#: a capsule tag, as a field of a document
TagField = Annotated[str, AfterValidator(check_tag), Field(json_schema_extra={"pattern": TAG_PATTERN})]


class CapsuleRef(Strict):
    """A capsule's name and tag: an object of the two in a document, name:tag in text."""

    name: CapsuleNameField = Field(description="Capsule name in the store: lower-case letters, digits and . _ - separators.")
    tag: TagField = Field(DEFAULT_TAG, description="Tag of the capsule.")

    @classmethod
    def parse(cls, text: str, *, what: str = "capsule reference") -> CapsuleRef:
        """``name[:tag]`` (the tag ``latest`` when none is written), or a one-line RequestError
        naming *what* was given."""
        name, sep, tag = text.rpartition(":")
        if not sep:
            name, tag = text, DEFAULT_TAG
        return cls.of(name, tag, what="%s %s" % (what, shown(text)), fix="write it as NAME[:TAG]")

    @classmethod
    def of(cls, name: str, tag: str = DEFAULT_TAG, *, what: str = "capsule", fix: str = "rename it") -> CapsuleRef:
        """*name* and *tag* checked, or a one-line RequestError naming *what* carried them."""
        try:
            return cls(name=check_capsule_name(name), tag=check_tag(tag))
        except ValueError as err:
            raise RequestError("%s: %s: %s" % (what, err, fix)) from None

    @property
    def ref(self) -> str:
        """``name:tag``: how the store's index, receipts and messages write it."""
        return "%s:%s" % (self.name, self.tag)

    def with_tag(self, tag: str) -> CapsuleRef:
        """The same capsule name under *tag* (checked like any tag)."""
        return CapsuleRef(name=self.name, tag=tag)

    def __str__(self) -> str:
        return self.ref
