"""A workload's TCP connections ended at once before it is stopped (host/connections.py), on
real sockets: the peer sees a reset and neither end lingers in the kernel (no TIME_WAIT),
where closing them the ordinary way leaves one end behind."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from sparkrun_coldsnap.host import connections, peer_lock


def lingering(port: int) -> list[str]:
    out = subprocess.run(["ss", "-tanH", "sport", "= :%d" % port], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line.strip()]


@pytest.fixture
def pair():
    srv = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(srv.getsockname())
    server_end, _ = srv.accept()
    yield client, server_end
    for s in (client, server_end, srv):
        s.close()


def test_closing_the_ordinary_way_leaves_an_end_behind(pair):
    client, server_end = pair
    port = client.getsockname()[1]
    client.close()
    server_end.close()
    assert any("TIME-WAIT" in line for line in lingering(port))  # what the abort exists to avoid


def test_aborted_connections_reset_the_peer_and_leave_nothing(pair):
    client, server_end = pair
    port = client.getsockname()[1]
    held = connections.held_connections([os.getpid()])
    mine = {c for c in held if port in (c[1], c[3])}
    assert ("127.0.0.1", port, "127.0.0.1", server_end.getsockname()[1]) in mine
    assert connections.abort(mine) == []
    with pytest.raises(OSError):
        client.send(b"x")
        client.recv(1)
    client.close()
    server_end.close()
    assert lingering(port) == []


def test_a_connection_already_gone_is_no_problem():
    assert connections.abort([("127.0.0.1", 1, "127.0.0.1", 2)]) == []


def test_held_back_packets_of_a_connection_arrive_once_it_is_let_through_and_nothing_is_left(pair):
    """host/peer_lock.py on a real connection and real iptables: while held back, what one end
    sends never reaches the other (so it can meet no missing socket there); let through, it
    arrives by retransmission, and the rule is gone."""
    client, server_end = pair
    conn = ("127.0.0.1", server_end.getsockname()[1], "127.0.0.1", client.getsockname()[1])  # the server's end
    peer_lock.lock([conn])
    try:
        peer_lock.lock([conn])  # twice: still one rule
        rules = subprocess.run(["iptables", "-w", "-S", "INPUT"], capture_output=True, text=True, check=True).stdout
        assert rules.count("--sport %d" % conn[3]) == 1, rules
        client.sendall(b"held")
        server_end.settimeout(0.5)
        with pytest.raises(TimeoutError):
            server_end.recv(4)
    finally:
        assert peer_lock.unlock([conn]) == []
    server_end.settimeout(10)
    assert server_end.recv(4) == b"held"
    rules = subprocess.run(["iptables", "-w", "-S", "INPUT"], capture_output=True, text=True, check=True).stdout
    assert "--sport %d" % conn[3] not in rules


def test_only_the_connections_to_other_hosts_are_held_back():
    own = ("127.0.0.1", 1000, "127.0.0.1", 2000)
    away = ("127.0.0.1", 1000, "198.18.255.254", 2000)
    mapped = ("::ffff:127.0.0.1", 1001, "::ffff:198.18.255.254", 2001)  # a dual-stack socket's view of IPv4
    assert peer_lock.to_other_hosts([own, away, mapped]) == [away, ("127.0.0.1", 1001, "198.18.255.254", 2001)]
