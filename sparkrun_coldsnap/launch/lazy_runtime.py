"""A docker runtime that is runc, except that it restores memory on demand when asked.

CRIU can restore a process tree before its memory is copied (``--lazy-pages``): a
lazy-pages daemon fills each page when it is first touched and streams the rest
after. The host path does this and answers in about a second; containerd never asks
runc for it, Docker 20.10 has no option for it, and runc's CRIU configuration file
(/etc/criu/runc.conf) applies to every checkpoint and restore on the host.

Docker does let a container name its OCI runtime (``--runtime``, listed under
``runtimes`` in daemon.json, reloaded on SIGHUP). This one is a few lines of shell in
front of runc: for ``restore`` of a checkpoint that carries a live lazy-pages socket
(checkpoint_links.py puts a link to it there), it adds ``--lazy-pages`` and links the
socket where CRIU looks for it; every other call, and every other restore, goes to
runc unchanged. The container stays an ordinary
runc container for docker, containerd and sparkrun.

It also leaves a restored tree stopped, for a memory fill (criu/page_fill.py), when the
checkpoint holds a CRIU configuration file that says ``leave-stopped``
(checkpoint_links.LEAVE_STOPPED). runc (1.1) asks CRIU over RPC and never for a stopped
tree; its only say in CRIU's options is one configuration file (/etc/criu/runc.conf, or
the one a bundle's ``org.criu.config`` annotation names), which would then have to repeat
every option runc.conf sets. But ``criu swrk``, which runc starts with its own
environment, reads the file ``CRIU_CONFIG_FILE`` names before the RPC request and
runc.conf after it: the wrapper exports that variable, and runc.conf's options still
apply. runc's post-restore step only records the restored init's PID; a stopped init
is a running container to runc and containerd.
"""

from __future__ import annotations

from pathlib import Path

from sparkrun_coldsnap.launch.checkpoint_links import LAZY_SOCKET, LEAVE_STOPPED

NAME = "coldsnap-runc"
WRAPPER = Path("/usr/local/sbin/coldsnap-runc")


def script(runc: str) -> str:
    """The wrapper, running *runc* (an absolute path).

    For a restore it asks memory on demand of, it also links the daemon's socket into
    the work directory containerd gives runc (``<bundle>/work``), where CRIU looks for
    it, and when runc fails it keeps CRIU's log beside the images: containerd removes
    the work directory with the failed task.
    """
    return """#!/bin/sh
# runc for containers restored by sparkrun-coldsnap (docker runtime "%(name)s").
# A restore whose checkpoint holds a live %(socket)s gets --lazy-pages (memory on
# demand); one whose checkpoint holds %(stopped)s has CRIU read it (the tree
# stays stopped for a memory fill); every other call goes to runc unchanged.
images= work= sub= prev=
for a in "$@"; do
  case "$prev" in
    --image-path) images=$a ;;
    --work-path) work=$a ;;
  esac
  [ -z "$sub" ] && [ "$a" = restore ] && sub=restore
  prev=$a
done
if [ "$sub" != restore ] || [ -z "$images" ]; then
  exec %(runc)s "$@"
fi
if [ -f "$images/%(stopped)s" ]; then
  # criu swrk reads this file before runc's request, and runc.conf after it.
  CRIU_CONFIG_FILE=$(readlink -f "$images/%(stopped)s")
  export CRIU_CONFIG_FILE
fi
if [ ! -S "$images/%(socket)s" ]; then
  exec %(runc)s "$@"
fi
socket=$(readlink -f "$images/%(socket)s")
if [ -n "$work" ]; then
  mkdir -p "$work" && ln -sfn "$socket" "$work/%(socket)s"
fi
n=$# added=
for a in "$@"; do
  if [ -z "$added" ] && [ "$a" = restore ]; then
    set -- "$@" "$a" --lazy-pages
    added=1
  else
    set -- "$@" "$a"
  fi
done
shift "$n"
%(runc)s "$@"
rc=$?
if [ "$rc" -ne 0 ] && [ -f "${work:-$images}/restore.log" ]; then
  cp "${work:-$images}/restore.log" "${socket%%/*}/restore.log"
fi
exit "$rc"
""" % {"name": NAME, "socket": LAZY_SOCKET, "stopped": LEAVE_STOPPED, "runc": runc}


def installed(runtimes: str) -> bool:
    """Does the daemon know the runtime (*runtimes*: the names ``docker info`` lists, comma-separated)?"""
    return NAME in runtimes.split(",") and WRAPPER.exists()


def leaves_stopped(runtimes: str) -> bool:
    """Does the installed runtime leave a tree stopped when its checkpoint asks? (A wrapper
    written before it could, kept until ``setup --docker`` runs again, does not.)"""
    try:
        return installed(runtimes) and LEAVE_STOPPED in WRAPPER.read_text()
    except OSError:
        return False
