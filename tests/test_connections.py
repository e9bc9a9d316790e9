"""A workload's TCP connections ended at once before it is stopped (host/connections.py), on
real sockets: the peer sees a reset and neither end lingers in the kernel (no TIME_WAIT),
where closing them the ordinary way leaves one end behind."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from sparkrun_coldsnap.host import connections


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
