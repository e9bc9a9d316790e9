"""The copies of a checkpoint that containerd leaves on disk after a container starts from it.

To start a container from a checkpoint, containerd unpacks the checkpoint into a new
``ctrd-checkpoint*`` directory under its XDG_RUNTIME_DIR (else TMPDIR, else /tmp) for
runc to restore from, and never removes it. A checkpoint of images would leave a full
copy behind on every restore (2.4 GB for the CPU engine) until the disk fills; the
plugin's checkpoints are links to the staged images (checkpoint_links.py), whose
unpacked copy is only links and CRIU's restore log, but is left all the same. After a
start the plugin removes the copies of its own checkpoint, recognized by content or by
where their links point rather than by age: another restore on the host may be reading
its own copy at that moment.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sparkrun_coldsnap.launch import checkpoint_links

PREFIX = "ctrd-checkpoint"
# Two small images that together name one checkpoint: CRIU's inventory and the
# process tree with its PIDs.
SIGNATURE = ("inventory.img", "pstree.img")


def containerd_temp_dirs(proc: Path = Path("/proc")) -> set[Path]:
    """The directories running containerd daemons make their temporary directories in."""
    found: set[Path] = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "containerd":
                continue
            raw = (entry / "environ").read_bytes().decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        env = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
        found.add(Path(env.get("XDG_RUNTIME_DIR") or env.get("TMPDIR") or "/tmp"))
    return found


def signature(images: Path) -> tuple[bytes, ...] | None:
    try:
        return tuple((images / name).read_bytes() for name in SIGNATURE)
    except OSError:
        return None


def remove_unpacked_copies(images: Path, temp_dirs: set[Path] | None = None) -> list[Path]:
    """Remove containerd's unpacked copies of the checkpoint in *images* (copies of its files,
    or links to them); returns what was removed. Links are removed, never what they point to."""
    mine = signature(images)
    removed = []
    for parent in containerd_temp_dirs() if temp_dirs is None else temp_dirs:
        for entry in sorted(parent.glob(PREFIX + "*")):
            if not entry.is_dir() or entry.is_symlink():
                continue
            if checkpoint_links.points_into(entry, images) or (mine is not None and signature(entry) == mine):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed
