"""Where the embedded default keeps its things.

Everything lives under one root, the settings' ``home`` (``$COLDSNAP_HOME``, default
``~/.local/share/sparkrun-coldsnap``): the private CRIU, the local engine
environments, the run state and the capsule store.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from sparkrun_coldsnap.documents.settings import current
from sparkrun_coldsnap.host import disk_room


def coldsnap_home() -> Path:
    return current().home


def default_store() -> Path:
    return current().store


def criu_prefix() -> Path:
    return coldsnap_home() / "criu"


def engines_dir() -> Path:
    return coldsnap_home() / "engines"


def engine_env_dir(name: str) -> Path:
    return engines_dir() / name


def hf_home() -> Path:
    """The Hugging Face cache sparkrun reads models from (``$HF_HOME``, else ``~/.cache/huggingface``)."""
    return current().hf_home


def hf_snapshot_dir(model_id: str, revision: str, hub_home: Path | str | None = None) -> Path:
    """Where the Hugging Face cache keeps *revision* of *model_id* (``models--ORG--NAME/snapshots/REV``)."""
    return Path(hub_home if hub_home is not None else hf_home()) / "hub" / ("models--" + model_id.replace("/", "--")) / "snapshots" / revision


def run_dir() -> Path:
    """Per-workload runtime state (logs of units started by the plugin)."""
    return coldsnap_home() / "run"


def memory_staging(needed_bytes: int) -> Path | None:
    """A directory on tmpfs for unpacked images, if it has room to spare.

    Restoring from memory avoids two costs of a disk staging area: reading
    the images back, and the writeback of freshly unpacked data competing with
    the restore for the disk. Sparse images take only their non-zero bytes.
    """
    root = current().memory_staging
    if root is None or not root.is_dir():
        return None
    try:
        free = disk_room.free_bytes(root)
    except OSError:
        return None
    if free < 2 * needed_bytes:
        return None
    return root / MEMORY_STAGING


MEMORY_STAGING = "coldsnap-staging"


def restore_pidfile(unit_name: str) -> Path:
    """Where ``criu restore`` writes the PID of the tree it restored: in memory where the host
    has a memory staging folder (on a node with nothing prepared the disk is busy with the
    weights' reads, and a new file there waited for them), else in the run folder. Not among
    the images: memory on demand removes those as soon as the last page is delivered, which
    for a small tree can come before the file is read."""
    root = current().memory_staging
    folder = root if root is not None and root.is_dir() and os.access(root, os.W_OK) else run_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return folder / ("coldsnap-restore-%d-%s.pid" % (os.getpid(), unit_name))


def new_memory_staging(memory: Path, prefix: str) -> Path:
    """A private directory under *memory* (``.../coldsnap-staging``), made even while another
    operation removes that folder for being empty (see :func:`remove_staging`)."""
    for _ in range(10):
        memory.mkdir(parents=True, exist_ok=True)
        try:
            return Path(tempfile.mkdtemp(prefix=prefix, dir=memory))
        except FileNotFoundError:
            continue  # emptied and removed between the two calls: make it again
    raise OSError("cannot make a staging directory under %s" % memory)


def remove_staging(directory: Path) -> None:
    """Remove a staging directory, and the memory staging folder above it once that is empty:
    /dev/shm is the host's, and a folder left there (empty or not) is memory nobody frees."""
    shutil.rmtree(directory, ignore_errors=True)
    parent = Path(directory).parent
    if parent.name == MEMORY_STAGING:
        try:
            parent.rmdir()  # fails, as it should, while another operation's directory is in it
        except OSError:
            pass
