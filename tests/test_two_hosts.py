"""Two hosts made of network namespaces, each with its own sshd: the fixture itself.

The hosts are apart and reach each other, sparkrun's cluster of them is its own, and the
fixture leaves no namespace, link or process behind.
"""

from __future__ import annotations

import json
import subprocess

from two_hosts import TwoHosts, sparkrun_config_path


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


def test_the_cluster_is_sparkruns_own(two_node, sparkrun):
    shown = json.loads(sparkrun("cluster", "show", "two-node", "--json").stdout)
    assert shown["hosts"] == two_node.addresses and shown["user"] == "root"
    config = sparkrun_config_path(sparkrun.home).read_text()
    assert str(two_node.client_key) in config and "StrictHostKeyChecking=yes" in config


def test_teardown_leaves_no_namespace_link_process_or_key():
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
