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
from dataclasses import dataclass

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


# -- what a captured engine is given -----------------------------------------------------------
#
# A capture writes the engine's whole memory (its environment block, its argv, every Python
# object) into the capsule's images, and a published capsule hands that memory to whoever can
# pull it. At capture the weights are local and pinned, so the credentials that fetch them (a
# hub token, a registry password) have no use in the engine and are not given to it. A
# credential the engine serves with (``--api-key``) stays: the capsule records its name, and
# publishing it takes ``--allow-secrets``.

#: credentials of the places weights and images are fetched from
_FETCH_RE = re.compile(r"(^|_)(HF|HUB|HUGGING_?FACE|HUGGINGFACEHUB|REGISTRY|DOCKER|ORAS|OCI|GHCR|NGC)(_|$)", re.I)
#: what tells the hub client not to reach the hub (so it reads no token file either)
HUB_OFFLINE = {"HF_HUB_OFFLINE": "1"}


def is_fetch_credential(name: str) -> bool:
    """A credential that fetches weights or images (``HF_TOKEN``, ``--hf-token``, ``REGISTRY_PASSWORD``)."""
    plain = name.lstrip("-").replace("-", "_")
    return is_secret_name(plain) and bool(_FETCH_RE.search(plain))


@dataclass(frozen=True)
class CaptureLaunch:
    """An engine's command and environment as a capture starts it, and the credentials' names:
    ``withheld`` were not given to it, ``held`` were (its memory, so the capsule, holds them)."""

    command: str
    env: dict[str, str]
    withheld: tuple[str, ...]
    held: tuple[str, ...]


def for_capture(command: str, env: Mapping[str, str], *, given: Iterable[str], serving: Iterable[str] = ()) -> CaptureLaunch:
    """*command* and *env* without the credentials a captured engine has no use for.

    Withheld: every credential that fetches weights or images (the weights are local and pinned,
    and the hub client is told to stay offline, so it reads no token file either), and every other
    credential-named variable neither *given* by the workload (the recipe's environment) nor
    one the engine serves with (*serving*, e.g. ``VLLM_API_KEY``): such a variable came from the
    environment of whoever started the capture. The rest is held, by name."""
    given, serving = set(given), set(serving)
    out: dict[str, str] = {}
    withheld: set[str] = set()
    held: set[str] = set()
    for name, value in env.items():
        if not is_secret_name(name):
            out[name] = value
        elif is_fetch_credential(name) or (name not in given and name not in serving):
            withheld.add(name)
        else:
            out[name] = value
            held.add(name)
    out.update(HUB_OFFLINE)
    command, flags_withheld, flags_held = _without_fetch_flags(command)
    return CaptureLaunch(command, out, tuple(sorted(withheld | flags_withheld)), tuple(sorted(held | flags_held)))


def _without_fetch_flags(command: str) -> tuple[str, set[str], set[str]]:
    """*command* without its fetch-credential flags (``--hf-token V``, ``--hf-token=V``); the
    names of those dropped and of the credential flags kept."""
    try:
        argv = shlex.split(command)
    except ValueError:
        return command, set(), set()
    keep: list[str] = []
    dropped: set[str] = set()
    held: set[str] = set()
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        name, eq, _ = arg.partition("=")
        if arg.startswith("-") and is_secret_name(name):
            if is_fetch_credential(name):
                dropped.add(name)
                skip = not eq and i + 1 < len(argv) and not argv[i + 1].startswith("-")
                continue
            held.add(name)
        keep.append(arg)
    return (shlex.join(keep) if dropped else command), dropped, held


def held_by(environ: Mapping[str, str], argv: Sequence[str]) -> tuple[str, ...]:
    """The names of the credentials a running process holds: its credential-named variables
    and flags (a live workload's, read from /proc before it is captured)."""
    names = {k for k in environ if is_secret_name(k)}
    names |= {arg.partition("=")[0] for arg in argv if arg.startswith("-") and is_secret_name(arg.partition("=")[0])}
    return tuple(sorted(names))
