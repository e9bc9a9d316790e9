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
    import os
    f = socket.create_connection((sys.argv[1], %d)).makefile("rw")
    count = os.open(os.path.expanduser("~/count"), os.O_RDWR | os.O_CREAT, 0o644)
    n = 0
    while True:
        f.write("%%d\\n" %% n)
        f.flush()
        n = int(f.readline())
        os.pwrite(count, b"%%20d" %% n, 0)
        time.sleep(0.05)
    """
    % PORT
)

# Run in a process of its own: sparkrun binds its config to the HOME it first sees.
DRIVE = textwrap.dedent(
    """
    import json, shlex, sys, time
    from sparkrun_coldsnap.criu.tool import Criu
    from sparkrun_coldsnap.errors import ColdsnapError
    from sparkrun_coldsnap.controller.cut import UnitOnHost, checkpoint_units
    from sparkrun_coldsnap.integration.remote_criu import CriuCut, RemoteCriu
    from sparkrun_coldsnap.integration.transport import open_cluster

    server, client, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    out = {}

    def start(hosts, host, code, arg):
        line = "cd ~; setsid %s -c %s %s > /dev/null 2>&1 < /dev/null & echo $!" % (shlex.quote(sys.executable), shlex.quote(code), arg)
        return int(hosts.run(host, ["sh", "-c", line]).stdout.split()[-1])

    def count(hosts, host):
        return int(hosts.run(host, ["sh", "-c", "cat ~/count"]).stdout.strip() or 0)

    def alive(hosts, host, pid):
        # A zombie is not running: kill -0 would say it is.
        state = hosts.run(host, ["sh", "-c", "ps -o stat= -p %d" % pid], check=False).stdout.strip()
        return bool(state) and not state.startswith("Z")

    def kill_criu_of(hosts, host, images):
        # ([c]: the pattern does not match the shell that carries it)
        kill = "for i in $(seq 1000); do pkill -KILL -f '[c]riu dump -t [0-9]* -D %s' && break; sleep 0.01; done" % images
        hosts.run(host, ["sh", "-c", "(%s) >/dev/null 2>&1 &" % kill])

    def counting(hosts, host):
        before = count(hosts, host)
        time.sleep(1.0)
        return count(hosts, host) > before

    with open_cluster("two-node") as hosts:
        a, b = hosts.hosts
        criu = RemoteCriu(hosts, Criu.locate().argv)
        pids = {b: start(hosts, b, server, b)}
        time.sleep(1.0)
        pids[a] = start(hosts, a, client, b)
        while count(hosts, a) < 5:
            time.sleep(0.1)
        images = {h: hosts.run(h, ["sh", "-c", "echo ~/images"]).stdout.strip() for h in (a, b)}
        units = [UnitOnHost("rank-0", a, pids[a], images[a]), UnitOnHost("rank-1", b, pids[b], images[b])]
        try:
            if mode.endswith("kill-criu"):
                kill_criu_of(hosts, b, images[b])
            if mode.startswith("coordinated"):
                done = checkpoint_units(CriuCut(criu), units)
                out["barriers"], out["phases"] = done.barriers, done.phases
            else:
                for u in units:
                    out.setdefault("dump", {})[u.host] = criu.dump(u.host, u.unit, u.root_pid, u.images, tcp=True).seconds
        except ColdsnapError as err:
            out["dump_error"] = str(err)
        out["at_dump"] = count(hosts, a)
        out["alive_after_dump"] = {h: alive(hosts, h, pids[h]) for h in (a, b)}
        out["images_left"] = {h: hosts.run(h, ["test", "-e", images[h]], check=False).returncode == 0 for h in (a, b)}
        if mode.startswith("coordinated"):
            out["counting_after_dump"] = counting(hosts, a)
        if mode in ("both", "coordinated") and "dump_error" not in out:
            if mode == "coordinated":  # the checkpoint left them running: stop them as an eviction would
                out["before_kill"] = count(hosts, a)
                for h in (a, b):
                    hosts.run(h, ["kill", "-9", str(pids[h])], check=False)
            # A restore takes the captured PIDs back: the dumped processes must be gone, not
            # zombies waiting for this machine's init, which reaps late.
            t = time.monotonic()
            while any(hosts.run(h, ["test", "-e", "/proc/%d" % pids[h]], check=False).returncode == 0 for h in (a, b)):
                assert time.monotonic() - t < 60, "the dumped processes were not reaped in 60 s"
                time.sleep(0.2)
            out["reaped_after"] = time.monotonic() - t
            for u in (units[1], units[0]):
                out.setdefault("restore", {})[u.host] = criu.restore(u.host, u.unit, u.images, tcp=True).seconds
            if mode == "coordinated":  # stopped at the cut, restored stopped
                for h in (a, b):
                    hosts.run(h, ["kill", "-CONT", "--", "-%d" % pids[h]])
            time.sleep(0.3)
            out["restored_at"] = count(hosts, a)
            out["counting_after_restore"] = counting(hosts, a)
            out["alive_after_restore"] = {h: alive(hosts, h, pids[h]) for h in (a, b)}
        for h in (a, b):
            hosts.run(h, ["kill", "-9", str(pids[h])], check=False)
            hosts.run(h, ["rm", "-rf", images[h]], check=False)
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
    # The same connection: the count goes on from where it was dumped (a new connection would
    # need a new server, and the server closed its listening socket after the first).
    assert out["restored_at"] >= out["at_dump"] and out["counting_after_restore"], out


def test_a_coordinated_checkpoint_stops_every_unit_dumps_every_unit_resumes_every_unit_and_restores_at_the_cut(two_node, sparkrun):
    out = drive(sparkrun, "coordinated")
    a, b = two_node.addresses
    assert "dump_error" not in out, out
    assert set(out["barriers"]) == {"quiesced", "dumped", "resumed"} and set(out["phases"]) == {"rank-0", "rank-1"}
    assert all(set(p) == {"quiesce", "dump"} for p in out["phases"].values()), out
    assert out["alive_after_dump"] == {a: True, b: True} and out["counting_after_dump"], out  # resumed, same connection
    assert out["images_left"] == {a: True, b: True}
    # Restored at the cut: back below what the resumed originals had counted to, and counting on.
    assert out["restored_at"] < out["before_kill"] and out["counting_after_restore"], out
    assert out["alive_after_restore"] == {a: True, b: True}, out


def test_a_unit_whose_criu_is_killed_fails_the_checkpoint_in_one_line_every_unit_resumed_nothing_kept(two_node, sparkrun):
    out = drive(sparkrun, "coordinated-kill-criu")
    a, b = two_node.addresses
    error = out["dump_error"]
    assert error.startswith("dumping unit rank-1 on host %s: criu " % b) and "\n" not in error, out
    assert error.endswith("every unit was resumed as it was and nothing was kept"), error
    assert out["alive_after_dump"] == {a: True, b: True} and out["counting_after_dump"], out
    assert out["images_left"] == {a: False, b: False}, out
