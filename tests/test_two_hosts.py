"""Two hosts made of network namespaces, and sparkrun's own transport reaching each of them.

The plugin never opens SSH itself (integration/transport.py asks sparkrun for the cluster's
session); these tests drive that session against two real sshds, with keys checked both
ways, and check that the fixture leaves no namespace, link or process behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT
from two_hosts import TwoHosts, sparkrun_config_path

from sparkrun_coldsnap.errors import ToolError
from sparkrun_coldsnap.integration.transport import ClusterHosts

# Run in a process of its own: sparkrun binds its config to the HOME it first sees.
PROBE = textwrap.dedent(
    """
    import hashlib, json, sys
    from pathlib import Path
    from sparkrun_coldsnap.errors import ToolError
    from sparkrun_coldsnap.integration.transport import open_cluster

    payload, homes = Path(sys.argv[1]), json.loads(sys.argv[2])
    out = {}
    with open_cluster("two-node") as hosts:
        for host in hosts.hosts:
            seen = hosts.run(host, ["sh", "-c", 'echo "$SSH_CONNECTION"; echo "$HOME"; ip -4 -o addr show dev eth0'])
            dest = homes[host] + "/uploaded.bin"
            hosts.upload(host, [str(payload)], dest)
            digest = hosts.run(host, ["sha256sum", dest]).stdout.split()[0]
            try:
                hosts.run(host, ["sh", "-c", "echo failing >&2; exit 3"])
                failed = None
            except ToolError as err:
                failed = err.message
            out[host] = {"lines": seen.stdout.splitlines(), "digest": digest, "failed": failed}
    print(json.dumps({"hosts": list(hosts.hosts), "by_host": out, "sent": hashlib.sha256(payload.read_bytes()).hexdigest()}))
    """
)


def test_each_host_has_its_own_address_and_reaches_the_other(two_hosts):
    a, b = two_hosts.hosts
    assert a.address != b.address and all(h.address.startswith(("198.18.", "198.19.")) for h in two_hosts.hosts)
    for host, peer in ((a, b), (b, a)):
        addrs = host.netns_exec("ip", "-4", "-o", "addr", "show").stdout
        assert host.address in addrs and peer.address not in addrs
        # Host to host over the link: the peer's sshd greets.
        greeting = host.netns_exec("bash", "-c", "exec 3<>/dev/tcp/%s/22 && head -c 4 <&3" % peer.address)
        assert greeting.stdout == "SSH-", greeting.stderr
        # Nothing routes beyond the hosts' own link.
        assert "default" not in host.netns_exec("ip", "route", "show").stdout


def test_sparkrun_transport_runs_commands_and_uploads_on_each_host(two_node, sparkrun, tmp_path):
    payload = tmp_path / "payload.bin"
    payload.write_bytes(bytes(range(256)) * 64)
    homes = {h.address: str(h.home) for h in two_node.hosts}
    cp = subprocess.run([sys.executable, "-c", PROBE, str(payload), json.dumps(homes)], env=sparkrun.env, capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr[-3000:]
    out = json.loads(cp.stdout.splitlines()[-1])
    assert out["hosts"] == two_node.addresses  # rank order: the head first
    for host in two_node.hosts:
        seen = out["by_host"][host.address]
        connection, home, eth0 = seen["lines"]
        # sshd of that host answered: the client is this machine, the server that host's address.
        assert connection.split()[0] == two_node.control_address and connection.split()[2] == host.address
        assert home == str(host.home) and host.address in eth0
        assert seen["digest"] == out["sent"] and (host.home / "uploaded.bin").read_bytes() == payload.read_bytes()
        assert seen["failed"] == "on host %s: sh failed (exit 3): failing" % host.address
        assert host.log is not None and host.log.read_text().count("Accepted publickey for root from %s" % two_node.control_address) >= 4


def test_the_cluster_is_sparkruns_own(two_node, sparkrun):
    shown = json.loads(sparkrun("cluster", "show", "two-node", "--json").stdout)
    assert shown["hosts"] == two_node.addresses and shown["user"] == "root"
    config = sparkrun_config_path(sparkrun.home).read_text()
    assert str(two_node.client_key) in config and "StrictHostKeyChecking=yes" in config


def test_a_session_acts_only_on_its_cluster_hosts():
    class Refusing:
        def execute(self, *a, **k):
            raise AssertionError("the session must not be reached")

        def close(self):
            pass

    with ClusterHosts(("198.18.0.1", "198.18.0.2"), Refusing(), cluster="two-node") as hosts, pytest.raises(ToolError, match="not one of cluster 'two-node'"):
        hosts.run("198.18.0.3", ["true"])


def test_teardown_leaves_no_namespace_link_process_or_key(host_namespaces):
    hosts = TwoHosts()
    with hosts:
        head = hosts.hosts[0]
        # A process a session left running, as an engine would be.
        ssh = ["ssh", "-o", "BatchMode=yes", "-i", str(hosts.client_key), *hosts.ssh_options, "root@" + head.address]
        subprocess.run([*ssh, "setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!"], check=True, capture_output=True, text=True, timeout=30)
        left = subprocess.run(["ip", "netns", "pids", head.namespace], capture_output=True, text=True).stdout.split()
        assert len(left) >= 2  # its sshd and the sleep
        namespaces = [h.namespace for h in hosts.hosts]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces) and hosts.tag not in listed
    assert "cs" + hosts.tag not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    for pid in left:
        assert not _alive(int(pid)), "process %s outlived the hosts" % pid
    assert not hosts.workdir.exists()
    assert hosts.setup_seconds < 10 and hosts.teardown_seconds < 10


def _alive(pid: int) -> bool:
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def test_what_a_killed_run_left_is_removed_by_the_next(host_namespaces, tmp_path):
    script = tmp_path / "killed.py"
    script.write_text("import sys, time\nsys.path.insert(0, %r)\nfrom two_hosts import TwoHosts\nh = TwoHosts().__enter__()\nprint(h.tag, flush=True)\ntime.sleep(600)\n" % str(ROOT / "tests"))
    killed = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert killed.stdout is not None
    tag = killed.stdout.readline().strip()
    left = [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split() if tag in ns]
    sshds = [int(p) for ns in left for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]
    killed.kill()
    killed.wait()
    assert len(left) == 3 and len(sshds) == 2
    with TwoHosts():
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert tag not in listed
        assert not any(_alive(pid) for pid in sshds)
        assert not list(Path(tempfile.gettempdir()).glob("coldsnap-two-hosts-%s-*" % tag))
