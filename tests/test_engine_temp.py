"""vLLM's leftovers in /tmp: removed once nothing uses them, never while something does."""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

from sparkrun_coldsnap.host import engine_temp


def old(path: Path) -> Path:
    then = time.time() - 3600
    os.utime(path, (then, then), follow_symlinks=False)
    return path


def bound_socket(directory: Path) -> tuple[socket.socket, Path]:
    path = directory / str(uuid.uuid4())
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(1)
    return s, path


def test_only_unused_old_engine_files_are_removed(tmp_path):
    live, live_path = bound_socket(tmp_path)
    dead, dead_path = bound_socket(tmp_path)
    dead.close()  # a killed engine's socket: the file stays, nothing is bound to it
    stale_dist = tmp_path / ("vllm_dist_" + uuid.uuid4().hex)
    stale_dist.write_text("")
    old(stale_dist)
    young_dist = tmp_path / ("vllm_dist_" + uuid.uuid4().hex)
    young_dist.write_text("")  # an engine that is starting may be about to use it
    open_dist = tmp_path / ("vllm_dist_" + uuid.uuid4().hex)
    open_dist.write_text("")
    held = open(open_dist)
    old(open_dist)
    kept_by_capsule = tmp_path / ("vllm_dist_" + uuid.uuid4().hex)
    kept_by_capsule.write_text("")
    old(kept_by_capsule)
    other = tmp_path / "vllm_dist_not-hex"
    other.write_text("")
    old(other)
    old(live_path)
    old(dead_path)
    try:
        removed = engine_temp.sweep(tmp_path, keep=frozenset({str(kept_by_capsule)}))
        assert sorted(removed) == sorted([dead_path, stale_dist])
        assert live_path.exists() and young_dist.exists() and open_dist.exists() and kept_by_capsule.exists() and other.exists()
    finally:
        live.close()
        held.close()


def test_a_socket_bound_in_another_network_namespace_counts_as_used(tmp_path):
    """A tree restored into a network namespace of its own binds there; the host's /proc/net/unix does not list it."""
    import subprocess
    import sys

    path = tmp_path / str(uuid.uuid4())
    code = "import socket,sys,time; s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(1); print('up', flush=True); time.sleep(60)"
    child = subprocess.Popen(["unshare", "--net", sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        old(path)
        assert engine_temp.sweep(tmp_path) == []
        assert path.exists()
    finally:
        child.kill()
        child.wait()
    assert engine_temp.sweep(tmp_path) == [path]
