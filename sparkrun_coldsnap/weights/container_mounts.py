"""The directories a container's engine reads native weights from, mounted at capture and restore alike.

A host-process engine reaches the native payload where the plugin keeps it. An engine in a
container sees only what the container's spec mounts, and CRIU restores a container only into
the mounts it was checkpointed with (runc declares every bind mount to CRIU as external, by its
path in the container). So a GPU container gets three bind mounts at capture, each at the same
path inside as outside, and a restore mounts this host's directories at the paths recorded:

- ``engine_side``: the worker extension vLLM imports (read only);
- ``native``: the payload root, where the engine writes its payload at capture and reads it back;
- ``memory``: where preparation copies the payload into memory.

The copy into memory cannot be the host path's tmpfs of its own per restore: docker names a
container's mounts when it creates it, before that copy exists, and binds a directory without the
file systems mounted under it later. Containers share one tmpfs instead, mounted once at a
fixed path (:func:`shared_root`); each restore's copy is a directory in it.

The engine is handed host paths (the payload's directory, the copy's), which are its own paths
as long as this host keeps them where the capture's host did; where it does not, native weights
are refused for the capsule and ``auto`` takes recovery (:func:`problem`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.weights import native_payload
from sparkrun_coldsnap.weights.engine_side import DIRECTORY as ENGINE_SIDE_DIR

#: The roles, and which are read only in the container.
ROLES = ("engine_side", "native", "memory")
READ_ONLY = frozenset({"engine_side"})
#: Roles whose paths the engine is handed at restore: they must be where the capture had them.
HANDED_TO_ENGINE = ("native", "memory")


def shared_root() -> Path:
    """The one tmpfs that restores into containers copy their payloads into."""
    return paths.run_dir() / "weights-memory-shared"


def host_dirs() -> dict[str, Path]:
    """This host's directory for each role."""
    return {"engine_side": ENGINE_SIDE_DIR, "native": native_payload.root(), "memory": shared_root()}


def for_capture() -> dict[str, str]:
    """The mounts a capture's container gets: role -> path in the container (the host's own)."""
    return {role: str(path) for role, path in host_dirs().items()}


def volume_args(recorded: Mapping[str, str]) -> list[str]:
    """``docker create`` arguments binding this host's directories at the recorded paths."""
    dirs = host_dirs()
    args: list[str] = []
    for role in ROLES:
        if role in recorded:
            args += ["-v", "%s:%s%s" % (dirs[role], recorded[role], ":ro" if role in READ_ONLY else "")]
    return args


def problem(recorded: Mapping[str, str] | None) -> str | None:
    """Why a restore of a container captured with *recorded* mounts cannot hand its engine
    native weights on this host; None when it can."""
    if not recorded:
        return "the container was captured without the native payload's mounts"
    here = host_dirs()
    for role in HANDED_TO_ENGINE:
        if recorded.get(role) != str(here[role]):
            return "the container was captured with the %s directory at %s, this host keeps it at %s" % (role, recorded.get(role), here[role])
    return None
