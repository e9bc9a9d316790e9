"""containerd's unpacked checkpoint copies: found where containerd puts them, removed only when they are ours."""

from __future__ import annotations

from pathlib import Path

from sparkrun_coldsnap.launch import checkpoint_leftovers


def images(path, inventory: bytes, pstree: bytes):
    path.mkdir(parents=True)
    (path / "inventory.img").write_bytes(inventory)
    (path / "pstree.img").write_bytes(pstree)
    (path / "pages-1.img").write_bytes(b"\0" * 4096)
    return path


def test_only_copies_of_this_checkpoint_are_removed(tmp_path):
    ours = images(tmp_path / "capsule" / "images", b"inv", b"tree-42")
    temp = tmp_path / "tmp"
    copy = images(temp / "ctrd-checkpoint111", b"inv", b"tree-42")
    other = images(temp / "ctrd-checkpoint222", b"inv", b"tree-77")  # another restore's, maybe still in use
    unrelated = images(temp / "something-else", b"inv", b"tree-42")
    removed = checkpoint_leftovers.remove_unpacked_copies(ours, {temp})
    assert removed == [copy] and not copy.exists()
    assert other.exists() and unrelated.exists() and ours.exists()


def test_without_images_nothing_is_removed(tmp_path):
    temp = tmp_path / "tmp"
    copy = images(temp / "ctrd-checkpoint111", b"inv", b"tree-42")
    assert checkpoint_leftovers.remove_unpacked_copies(tmp_path / "missing", {temp}) == []
    assert copy.exists()


def fake_process(proc, pid: int, comm: str, env: dict[str, str]):
    d = proc / str(pid)
    d.mkdir(parents=True)
    (d / "comm").write_text(comm + "\n")
    (d / "environ").write_bytes(b"\0".join(("%s=%s" % kv).encode() for kv in env.items()) + b"\0")


def test_containerd_temp_dirs_follow_its_environment(tmp_path):
    proc = tmp_path / "proc"
    fake_process(proc, 10, "containerd", {"PATH": "/usr/bin"})
    fake_process(proc, 11, "containerd", {"TMPDIR": "/var/tmp/ctrd"})
    fake_process(proc, 12, "containerd", {"TMPDIR": "/ignored", "XDG_RUNTIME_DIR": "/run/user/0"})
    fake_process(proc, 13, "containerd-shim", {"TMPDIR": "/not-containerd"})
    (proc / "self").mkdir()
    assert checkpoint_leftovers.containerd_temp_dirs(proc) == {Path("/tmp"), Path("/var/tmp/ctrd"), Path("/run/user/0")}
