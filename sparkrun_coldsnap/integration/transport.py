"""Commands and files on a cluster's hosts, through sparkrun's own transport.

sparkrun owns hosts, credentials and transport, so the plugin never opens SSH itself: it
asks sparkrun for the executable session of the cluster (``open_cluster_host_session``,
part of sparkrun's plugin API) after the cluster's transport is prepared (a provider
transport may refresh addresses or keys) and with the SSH settings scoped to the cluster
(its ``user`` over ``ssh.user``; ``ssh.key`` and ``ssh.options`` from config.yaml). SSH
runs underneath; a host that is this machine runs locally, as sparkrun decides.

sparkrun internals used here: ``sparkrun.api._resolve`` (``resolve_cluster``,
``scope_operation``), the way sparkrun's own API resolves a cluster and its SSH settings.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

from sparkrun_coldsnap.errors import RequestError, ToolError
from sparkrun_coldsnap.host.runner import Completed


class ClusterHosts:
    """A cluster's hosts in rank order, and sparkrun's session to them; close it when done."""

    def __init__(self, hosts: Sequence[str], session: Any, cluster: str = "") -> None:
        self.hosts = tuple(hosts)
        self.cluster = cluster
        self._session = session

    def run(self, host: str, argv: Sequence[str], *, timeout: float = 300.0, input: bytes | None = None, check: bool = True) -> Completed:
        """Run *argv* on *host*; a non-zero exit raises ToolError naming the host when *check*."""
        from sparkrun.plugins import HostSessionError

        self._known(host)
        argv = [str(a) for a in argv]
        try:
            res = self._session.execute(host, argv, input_data=input, timeout=timeout)
        except HostSessionError as err:
            raise ToolError("on host %s: %s: %s" % (host, shlex.join(argv), err)) from err
        done = Completed(tuple(argv), res.returncode, res.stdout.decode(errors="replace"), res.stderr.decode(errors="replace"))
        if check and done.returncode != 0:
            # 255 is ssh's own failure (unreachable, refused key), not the command's.
            what = "ssh to %s failed" % host if done.returncode == 255 else "on host %s: %s failed (exit %d)" % (host, argv[0], done.returncode)
            raise ToolError("%s: %s" % (what, done.tail()))
        return done

    def read_range(self, host: str, path: str, offset: int, length: int, *, timeout: float = 600.0) -> bytes:
        """*length* bytes of file *path* on *host* from *offset*, as they are (no decoding)."""
        from sparkrun.plugins import HostSessionError

        self._known(host)
        script = "dd if=%s bs=1M skip=%d count=%d iflag=skip_bytes,count_bytes status=none" % (shlex.quote(path), offset, length)
        try:
            res = self._session.execute(host, ["sh", "-c", script], timeout=timeout)
        except HostSessionError as err:
            raise ToolError("reading %s on host %s failed: %s" % (path, host, err)) from err
        if res.returncode != 0:
            raise ToolError("reading %s on host %s failed: %s" % (path, host, res.stderr.decode(errors="replace").strip()[-300:] or "exit %d" % res.returncode))
        return bytes(res.stdout)

    def upload(self, host: str, sources: Sequence[str], destination: str, *, recursive: bool = False) -> None:
        """Copy local *sources* to *destination* on *host* (scp underneath)."""
        from sparkrun.plugins import HostSessionError

        self._known(host)
        try:
            self._session.upload(host, [str(s) for s in sources], destination, recursive=recursive)
        except HostSessionError as err:
            raise ToolError("upload to host %s failed: %s" % (host, err)) from err

    def close(self) -> None:
        self._session.close()

    def __enter__(self) -> ClusterHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _known(self, host: str) -> None:
        # A session reaches any address; the plugin only ever acts on the cluster's own hosts.
        if host not in self.hosts:
            raise ToolError("host %s is not one of cluster %r's hosts (%s)" % (host, self.cluster, ", ".join(self.hosts)))


def open_cluster(cluster: str | None = None, hosts: Sequence[str] | None = None) -> ClusterHosts:
    """sparkrun's session to a named cluster (or to *hosts*, or the default cluster)."""
    from sparkrun.api._resolve import resolve_cluster

    try:
        definition = resolve_cluster(cluster, list(hosts) if hosts is not None else None)
    except Exception as err:  # sparkrun's SparkrunError / HostsUnreachable: one line either way
        raise RequestError("%s: name a cluster (sparkrun cluster list) or hosts" % (str(err).strip() or type(err).__name__)) from err
    return _open(definition, tuple(definition.hosts), sctx=None)


def open_for(actx: Any) -> ClusterHosts:
    """sparkrun's session to the hosts a launch was placed on, in rank order."""
    return _open(actx.execution.plan.cluster, tuple(actx.hosts), sctx=actx.execution.sctx)


def _open(definition: Any, hosts: tuple[str, ...], *, sctx: Any) -> ClusterHosts:
    from sparkrun.api._resolve import scope_operation
    from sparkrun.plugins import open_cluster_host_session

    try:
        _, ssh_kwargs = scope_operation(definition, sctx=sctx)
        session = open_cluster_host_session(definition, ssh_kwargs=ssh_kwargs)
    except Exception as err:  # a transport that cannot prepare (disabled provider, vanished host)
        raise ToolError("cannot reach the hosts of cluster %r: %s" % (getattr(definition, "name", "") or ",".join(hosts), err)) from err
    return ClusterHosts(hosts, session, cluster=getattr(definition, "name", "") or "")
