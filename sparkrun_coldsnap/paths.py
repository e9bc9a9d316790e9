"""Where the embedded default keeps its things.

Everything lives under one root, ``$COLDSNAP_HOME`` (default
``~/.local/share/sparkrun-coldsnap``): the private CRIU, the local engine
environments, the tiny model's Hugging Face cache and the capsule store.
Tests point it at a prepared directory while giving sparkrun its own HOME.
"""

from __future__ import annotations

import os
from pathlib import Path

from sparkrun_coldsnap import disk_room


def coldsnap_home() -> Path:
    env = os.environ.get("COLDSNAP_HOME")
    if env:
        return Path(env).expanduser()
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data) / "sparkrun-coldsnap"


def default_store() -> Path:
    env = os.environ.get("COLDSNAP_STORE")
    return Path(env).expanduser() if env else coldsnap_home() / "store"


def criu_prefix() -> Path:
    return coldsnap_home() / "criu"


def engines_dir() -> Path:
    return coldsnap_home() / "engines"


def engine_env_dir(name: str) -> Path:
    return engines_dir() / name


def hf_home() -> Path:
    """The Hugging Face cache sparkrun reads models from (``$HF_HOME``, else ``~/.cache/huggingface``)."""
    env = os.environ.get("HF_HOME")
    return Path(env).expanduser() if env else Path(os.path.expanduser("~")) / ".cache" / "huggingface"


def run_dir() -> Path:
    """Per-workload runtime state (logs of units started by the plugin)."""
    return coldsnap_home() / "run"


def memory_staging(needed_bytes: int) -> Path | None:
    """A directory on tmpfs for unpacked images, if it has room to spare.

    Restoring from memory avoids two costs of a disk staging area: reading
    the images back, and the writeback of freshly unpacked data competing with
    the restore for the disk. Sparse images take only their non-zero bytes.
    """
    root = Path(os.environ.get("COLDSNAP_MEMORY_STAGING", "/dev/shm"))
    if os.environ.get("COLDSNAP_MEMORY_STAGING") == "off":
        return None
    if not root.is_dir():
        return None
    try:
        free = disk_room.free_bytes(root)
    except OSError:
        return None
    if free < 2 * needed_bytes:
        return None
    return root / "coldsnap-staging"
