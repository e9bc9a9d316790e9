"""The value types of document fields that become a path, a host, a command or an environment.

A request document comes from another program (``--request FILE``), so each field that ends
up as a directory name, an ssh target, a command line or a process's environment is checked
where the document is read, by its type: one rule for the recipe block and the request alike.
A refused value is named by its field; a long one is quoted only in part, so the message stays
one short line.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field

#: a path component the plugin makes (a unit's images, an engine environment, a log file)
NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$"
#: an adapter, runtime or driver name
IDENT_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$"
#: a host as ssh and sparkrun name it: a name, an address, user@host; never an option (-o...)
HOST_PATTERN = r"^[A-Za-z0-9_\[][A-Za-z0-9_.:%@\[\]-]{0,252}$"
#: an environment variable's name
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,255}$"
#: an accelerator index or id (CUDA_VISIBLE_DEVICES takes either; a MIG id has / and :)
DEVICE_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_:/.-]{0,127}$"
#: docker's --shm-size
SIZE_PATTERN = r"^[0-9]{1,15}[bkmgBKMG]?$"

MAX_TEXT = 1 << 16  # a command line or an environment value
MAX_PATH = 4096  # PATH_MAX
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def shown(value: str, limit: int = 40) -> str:
    """*value* quoted for a message, cut to *limit* characters with its length said."""
    return repr(value) if len(value) <= limit else "%r... (%d characters)" % (value[:limit], len(value))


def _matching(pattern: str, what: str, rule: str):
    rx = re.compile(pattern)

    def check(value: str) -> str:
        if not rx.match(value):
            raise ValueError("%s %s must be %s" % (what, shown(value), rule))
        return value

    return check


def _no_nul(limit: int, what: str):
    def check(value: str) -> str:
        if "\x00" in value:
            raise ValueError("%s %s holds a NUL byte" % (what, shown(value)))
        if len(value) > limit:
            raise ValueError("%s %s is longer than %d characters" % (what, shown(value), limit))
        return value

    return check


def _plain_text(limit: int, what: str):
    nul = _no_nul(limit, what)

    def check(value: str) -> str:
        nul(value)
        if _CONTROL.search(value):
            raise ValueError("%s %s holds a control character" % (what, shown(value)))
        return value

    return check


def _absolute(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError("path %s is not absolute" % shown(value))
    return value


def _volume_side(value: str) -> str:
    # docker -v HOST:CONTAINER[:OPTIONS]: a colon would add options the recipe did not give
    if ":" in value:
        raise ValueError("volume %s holds a ':' (docker reads it as a separator)" % shown(value))
    return value


#: a path component: a unit's name, an engine environment, the workload's record name
PathName = Annotated[str, AfterValidator(_matching(NAME_PATTERN, "name", "1 to 128 letters, digits and . _ - (not starting with . or -)")), Field(json_schema_extra={"pattern": NAME_PATTERN})]
#: an engine adapter, runtime or driver name
Ident = Annotated[str, AfterValidator(_matching(IDENT_PATTERN, "name", "1 to 64 letters, digits and . _ - (not starting with . or -)")), Field(json_schema_extra={"pattern": IDENT_PATTERN})]
#: a host a unit runs on
HostName = Annotated[str, AfterValidator(_matching(HOST_PATTERN, "host", "a host name or address (user@ allowed), not starting with -")), Field(json_schema_extra={"pattern": HOST_PATTERN})]
#: an environment variable's name
EnvName = Annotated[str, AfterValidator(_matching(ENV_NAME_PATTERN, "variable name", "letters, digits and _, not starting with a digit")), Field(json_schema_extra={"pattern": ENV_NAME_PATTERN})]
#: an accelerator index or id
Device = Annotated[str, AfterValidator(_matching(DEVICE_PATTERN, "device", "an accelerator index or id (letters, digits and _ - . : /)")), Field(json_schema_extra={"pattern": DEVICE_PATTERN})]
#: a memory size for docker
Size = Annotated[str, AfterValidator(_matching(SIZE_PATTERN, "size", "a number with an optional unit b, k, m or g")), Field(json_schema_extra={"pattern": SIZE_PATTERN})]
#: a command line (newlines and tabs allowed: a rendered command may span lines)
CommandText = Annotated[str, AfterValidator(_no_nul(MAX_TEXT, "command")), Field(max_length=MAX_TEXT)]
#: an environment variable's value
EnvValue = Annotated[str, AfterValidator(_no_nul(MAX_TEXT, "value")), Field(max_length=MAX_TEXT)]
#: a short one-line label (a recipe's name, a model id, a container label)
Label = Annotated[str, AfterValidator(_plain_text(1024, "value")), Field(max_length=1024)]
#: a file-system path
PathText = Annotated[str, AfterValidator(_plain_text(MAX_PATH, "path")), Field(max_length=MAX_PATH)]
#: an absolute file-system path
AbsolutePath = Annotated[str, AfterValidator(_plain_text(MAX_PATH, "path")), AfterValidator(_absolute), Field(max_length=MAX_PATH)]
#: one side of a container volume (a host path or a named volume; the container's path)
VolumePath = Annotated[str, AfterValidator(_plain_text(MAX_PATH, "volume")), AfterValidator(_volume_side), Field(min_length=1, max_length=MAX_PATH)]
