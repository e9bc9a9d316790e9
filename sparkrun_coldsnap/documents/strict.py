"""The strict base model and one-line messages for pydantic errors."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer
from pydantic import ValidationError as PydanticValidationError


class Strict(BaseModel):
    """Unknown keys are errors and documents do not change once built."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Sparse(Strict):
    """A strict record whose unset (None) fields are left out of its JSON: one written before a
    field existed reads and writes back unchanged."""

    # No return annotation: the JSON Schema stays the fields' own, not a free-form object.
    @model_serializer(mode="wrap")
    def _without_unset(self, handler: SerializerFunctionWrapHandler):
        return {k: v for k, v in handler(self).items() if v is not None}


def one_line(err: PydanticValidationError, *, prefix: str, known: dict[str, list[str]] | None = None) -> str:
    """Summarize every pydantic error of *err* on one line.

    ``prefix`` names the input (a recipe path and block); ``known`` maps a
    dotted location to the keys allowed there, so an unknown key comes with
    the list the user should have picked from.
    """
    parts: list[str] = []
    for e in err.errors():
        loc = ".".join(_place(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            parent = ".".join(str(p) for p in e["loc"][:-1])
            allowed = (known or {}).get(parent)
            hint = "; allowed keys: %s" % ", ".join(sorted(allowed)) if allowed else ""
            parts.append("unknown key %r%s" % (loc, hint))
        elif e["type"] == "literal_error":
            parts.append("%s: %s" % (loc, e["msg"].lower()))
        else:
            parts.append("%s: %s" % (loc or "value", e["msg"].lower()))
    return "%s: %s" % (prefix, "; ".join(parts))


def _place(part: str | int) -> str:
    """One step of an error's location; a key the document chose is quoted when it is not plain,
    so a newline or a long key in the input cannot break the message's one line."""
    text = str(part)
    if isinstance(part, int) or _PLAIN_KEY.match(text):
        return text
    return repr(text) if len(text) <= 40 else "%r... (%d characters)" % (text[:40], len(text))


_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_\[\]-]{1,64}$")


def allowed_keys(model: type[BaseModel], path: str = "") -> dict[str, list[str]]:
    """Map each nested model location of *model* to its field names."""
    out = {path: list(model.model_fields)}
    for name, field in model.model_fields.items():
        ann = field.annotation
        for candidate in getattr(ann, "__args__", (ann,)):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                out.update(allowed_keys(candidate, "%s.%s" % (path, name) if path else name))
    return out
