"""CRIU on each of two hosts through sparkrun's transport: two processes on two hosts talking
over one TCP connection are dumped, each on its own host, and restored, each on its own host,
and go on talking over the same connection (what a distributed engine's ranks need).

Real CRIU, real sshds (tests/two_hosts.py), sparkrun's own session; the processes are small
Python programs instead of an engine, so the mechanism is checked in seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

pytestmark = pytest.mark.engine  # CRIU and the two-host namespaces: under the shared lock

PORT = 47000
SERVER = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], %d))
    s.listen(1)
    c, _ = s.accept()
    s.close()
    f = c.makefile("rw")
    for line in f:
        f.write("%%d\\n" %% (int(line) + 1))
        f.flush()
    """
    % PORT
)
CLIENT = textwrap.dedent(
    """
    import socket, sys, time
    f = socket.create_connection((sys.argv[1], %d)).makefile("rw")
    n = 0
    while True:
        f.write("%%d\\n" %% n)
        f.flush()
        n = int(f.readline())
        print(n, flush=True)
        time.sleep(0.05)
    """
    % PORT
)

# Run in a process of its own: sparkrun binds its config to the HOME it first sees.
DRIVE = textwrap.dedent(
    """
    import json, shlex, sys, time
    from sparkrun_coldsnap.drivers.criu_tool import Criu
    from sparkrun_coldsnap.errors import ColdsnapError
    from sparkrun_coldsnap.integration.remote_criu import RemoteCriu
    from sparkrun_coldsnap.integration.transport import open_cluster

    server, client, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    out = {}

    def start(hosts, host, code, arg, log):
        line = "cd ~; setsid %s -c %s %s > %s 2>&1 < /dev/null & echo $!" % (shlex.quote(sys.executable), shlex.quote(code), arg, log)
        return int(hosts.run(host, ["sh", "-c", line]).stdout.split()[-1])

    def count(hosts, host):
        lines = hosts.run(host, ["sh", "-c", "cat ~/client.log"]).stdout.split()
        return [int(x) for x in lines]

    def alive(hosts, host, pid):
        # A zombie is not running: kill -0 would say it is.
        state = hosts.run(host, ["sh", "-c", "ps -o stat= -p %d" % pid], check=False).stdout.strip()
        return bool(state) and not state.startswith("Z")

    with open_cluster("two-node") as hosts:
        a, b = hosts.hosts
        criu = RemoteCriu(hosts, Criu.locate().argv)
        pids = {b: start(hosts, b, server, b, "server.log")}
        time.sleep(1.0)
        pids[a] = start(hosts, a, client, b, "client.log")
        while len(count(hosts, a)) < 5:
            time.sleep(0.1)
        images = {h: hosts.run(h, ["sh", "-c", "echo ~/images"]).stdout.strip() for h in (a, b)}
        try:
            for h, unit in ((a, "rank-0"), (b, "rank-1")):
                if mode == "kill-criu" and h == b:
                    # The second dump's CRIU is killed as soon as it runs: a rank whose dump fails.
                    # ([c]: the pattern does not match the shell that carries it)
                    kill = "for i in $(seq 1000); do pkill -KILL -f '[c]riu dump -t [0-9]* -D %s' && break; sleep 0.01; done" % images[b]
                    hosts.run(b, ["sh", "-c", "(%s) >/dev/null 2>&1 &" % kill])
                out.setdefault("dump", {})[h] = criu.dump(h, unit, pids[h], images[h], tcp=True).seconds
        except ColdsnapError as err:
            out["dump_error"] = str(err)
        out["at_dump"] = count(hosts, a)[-1]
        out["alive_after_dump"] = {h: alive(hosts, h, pids[h]) for h in (a, b)}
        if mode == "both":
            # A restore takes the captured PIDs back: the dumped processes must be gone, not
            # zombies waiting for this machine's init, which reaps late.
            t = time.monotonic()
            while any(hosts.run(h, ["test", "-e", "/proc/%d" % pids[h]], check=False).returncode == 0 for h in (a, b)):
                assert time.monotonic() - t < 60, "the dumped processes were not reaped in 60 s"
                time.sleep(0.2)
            out["reaped_after"] = time.monotonic() - t
            for h, unit in ((b, "rank-1"), (a, "rank-0")):
                out.setdefault("restore", {})[h] = criu.restore(h, unit, images[h], tcp=True).seconds
            time.sleep(1.5)
            out["after_restore"] = count(hosts, a)
            out["alive_after_restore"] = {h: alive(hosts, h, pids[h]) for h in (a, b)}
        for h in (a, b):
            hosts.run(h, ["kill", "-9", str(pids[h])], check=False)
    print(json.dumps(out))
    """
)


def drive(sparkrun, mode: str) -> dict:
    cp = subprocess.run([sys.executable, "-c", DRIVE, SERVER, CLIENT, mode], env=sparkrun.env, capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert cp.returncode == 0, cp.stderr[-3000:]
    return json.loads(cp.stdout.splitlines()[-1])


def test_both_ends_of_a_connection_between_two_hosts_come_back_and_go_on_talking(two_node, sparkrun):
    out = drive(sparkrun, "both")
    a, b = two_node.addresses
    assert "dump_error" not in out, out
    assert out["alive_after_dump"] == {a: False, b: False}  # a dump that is not told to leave the tree running ends it
    assert out["alive_after_restore"] == {a: True, b: True}, out
    counted = out["after_restore"]
    # The same connection: the client's count goes on from where it was, one by one, no gap
    # and no restart (a new connection would need a new server, which nothing starts).
    assert counted[-1] > out["at_dump"] + 5, out
    assert counted == list(range(1, len(counted) + 1)), counted


def test_a_dump_whose_criu_is_killed_names_the_host_and_unit(two_node, sparkrun):
    out = drive(sparkrun, "kill-criu")
    a, b = two_node.addresses
    assert out["dump_error"].startswith("dumping unit rank-1 on host %s: criu " % b), out
