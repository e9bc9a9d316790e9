"""Which values are secrets, and how they are kept out of what the plugin writes.

A value is a secret when the variable or the command-line flag that carries it is named like
a credential (an API key, a hub token, a registry password). Requests keep them (they are the
manager's input); capsules, receipts, logs and recorded commands get their sha256 instead, or
``[redacted]`` in free text such as an error message quoting a log line.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping, Sequence

from sparkrun_coldsnap.digests import sha256_bytes

SECRET_NAME_RE = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_KEY|APIKEY|ACCESS_KEY|PRIVATE_KEY)", re.I)
REDACTED = "[redacted]"


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME_RE.search(name.replace("-", "_")))


def digest_of(value: str) -> str:
    return value if value.startswith("sha256:") else sha256_bytes(value.encode())


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: (digest_of(v) if is_secret_name(k) else v) for k, v in env.items()}


def _flag_secrets(argv: Sequence[str]) -> list[tuple[int, str]]:
    """(index, value) of each value given to a credential-named flag (``--api-key V``, ``--hf-token=V``)
    or as a credential-named assignment (``-e HF_TOKEN=V``, ``HF_TOKEN=V cmd``)."""
    out = []
    for i, arg in enumerate(argv):
        if arg.startswith("-"):
            name, eq, value = arg.partition("=")
            if is_secret_name(name):
                if eq:
                    out.append((i, value))
                elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                    out.append((i + 1, argv[i + 1]))
        else:
            name, eq, value = arg.partition("=")
            if eq and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) and is_secret_name(name):
                out.append((i, value))
    return out


def redact_argv(argv: Sequence[str]) -> list[str]:
    out = list(argv)
    for i, value in _flag_secrets(argv):
        if value and not value.startswith("sha256:"):
            out[i] = out[i][: len(out[i]) - len(value)] + digest_of(value)
    return out


def redact_command(command: str) -> str:
    """A shell command line with its secret values replaced by their digest."""
    try:
        argv = shlex.split(command)
    except ValueError:
        return command
    redacted = redact_argv(argv)
    return command if redacted == argv else shlex.join(redacted)


def values_in(env: Mapping[str, str], commands: Iterable[str]) -> tuple[str, ...]:
    """Every secret value *env* and *commands* carry (for scrubbing free text)."""
    found = {v for k, v in env.items() if is_secret_name(k)}
    for command in commands:
        try:
            found.update(v for _, v in _flag_secrets(shlex.split(command)))
        except ValueError:
            continue
    return tuple(sorted(v for v in found if len(v) >= 4 and not v.startswith("sha256:")))


def scrub(text: str, secrets: Iterable[str]) -> str:
    for s in secrets:
        text = text.replace(s, REDACTED)
    return text
