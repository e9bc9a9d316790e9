"""Keeper of a tree restored into namespaces of its own (run as ``python -m``; stdlib only).

A host-process tree captured in the host's namespaces comes back here with its
captured PIDs, its ``/dev/shm`` names and its listening port, none of which may
be free on the host (the workload being replaced holds them, or a second
restore of the same capsule does). So the keeper:

* leaves the host's mount and network namespaces, makes every mount private,
  and brings up loopback in the new network namespace;
* forks the init of a new PID namespace, which mounts a ``/proc`` of that
  namespace (the engine reads ``/proc/<getpid()>/...`` and must find itself)
  and a fresh tmpfs on ``/dev/shm``, puts back the saved shared-memory files,
  runs ``criu restore -d`` and then reaps, forwarding SIGTERM to the tree;
* forwards the host port it was given to the captured port inside, from a
  listening socket opened before it left the host's network namespace.

CRIU restores into the namespaces it runs in when the dump was taken in its
own: nothing about the namespaces is in the images. One JSON line on stdout
says how the restore went (``{"root_pid": <host pid>}`` or ``{"error": ...}``);
the keeper then lives as long as the tree.
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import json
import os
import signal
import socket
import struct
import sys
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    rc = _libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags, data.encode() if data else None)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, "mount %s on %s: %s" % (source, target, os.strerror(err)))


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


CHUNK = 1 << 20


def _place_shared(files: list[dict[str, Any]], images: int) -> None:
    """Copy the saved shared-memory files into place, leaving holes where they are zero
    (an engine's ring buffers are mostly empty, and tmpfs holds every byte written)."""
    for f in files:
        os.makedirs(os.path.dirname(f["path"]), exist_ok=True)
        src = os.open(f["stored"], os.O_RDONLY, dir_fd=images)
        dst = os.open(f["path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, f["mode"])
        try:
            while chunk := os.read(src, CHUNK):
                if chunk.count(0) == len(chunk):
                    os.lseek(dst, len(chunk), os.SEEK_CUR)
                else:
                    os.write(dst, chunk)
            os.ftruncate(dst, f["size"])
            os.fchmod(dst, f["mode"])
        finally:
            os.close(src)
            os.close(dst)


def _init(spec: dict[str, Any], report: int) -> int:
    """PID 1 of the new PID namespace: mounts, shared files, criu restore, then reaping."""
    os.setsid()
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    # Opened before the fresh /dev/shm hides them: the images may be staged in memory there.
    images = os.open(spec["images"], os.O_RDONLY | os.O_DIRECTORY)
    log_fd = os.open(spec["log_path"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    out = os.open("restore.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=images)
    for fd in (images, log_fd):
        os.set_inheritable(fd, True)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    _place_shared(spec["shared_files"], images)
    args = list(spec["criu_argv"]) + ["restore", "-D", "/proc/self/fd/%d" % images] + list(spec["restore_args"])
    if spec.get("log_resource"):
        args += ["--inherit-fd", "fd[%d]:%s" % (log_fd, spec["log_resource"])]
    # posix_spawnp: the CRIU command may name its program by name (COLDSNAP_CRIU="sh script ...").
    criu = os.posix_spawnp(args[0], args, dict(spec["env"]), file_actions=[(os.POSIX_SPAWN_DUP2, out, 1), (os.POSIX_SPAWN_DUP2, out, 2)])
    _, status = os.waitpid(criu, 0)
    os.close(log_fd)
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        os.write(report, b"criu %d\n" % rc)
        return 1
    with open(spec["pidfile"]) as f:
        root = int(f.read().strip())
    root_alive = [True]

    def forward(signum: int, _frame: Any) -> None:
        try:
            os.killpg(root, signum)
        except ProcessLookupError:
            os.kill(root, signum) if root_alive[0] else None

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    os.write(report, b"root %d\n" % root)
    os.close(report)
    code = 0
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return code
        if pid == root:
            root_alive[0] = False
            code = os.waitstatus_to_exitcode(status)
            # The namespace ends with its init: whatever the root left behind goes with it.
            return code if code >= 0 else 128 - code


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        try:
            writer.write_eof()
        except OSError:
            pass


async def _connection(outer_r: asyncio.StreamReader, outer_w: asyncio.StreamWriter, inner_port: int) -> None:
    """One client: a connection made now belongs to the new network namespace, where the tree listens."""
    try:
        inner_r, inner_w = await asyncio.open_connection("127.0.0.1", inner_port)
    except OSError:
        outer_w.close()
        return
    try:
        await asyncio.gather(_pump(outer_r, inner_w), _pump(inner_r, outer_w))
    finally:
        inner_w.close()
        outer_w.close()


async def _keep(init: int, listener: socket.socket | None, inner_port: int) -> int:
    """Forward the port until the namespace's init ends; SIGTERM goes to the init, which hands it on.

    asyncio, not threads: once it has unshared a PID namespace a process can no longer
    start threads (they would live in another namespace than their process).
    """
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[int] = loop.create_future()

    def child() -> None:
        pid, status = os.waitpid(init, os.WNOHANG)
        if pid == init and not ended.done():
            ended.set_result(os.waitstatus_to_exitcode(status))

    loop.add_signal_handler(signal.SIGCHLD, child)
    loop.add_signal_handler(signal.SIGTERM, os.kill, init, signal.SIGTERM)
    loop.add_signal_handler(signal.SIGINT, os.kill, init, signal.SIGTERM)
    child()  # it may have ended before the handler was there
    server = None
    if listener is not None:
        server = await asyncio.start_server(lambda r, w: _connection(r, w, inner_port), sock=listener)
    code = await ended
    if server is not None:
        server.close()
    return code & 0xFF


def _host_pid(host_proc: int, init_pid: int, ns_pid: int) -> int:
    """The host PID of the process that is *ns_pid* inside the namespace *init_pid* leads.

    Read through the host's /proc (*host_proc*, a directory descriptor opened before the
    keeper left the host's mount namespace): the /proc mounted now is the namespace's.
    """

    def opener(path: str, flags: int) -> int:
        return os.open(path, flags, dir_fd=host_proc)

    with open("%d/task/%d/children" % (init_pid, init_pid), opener=opener) as f:
        children = [int(p) for p in f.read().split()]
    for pid in children:
        with open("%d/status" % pid, opener=opener) as f:
            for line in f:
                if line.startswith("NSpid:") and int(line.split()[-1]) == ns_pid:
                    return pid
    raise LookupError("restored root %d not found among the children of %d" % (ns_pid, init_pid))


def main() -> int:
    spec = json.loads(sys.stdin.read())
    listener = None
    if spec.get("host_port"):
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((spec.get("host_address", "0.0.0.0"), spec["host_port"]))
        except OSError as err:
            print(json.dumps({"error": "port %d: %s" % (spec["host_port"], err.strerror)}), flush=True)
            return 1
        listener.listen(128)
    host_proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)
    os.unshare(CLONE_NEWNS | CLONE_NEWPID | (CLONE_NEWNET if listener else 0))
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    if listener:
        _loopback_up()
    r, w = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(r)
        try:
            code = _init(spec, w)
        except BaseException as err:  # noqa: BLE001 - reported to the keeper, then the init ends
            os.write(w, ("init %s\n" % err).encode())
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r) as pipe:
        said = pipe.readline().split(None, 1)
    if not said or said[0] != "root":
        os.waitpid(init, 0)
        what = " ".join(said) or "the namespace's init ended"
        print(json.dumps({"error": what}), flush=True)
        return 1
    try:
        root = _host_pid(host_proc, init, int(said[1]))
    except (OSError, LookupError, ValueError) as err:
        os.kill(init, signal.SIGKILL)  # the namespace, and the tree in it, end with its init
        os.waitpid(init, 0)
        print(json.dumps({"error": "restored tree not found: %s" % err}), flush=True)
        return 1
    print(json.dumps({"root_pid": root, "keeper_pid": os.getpid()}), flush=True)
    sys.stdout.close()
    return asyncio.run(_keep(init, listener, spec.get("inner_port") or 0))


if __name__ == "__main__":
    sys.exit(main())
