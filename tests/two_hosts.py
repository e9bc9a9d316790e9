"""Two hosts on this machine: network namespaces reached over SSH, as sparkrun reaches a cluster.

Each host is a network namespace with its own address from 198.18.0.0/15 (set aside for
benchmarking, used by no real network) and its own sshd, started here with host and client
keys made in a temporary directory. The hosts sit on a switch: a bridge inside a third
namespace, with one veth pair to each host and one to this machine's own namespace, where
sparkrun (the control machine) runs. The bridge lives in a namespace of its own because
bridged traffic passes the iptables FORWARD chain of the namespace holding the bridge
(``bridge-nf-call-iptables``), and dockerd sets that chain's policy to DROP in the machine's
namespace. Nothing routes beyond these links: no default route, no forwarding, no NAT.

The namespaces share the filesystem with this machine. That is fine, and realistic: a
capsule store or a Hugging Face cache on a shared filesystem is a common cluster set-up.
Each host still gets a home of its own (sshd's ``SetEnv HOME=``), as two machines would,
so what sparkrun keeps under ``~/.cache/sparkrun`` on one host is not seen by the other.

``ip netns exec`` gives each sshd a mount namespace too (it mounts the namespace's own
/sys), and everything a session starts inherits it; each host mounts a /dev/shm of its own
there. A machine without the ``sshd``
account that OpenSSH's privilege separation needs gets one in that mount namespace only:
a copy of /etc/passwd with the line added is bind-mounted there.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
RANGE = ipaddress.ip_network("198.18.0.0/15")
CONTROL_OCTET = 254  # this machine's own address on the switch: 198.18.N.254
PRIVSEP_DIR = Path("/run/sshd")  # compiled into sshd: where its unprivileged child chroots


def sshd_binary() -> tuple[Path, dict[str, str]]:
    """The sshd to start and the environment it needs (the unpacked one finds its libwrap)."""
    system = Path("/usr/sbin/sshd")
    if system.is_file():
        return system, {}
    unpacked = ROOT / ".work" / "openssh"
    binary = unpacked / "usr" / "sbin" / "sshd"
    if not binary.is_file():
        raise RuntimeError("no sshd on this machine: run scripts/test.sh (it unpacks Debian's openssh-server into .work/openssh)")
    return binary, {"LD_LIBRARY_PATH": str(unpacked / "usr" / "lib" / "x86_64-linux-gnu")}


def sftp_server(sshd: Path) -> Path:
    return sshd.parent.parent / "lib" / "openssh" / "sftp-server"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    cp = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and cp.returncode != 0:
        raise RuntimeError("ip %s failed: %s" % (" ".join(args), cp.stderr.strip()))
    return cp


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 198.18.0.0/15 that no interface here uses yet (another run may hold one)."""
    used = _ip("-4", "-o", "addr", "show").stdout + _ip("-4", "route", "show", "table", "all").stdout
    subnets = list(RANGE.subnets(new_prefix=24))
    start = secrets.randbelow(len(subnets))
    for i in range(len(subnets)):
        net = subnets[(start + i) % len(subnets)]
        if ".".join(str(net.network_address).split(".")[:3]) + "." not in used:
            return net  # type: ignore[return-value]
    raise RuntimeError("every /24 of %s is in use here" % RANGE)


@dataclass
class Host:
    """One host: its namespace, address, sshd and home."""

    name: str
    namespace: str
    address: str
    home: Path
    host_key: Path
    sshd: subprocess.Popen | None = None
    log: Path | None = None
    #: what this host's sessions get beside the shared environment (its own devices, say)
    env: dict[str, str] = field(default_factory=dict)
    #: directories of the shared filesystem this host sees a tmpfs of its own at (its own disk there)
    private: tuple[Path, ...] = ()

    def netns_exec(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run *argv* inside this host's network namespace directly (set-up and checks, not SSH)."""
        return subprocess.run(["ip", "netns", "exec", self.namespace, *argv], capture_output=True, text=True, timeout=timeout)


@dataclass
class TwoHosts:
    """Two SSH-reachable hosts; a context manager that leaves nothing behind.

    ``hosts``: the two hosts in rank order (the first is the head). ``client_key``,
    ``known_hosts`` and ``ssh_options``: what an SSH client (sparkrun) needs to reach them
    as ``user`` with the hosts' keys checked.
    """

    user: str = "root"
    shared_env: dict[str, str] = field(default_factory=dict)
    hosts: list[Host] = field(default_factory=list)
    subnet: ipaddress.IPv4Network | None = None
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    workdir: Path = field(init=False)
    setup_seconds: float = 0.0
    teardown_seconds: float = 0.0
    _created_privsep_dir: bool = False
    _created: list[str] = field(default_factory=list)  # namespaces, in creation order

    def __post_init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="coldsnap-two-hosts-%s-" % self.tag))

    @property
    def addresses(self) -> list[str]:
        return [h.address for h in self.hosts]

    @property
    def client_key(self) -> Path:
        return self.workdir / "client_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.workdir / "known_hosts"

    @property
    def control_address(self) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + CONTROL_OCTET)

    @property
    def ssh_options(self) -> list[str]:
        # -F /dev/null: ssh reads the invoking user's ~/.ssh/config from the password
        # database's home, not $HOME, so a private HOME would not keep it out.
        return [
            "-F", "/dev/null", "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", "UserKnownHostsFile=%s" % self.known_hosts, "-o", "GlobalKnownHostsFile=/dev/null",
        ]  # fmt: skip

    def _ns(self, suffix: str) -> str:
        # The owner's PID in the name lets a later run remove what a killed one left.
        return "coldsnap-%d-%s-%s" % (os.getpid(), self.tag, suffix)

    # -- set-up --------------------------------------------------------------------------------

    def __enter__(self) -> TwoHosts:
        t0 = time.monotonic()
        remove_leftovers()
        try:
            self._network()
            self._keys()
            for host in self.hosts:
                self._start_sshd(host)
            for host in self.hosts:
                self._await_sshd(host)
        except BaseException:
            self.close()
            raise
        self.setup_seconds = time.monotonic() - t0
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _network(self) -> None:
        self.subnet = _free_subnet()
        switch = self._ns("sw")
        _ip("netns", "add", switch)
        self._created.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        # This machine's port on the switch: its end keeps a name unique here, the other
        # end moves into the switch.
        control = "cs%s" % self.tag
        _ip("link", "add", control, "type", "veth", "peer", "name", "port-ctl", "netns", switch)
        _ip("addr", "add", "%s/24" % self.control_address, "dev", control)
        _ip("link", "set", control, "up")
        _ip("-n", switch, "link", "set", "port-ctl", "master", "br0", "up")
        for i, name in enumerate(("a", "b")):
            ns = self._ns(name)
            _ip("netns", "add", ns)
            self._created.append(ns)
            address = str(self.subnet.network_address + 1 + i)
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", "port-%s" % name, "netns", switch)
            _ip("-n", ns, "addr", "add", "%s/24" % address, "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", switch, "link", "set", "port-%s" % name, "master", "br0", "up")
            home = self.workdir / ("home-" + name)
            home.mkdir(mode=0o700)
            self.hosts.append(Host(name=name, namespace=ns, address=address, home=home, host_key=self.workdir / ("host-%s_ed25519" % name)))

    def _keys(self) -> None:
        for key in [self.client_key, *(h.host_key for h in self.hosts)]:
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", key.name, "-f", str(key)], check=True, capture_output=True, timeout=30)
        (self.workdir / "authorized_keys").write_text(Path(str(self.client_key) + ".pub").read_text())
        self.known_hosts.write_text("".join("%s %s" % (h.address, Path(str(h.host_key) + ".pub").read_text()) for h in self.hosts))

    def _privsep(self) -> Path | None:
        """A passwd file with the ``sshd`` account, when this machine lacks it (None: it has it)."""
        if not PRIVSEP_DIR.is_dir():
            PRIVSEP_DIR.mkdir(mode=0o755)
            self._created_privsep_dir = True
        try:
            pwd.getpwnam("sshd")
            return None
        except KeyError:
            pass
        passwd = self.workdir / "passwd"
        if not passwd.exists():
            uids = {p.pw_uid for p in pwd.getpwall()}
            uid = next(u for u in range(65533, 1000, -1) if u not in uids)
            passwd.write_text(Path("/etc/passwd").read_text().rstrip("\n") + "\nsshd:x:%d:65534::%s:/usr/sbin/nologin\n" % (uid, PRIVSEP_DIR))
            passwd.chmod(0o644)
        return passwd

    def _start_sshd(self, host: Host) -> None:
        binary, env = sshd_binary()
        setenv = " ".join("%s=%s" % kv for kv in {"HOME": str(host.home), **self.shared_env, **host.env}.items())
        config = self.workdir / ("sshd-%s.conf" % host.name)
        config.write_text(
            "\n".join(
                [
                    "ListenAddress %s" % host.address,
                    "HostKey %s" % host.host_key,
                    "PidFile none",
                    "AuthorizedKeysFile %s" % (self.workdir / "authorized_keys"),
                    "PermitRootLogin prohibit-password",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    # The keys live under /tmp, which any user may write to: strict modes refuse that.
                    "StrictModes no",
                    "PrintMotd no",
                    # scp copies over SFTP since OpenSSH 9.0.
                    "Subsystem sftp %s" % sftp_server(binary),
                    "SetEnv %s" % setenv,
                    "",
                ]
            )
        )
        host.log = self.workdir / ("sshd-%s.log" % host.name)
        argv = [str(binary), "-D", "-e", "-f", str(config)]
        # ip netns exec already made a mount namespace whose mounts do not propagate back.
        # Each host gets a /dev/shm of its own, as a machine has: vLLM decides whether two
        # ranks share a node by whether one sees the other's shared memory, and ranks that
        # think they do talk over unix sockets under /tmp, which no two real hosts share.
        setup = "mount -t tmpfs -o mode=1777,size=8g shm /dev/shm"
        for d in host.private:
            setup += " && mount -t tmpfs -o mode=0755,size=1g private %s" % shlex.quote(str(d))
        passwd = self._privsep()
        if passwd is not None:
            setup += ' && mount --bind "$0" /etc/passwd'
        argv = ["sh", "-c", setup + ' && exec "$@"', str(passwd or "-"), *argv]
        with open(host.log, "ab") as log:
            host.sshd = subprocess.Popen(["ip", "netns", "exec", host.namespace, *argv], stdin=subprocess.DEVNULL, stdout=log, stderr=log, env={**os.environ, **env}, start_new_session=True)

    def _await_sshd(self, host: Host, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        assert host.sshd is not None and host.log is not None
        while time.monotonic() < deadline:
            if host.sshd.poll() is not None:
                raise RuntimeError("sshd of host %s (%s) exited %s: %s" % (host.name, host.address, host.sshd.returncode, host.log.read_text()[-2000:]))
            try:
                with socket.create_connection((host.address, 22), timeout=1) as s:
                    if s.recv(64).startswith(b"SSH-"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("sshd of host %s (%s) did not answer in %ds: %s" % (host.name, host.address, timeout, host.log.read_text()[-2000:]))

    def restart_sshd(self, host: Host) -> None:
        """Stop the host's sshd and start it again (with the host's ``env`` as it is now);
        what earlier sessions started keeps running."""
        assert host.sshd is not None
        host.sshd.terminate()
        host.sshd.wait(timeout=10)
        self._start_sshd(host)
        self._await_sshd(host)

    @contextlib.contextmanager
    def host_env(self, envs: dict[str, dict[str, str]], private: tuple[Path, ...] = ()) -> Iterator[None]:
        """Every session on host ``name`` gets ``envs[name]`` while inside, as a host's own setup
        (its drivers, its tools) gives every login, and sees a directory of its own (an empty
        tmpfs) at each of *private*, as two machines have two disks at one path. Each sshd is
        restarted with them, and again without them after."""
        for d in private:
            d.mkdir(parents=True, exist_ok=True)
        try:
            for host in self.hosts:
                host.env, host.private = dict(envs.get(host.name) or {}), tuple(private)
                self.restart_sshd(host)
            yield
        finally:
            for host in self.hosts:
                host.env, host.private = {}, ()
                if host.sshd is not None:
                    self.restart_sshd(host)

    # -- sparkrun --------------------------------------------------------------------------------

    def configure_sparkrun(self, sparkrun, cluster: str = "two-node", cache_dir: str | None = None) -> None:
        """Make *cluster* of the two hosts in that sparkrun's home, SSH settings in its config.yaml.

        sparkrun reads the SSH key and options from ``ssh.key`` / ``ssh.options`` of its
        config.yaml and the login from the cluster's ``user`` (``cluster create --user``).
        """
        config = sparkrun_config_path(sparkrun.home)
        data = (yaml.safe_load(config.read_text()) if config.exists() else None) or {}
        data["ssh"] = {**(data.get("ssh") or {}), "key": str(self.client_key), "options": self.ssh_options}
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(yaml.safe_dump(data, sort_keys=False))
        args = ["cluster", "create", cluster, "--hosts", ",".join(self.addresses), "--user", self.user]
        if cache_dir:
            args += ["--cache-dir", cache_dir]
        sparkrun(*args)

    # -- teardown --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every process in the hosts, remove the namespaces, links and keys. Idempotent."""
        t0 = time.monotonic()
        for host in self.hosts:
            if host.sshd is not None and host.sshd.poll() is None:
                host.sshd.terminate()
        # Whatever a session started (an engine, a shell) lives in the namespace too.
        for ns in reversed(self._created):
            _kill_namespace_processes(ns)
        for host in self.hosts:
            if host.sshd is not None:
                try:
                    host.sshd.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    host.sshd.kill()
                    host.sshd.wait(timeout=5)
        for ns in reversed(self._created):
            # Removing a namespace removes the veth ends inside it, and so their peers.
            _ip("netns", "delete", ns, check=False)
        self._created.clear()
        _ip("link", "delete", "cs%s" % self.tag, check=False)
        if self._created_privsep_dir:
            try:
                PRIVSEP_DIR.rmdir()
            except OSError:
                pass  # another run's sshd came to use it meanwhile
            self._created_privsep_dir = False
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.teardown_seconds = time.monotonic() - t0


def _kill_namespace_processes(ns: str, timeout: float = 10) -> None:
    """TERM every process in network namespace *ns*, then KILL what is left."""
    deadline = time.monotonic() + timeout
    sig = signal.SIGTERM
    while True:
        cp = _ip("netns", "pids", ns, check=False)
        pids = [int(p) for p in cp.stdout.split() if p.isdigit() and int(p) != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline - timeout / 2:
            sig = signal.SIGKILL
        if time.monotonic() > deadline:
            raise RuntimeError("processes %s in namespace %s outlived SIGKILL" % (pids, ns))
        time.sleep(0.1)


_LEFTOVER_RE = re.compile(r"^coldsnap-(\d+)-([0-9a-f]{6})-(a|b|sw)$")


def remove_leftovers() -> list[str]:
    """Remove the namespaces, processes and links of runs whose process is gone (killed before
    its teardown); returns the namespaces removed. Another live run's hosts are left alone."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _LEFTOVER_RE.match(name)
        if not m or Path("/proc/%s" % m.group(1)).exists():
            continue
        _kill_namespace_processes(name)
        _ip("netns", "delete", name, check=False)
        _ip("link", "delete", "cs%s" % m.group(2), check=False)
        for workdir in Path(tempfile.gettempdir()).glob("coldsnap-two-hosts-%s-*" % m.group(2)):
            shutil.rmtree(workdir, ignore_errors=True)
        removed.append(name)
    live = [l for l in _ip("netns", "list", check=False).stdout.splitlines() if _LEFTOVER_RE.match(l.split()[0] if l.split() else "")]
    if removed and not live and not Path("/usr/sbin/sshd").exists():
        try:
            PRIVSEP_DIR.rmdir()  # made by the killed run: without a system sshd, nothing else uses it
        except OSError:
            pass
    return removed


def sparkrun_config_path(home: Path) -> Path:
    """sparkrun's config.yaml in a home (its default config root, ~/.config/sparkrun)."""
    return home / ".config" / "sparkrun" / "config.yaml"
