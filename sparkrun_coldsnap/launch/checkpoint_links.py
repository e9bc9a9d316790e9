"""A container checkpoint that docker hands to the runtime by name, not by content.

``docker start --checkpoint`` does not give runc the checkpoint directory: dockerd tars
it into containerd's content store (hashed, written, synced), and containerd unpacks
that blob into a new ``ctrd-checkpoint*`` directory for runc. For the CPU engine's
2.6 GB of images that is two full writes and three full reads before CRIU starts, on
the restore's clock (about 30 s on a 2-core host).

Here the checkpoint directory holds symbolic links to the staged images instead. The
tar, the content store and the unpacked copy then carry only names; CRIU opens every
image relative to the directory runc gives it, follows the links and reads the staged
files in place.

The links climb to the root and come down again (``../../../…/dev/shm/…``) rather than
being absolute: CRIU opens some images (the page maps, the pages) from the processes
it is restoring, whose root is the container's by then, and an absolute link would be
looked up in the container. Climbed from the unpacked copy, which lies outside the
container, the ``..`` steps reach the host's root wherever containerd put the copy
(more of them than the copy is deep changes nothing: ``..`` of the root is the root).

A ``lazy-pages.socket`` link says that memory comes on demand, and from where: the
runtime in front of runc (lazy_runtime.py) sees it in the unpacked copy. A
``criu-leave-stopped.conf`` (a CRIU configuration file in the images, linked like them)
asks the same runtime to have CRIU leave the tree stopped, for a memory fill.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

#: CRIU's name for the lazy-pages daemon's socket, looked up in its work directory.
LAZY_SOCKET = "lazy-pages.socket"
#: A CRIU configuration file that leaves the restored tree stopped (see lazy_runtime.py).
LEAVE_STOPPED = "criu-leave-stopped.conf"
#: What the staged images hold beside CRIU's images, which the runtime must not see.
PRIVATE_PREFIX = "coldsnap-"
#: CRIU's own logs of the dump: not images, and a restore writes its own.
DUMP_LOGS = ("dump.log", "stats-dump")
#: How far a link climbs before it comes down to its target: deeper than any directory
#: containerd unpacks into.
CLIMB = "../" * 64


def link_target(path: Path) -> str:
    """What a link to *path* holds: the climb to the root, then *path* (see above)."""
    return CLIMB + str(path.resolve()).lstrip("/")


def linked_path(target: str) -> Path:
    """The path a link made by ``link_target`` names."""
    while target.startswith("../"):
        target = target[3:]
    return Path("/" + target.lstrip("/"))


def home_for(staged: Path, container_name: str) -> Path:
    """Where a prepared container keeps its images: beside the staging directory they were
    unpacked into (*staged* is ``<staging>/units/<unit>``), on the same file system."""
    return staged.parents[1].with_name("%s.images" % container_name)


def own_images(staged: Path, home: Path) -> Path:
    """Move the staged images to *home*: a rename, nothing is copied. The staging directory
    can then go, and the images live until the restore is done with them."""
    os.rename(staged, home)
    return home


def link_images(images: Path, checkpoint_dir: Path, *, lazy: bool) -> int:
    """Fill *checkpoint_dir* with one link per image in *images*; returns how many.

    With *lazy*, also a link to the lazy-pages daemon's socket in *images* (the daemon
    creates it there when it starts, just before the restore).
    """
    checkpoint_dir.mkdir(parents=True)
    count = 0
    for entry in sorted(images.iterdir()):
        if entry.name.startswith(PRIVATE_PREFIX) or entry.name in DUMP_LOGS or entry.name == LAZY_SOCKET:
            continue
        os.symlink(link_target(entry), checkpoint_dir / entry.name)
        count += 1
    if lazy:
        os.symlink(link_target(images / LAZY_SOCKET), checkpoint_dir / LAZY_SOCKET)
    return count


def ask_leave_stopped(images: Path) -> None:
    """Put in *images* the configuration file that has the runtime's CRIU leave the tree stopped."""
    (images / LEAVE_STOPPED).write_text("leave-stopped\n")


def points_into(copy: Path, images: Path) -> bool:
    """Is *copy* (a directory containerd unpacked) made of links into *images*?

    Told by the link target of CRIU's inventory, which stays readable as a link even
    after *images* is gone (memory on demand removes them once every page is delivered).
    """
    try:
        return linked_path(os.readlink(copy / "inventory.img")) == images.resolve() / "inventory.img"
    except OSError:
        return False


def remove(images: Path | None) -> None:
    if images is not None:
        shutil.rmtree(images, ignore_errors=True)
