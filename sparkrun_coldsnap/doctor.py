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
from sparkrun_coldsnap.drivers import criu_tool
from sparkrun_coldsnap.host import disk_room, paths
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
    try:
        from sparkrun.core.features import feature_gate_enabled

        local = feature_gate_enabled("executor.local")
        out.append(Check("executor.local", "ok" if local else "warn", "sparkrun's local executor is %s" % ("enabled" if local else "disabled"),
                         "" if local else "sparkrun setup features enable executor.local (needed for host-process engines)"))  # fmt: skip
    except Exception as err:  # noqa: BLE001
        out.append(Check("executor.local", "warn", "cannot read sparkrun features: %s" % err))
    return out


def _criu() -> list[Check]:
    out = []
    found = criu_tool.candidates()
    for c in found:
        out.append(Check("criu (%s)" % c.source, "ok" if c.usable else "warn", "%s at %s" % ("criu %s" % c.version if c.version else "unknown version", c.argv[-1]) + ("" if c.usable else ": " + (c.problem or ""))))
    try:
        criu = criu_tool.Criu.locate()
    except Exception as err:  # noqa: BLE001
        out.append(Check("criu", "fail", str(err), "sparkrun coldsnap setup --criu"))
        return out
    why = "the system criu is >= 4.2" if criu.source == "system" else "no system criu >= 4.2 (Debian 12 ships 3.17, which fails on this kernel)"
    ok, line = criu.check()
    out.append(Check("criu", "ok" if ok else "fail", "using %s criu %s (%s); criu check: %s" % (criu.source, criu.version, why, line), "" if ok else "run as root on a kernel with checkpoint/restore support"))
    return out


def _host() -> list[Check]:
    h = host_facts()
    out = [Check("host", "ok", "%s, kernel %s, python %s" % (h.cpu_arch, h.kernel_release, platform.python_version()))]
    if os.geteuid() != 0:
        out.append(Check("root", "fail", "capture and restore run CRIU, which needs root", "run as root"))
    if SYSCTL.exists():
        out.append(Check("io_uring switch", "ok", "kernel.io_uring_disabled=%s (capture sets 2 while it runs)" % SYSCTL.read_text().strip()))
    if not shutil.which("bash"):
        out.append(Check("bash", "fail", "bash not found: engines are started with bash -c", "install bash"))
    g = h.gpu
    if g.problem:
        out.append(Check("gpu", "warn", g.problem, "check the NVIDIA driver installation"))
    elif g.gpus:
        out.append(Check("gpu", "ok", "NVIDIA driver %s, CUDA %s, %s" % (g.nvidia_driver, g.cuda_version, ", ".join("%s (sm %s)" % (x.name, x.compute_capability) for x in g.gpus))))
    else:
        out.append(Check("gpu", "ok", "no NVIDIA GPU: CPU engines only (driver cpu)"))
    return out


def _drivers() -> list[Check]:
    host = host_facts()
    out = []
    for d in extensions.registry().drivers_by_preference():
        s = d.support(host)
        out.append(Check("driver %s" % d.name, "ok" if s.ok else "warn", s.reason))
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
    for part in (_sparkrun, _host, _criu, _drivers, _engines, _store):
        try:
            checks.extend(part())
        except Exception as err:  # noqa: BLE001 - one broken probe must not hide the others
            checks.append(Check(part.__name__.strip("_"), "fail", "check crashed: %s" % err))
    return checks


def as_json(checks: list[Check]) -> dict:
    return {"ok": all(c.status != "fail" for c in checks), "checks": [asdict(c) for c in checks]}
