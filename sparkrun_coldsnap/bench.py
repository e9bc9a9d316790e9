"""The vanilla-versus-restore benchmark, measured the way the product states it.

Before every sample the page cache is dropped. A vanilla sample launches the
engine and waits for the first non-empty streamed token of a validated reply.
A restore sample first prepares (admission, verifying and unpacking the
capsule: reported apart, off the clock, as it happens before eviction in
``sparkrun run``), then the clock runs from the start of the restore to the
first non-empty token of a reply that matches the one recorded at capture.
Samples alternate so drift on the host hits both paths alike.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

from sparkrun_coldsnap import __version__, controller, paths
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.errors import ColdsnapError, ToolError
from sparkrun_coldsnap.launch.local import kill_tree
from sparkrun_coldsnap.progress import Progress
from sparkrun_coldsnap.request import RestoreRequest


@dataclass
class Sample:
    path: str  # vanilla | restore
    index: int
    ttft_seconds: float
    prepare_seconds: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    validated: bool = True


def drop_page_cache() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as err:
        raise ToolError("cannot drop the page cache (%s): run the benchmark as root, or pass --keep-page-cache" % err.strerror) from err


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def run(req: RestoreRequest, *, store: CapsuleStore, samples: int, base_env: Mapping[str, str], progress: Progress, drop_cache: bool = True) -> dict:
    """Alternate vanilla and restore samples; returns the results document."""
    log_dir = paths.run_dir() / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: list[Sample] = []
    for i in range(samples):
        if drop_cache:
            drop_page_cache()
        progress.step("sample %d/%d: vanilla start" % (i + 1, samples))
        v = controller.start_vanilla(req, base_env=base_env, log_path=log_dir / ("vanilla-%d.log" % i), progress=progress)
        kill_tree(v.root_pid)
        results.append(Sample("vanilla", i, v.ttft_seconds or 0.0, phases={p.name: p.seconds for p in v.receipt.phases}))
        progress.note("vanilla: first token after %.2f s" % (v.ttft_seconds or 0))

        if drop_cache:
            drop_page_cache()
        progress.step("sample %d/%d: restore" % (i + 1, samples))
        prepared = controller.prepare_restore(req, store=store, progress=progress)
        r = controller.activate_restore(prepared, log_path=log_dir / ("restore-%d.log" % i), progress=progress)
        kill_tree(r.root_pid)
        phases = {p.name: p.seconds for p in r.receipt.phases}
        results.append(Sample("restore", i, r.ttft_seconds or 0.0, prepare_seconds=prepared.prepare_seconds, phases=phases))
        progress.note("restore: first token after %.2f s (prepared in %.2f s before the clock)" % (r.ttft_seconds or 0, prepared.prepare_seconds))
        time.sleep(1.0)  # let the killed trees' memory go back before the next sample
    return document(req, store, results, drop_cache=drop_cache)


def document(req: RestoreRequest, store: CapsuleStore, results: list[Sample], *, drop_cache: bool) -> dict:
    van = [s.ttft_seconds for s in results if s.path == "vanilla"]
    res = [s.ttft_seconds for s in results if s.path == "restore"]
    prep = [s.prepare_seconds or 0.0 for s in results if s.path == "restore"]
    phase_names = sorted({k for s in results if s.path == "restore" for k in s.phases})
    restore_phases = {k: statistics.median([s.phases.get(k, 0.0) for s in results if s.path == "restore"]) for k in phase_names}
    entry = store.resolve(req.capsule.ref)
    return {
        "format": 1,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": {"machine": platform.machine(), "kernel": platform.release(), "cpus": os.cpu_count()},
        "tool_version": __version__,
        "recipe": req.workload.recipe,
        "engine": req.workload.engine,
        "driver": req.workload.driver,
        "model": "%s@%s" % (req.workload.model.id, req.workload.model.revision),
        "capsule": {"ref": req.capsule.ref, "digest": entry.descriptor.digest},
        "page_cache_dropped": drop_cache,
        "vanilla_ttft": _summary(van),
        "restore_ttft": _summary(res),
        "restore_prepare": _summary(prep),
        "restore_phases_median": restore_phases,
        "speedup_median": statistics.median(van) / statistics.median(res),
        "all_restores_validated": all(s.validated for s in results),
        "samples": [asdict(s) for s in results],
    }


def table(doc: dict) -> str:
    rows = [
        ("vanilla start -> first token", doc["vanilla_ttft"]),
        ("restore -> first token", doc["restore_ttft"]),
        ("restore preparation (before the clock)", doc["restore_prepare"]),
    ]
    lines = ["%-42s %8s %8s %8s %3s" % ("", "median", "min", "max", "n")]
    for name, s in rows:
        lines.append("%-42s %7.2fs %7.2fs %7.2fs %3d" % (name, s["median"], s["min"], s["max"], s["n"]))
    lines.append("speedup (median vanilla / median restore): %.1fx" % doc["speedup_median"])
    parts = ", ".join("%s %.2fs" % (k, v) for k, v in doc["restore_phases_median"].items() if not k.startswith("prepare."))
    lines.append("restore phases (median): %s" % parts)
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> Path | None:
    """Bars of the medians with every sample as a dot; None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 3.2), dpi=120)
    labels = ["vanilla start", "ColdSnap restore"]
    medians = [doc["vanilla_ttft"]["median"], doc["restore_ttft"]["median"]]
    colors = ["#9aa5b1", "#2b7bb9"]
    ax.barh(labels, medians, color=colors, height=0.55)
    top = max(medians + [s["ttft_seconds"] for s in doc["samples"]])
    for y, path_name in enumerate(("vanilla", "restore")):
        xs = [s["ttft_seconds"] for s in doc["samples"] if s["path"] == path_name]
        ax.scatter(xs, [y] * len(xs), color="black", s=14, zorder=3, label="samples" if y == 0 else None)
        ax.text(max(xs + [medians[y]]) + top * 0.02, y, "median %.2f s" % medians[y], va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("seconds to first non-empty streamed token (page cache dropped)")
    ax.set_title("%s, %s driver: %.1fx faster (median of %d)" % (doc["recipe"], doc["driver"], doc["speedup_median"], doc["restore_ttft"]["n"]), fontsize=10)
    ax.set_xlim(0, top * 1.3)
    ax.legend(loc="lower right", fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write(doc: dict, out_dir: Path) -> tuple[Path, Path | None]:
    out_dir.mkdir(parents=True, exist_ok=True)
    j = out_dir / "bench.json"
    j.write_text(json.dumps(doc, indent=2) + "\n")
    return j, plot(doc, out_dir / "bench.png")


def ensure_capsule(store: CapsuleStore, ref: str) -> bool:
    try:
        store.resolve(ref)
        return True
    except ColdsnapError:
        return False
