"""The vanilla-versus-restore benchmark, measured the way the product states it.

Before every sample the page cache is dropped. A vanilla sample launches the
engine and waits for the first non-empty streamed token of a validated reply.
A restore sample first prepares (admission, verifying and unpacking the
capsule: reported apart, off the clock, as it happens before eviction in
``sparkrun run``), then the clock runs from the start of the restore to the
first non-empty token of a reply that matches the one recorded at capture.
Samples alternate (vanilla, then each restore path) so drift on the host hits
every path alike. Several restore paths (drivers) can share one vanilla series.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sparkrun_coldsnap import __version__, controller
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.documents.request import RestoreRequest
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.errors import ColdsnapError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.progress import Progress
from sparkrun_coldsnap.weights.page_cache import drop as drop_page_cache

VANILLA = "vanilla"


@dataclass
class Sample:
    path: str  # "vanilla" or the name of a restore path
    index: int
    ttft_seconds: float
    prepare_seconds: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    validated: bool = True


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def run_paths(
    vanilla: RestoreRequest, restores: Mapping[str, tuple[RestoreRequest, CapsuleStore]], *, samples: int, progress: Progress,
    drop_cache: bool = True, settings_for: Mapping[str, Settings] | None = None,
) -> list[Sample]:  # fmt: skip
    """Alternate a vanilla start and every restore path, *samples* times; *settings_for* gives
    a path settings of its own (the plugin's switches) while it restores."""
    log_dir = paths.run_dir() / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: list[Sample] = []
    for i in range(samples):
        if drop_cache:
            drop_page_cache()
        progress.step("sample %d/%d: vanilla start" % (i + 1, samples))
        v = controller.start_vanilla(vanilla, log_path=log_dir / ("vanilla-%d.log" % i), progress=progress)
        v.unit.stop()
        results.append(Sample(VANILLA, i, v.ttft_seconds or 0.0, phases={p.name: p.seconds for p in v.receipt.phases}))
        progress.note("vanilla: first token after %.2f s" % (v.ttft_seconds or 0))
        for name, (req, store) in restores.items():
            time.sleep(1.0)  # let the stopped tree's memory go back first
            if drop_cache:
                drop_page_cache()
            progress.step("sample %d/%d: restore (%s)" % (i + 1, samples, name))
            prepared = controller.prepare_restore(req, store=store, settings=(settings_for or {}).get(name), progress=progress)
            r = controller.activate_restore(prepared, log_path=log_dir / ("restore-%s-%d.log" % (name, i)), progress=progress)
            r.unit.stop()
            phases = {p.name: p.seconds for p in r.receipt.phases}
            results.append(Sample(name, i, r.ttft_seconds or 0.0, prepare_seconds=prepared.prepare_seconds, phases=phases, validated=bool(r.receipt.validation and r.receipt.validation.passed)))
            progress.note("restore (%s): first token after %.2f s (prepared in %.2f s before the clock)" % (name, r.ttft_seconds or 0, prepared.prepare_seconds))
        time.sleep(1.0)
    return results


def run(req: RestoreRequest, *, store: CapsuleStore, samples: int, progress: Progress, drop_cache: bool = True) -> dict:
    """One restore path against vanilla; returns the results document."""
    results = run_paths(req, {req.workload.driver: (req, store)}, samples=samples, progress=progress, drop_cache=drop_cache)
    capsules = {req.workload.driver: {"ref": req.capsule.ref, "digest": store.resolve(req.capsule.ref).descriptor.digest}}
    return document(req, results, capsules=capsules, drop_cache=drop_cache)


def document(req: RestoreRequest, results: list[Sample], *, capsules: Mapping[str, dict], drop_cache: bool, extra: Mapping[str, object] | None = None) -> dict:
    van = [s.ttft_seconds for s in results if s.path == VANILLA]
    out_paths = {}
    for name in dict.fromkeys(s.path for s in results if s.path != VANILLA):
        mine = [s for s in results if s.path == name]
        phase_names = sorted({k for s in mine for k in s.phases})
        out_paths[name] = {
            "ttft": summary([s.ttft_seconds for s in mine]),
            "prepare": summary([s.prepare_seconds or 0.0 for s in mine]),
            "phases_median": {k: statistics.median([s.phases.get(k, 0.0) for s in mine]) for k in phase_names},
            "speedup_median": statistics.median(van) / statistics.median([s.ttft_seconds for s in mine]),
            "all_validated": all(s.validated for s in mine),
            "capsule": dict(capsules.get(name, {})),
        }
    first = next(iter(out_paths.values()))
    return {
        "format": 1,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": {"machine": platform.machine(), "kernel": platform.release(), "cpus": os.cpu_count()},
        "tool_version": __version__,
        "recipe": req.workload.recipe,
        "engine": req.workload.engine,
        "model": "%s@%s" % (req.workload.model.id, req.workload.model.revision),
        "page_cache_dropped": drop_cache,
        "vanilla_ttft": summary(van),
        "paths": out_paths,
        # The first (often only) restore path, flat, for readers of one-path results.
        "driver": next(iter(out_paths)),
        "restore_ttft": first["ttft"],
        "restore_prepare": first["prepare"],
        "restore_phases_median": first["phases_median"],
        "speedup_median": first["speedup_median"],
        "all_restores_validated": all(p["all_validated"] for p in out_paths.values()),
        **dict(extra or {}),
        "samples": [asdict(s) for s in results],
    }


def table(doc: dict) -> str:
    lines = ["%-44s %8s %8s %8s %3s" % ("", "median", "min", "max", "n")]

    def row(name: str, s: dict) -> None:
        lines.append("%-44s %7.2fs %7.2fs %7.2fs %3d" % (name, s["median"], s["min"], s["max"], s["n"]))

    row("vanilla start -> first token", doc["vanilla_ttft"])
    for name, p in doc["paths"].items():
        row("restore (%s) -> first token" % name, p["ttft"])
        row("  preparation, before the clock (%s)" % name, p["prepare"])
    for name, p in doc["paths"].items():
        parts = ", ".join("%s %.2fs" % (k, v) for k, v in p["phases_median"].items() if not k.startswith("prepare."))
        lines.append("%s: %.1fx faster than vanilla (medians); restore phases: %s" % (name, p["speedup_median"], parts))
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> Path | None:
    """Bars of the medians with every sample as a dot; None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [VANILLA, *doc["paths"]]
    medians = [doc["vanilla_ttft"]["median"]] + [p["ttft"]["median"] for p in doc["paths"].values()]
    labels = ["vanilla start"] + [("%s" if doc.get("lifecycle") else "ColdSnap restore (%s)") % n for n in doc["paths"]]
    fig, ax = plt.subplots(figsize=(7.5, 1.6 + 0.8 * len(names)), dpi=120)
    palette = ["#2b7bb9", "#e07b39", "#4d9e52"]
    colors = ["#9aa5b1"] + [palette[i % len(palette)] for i in range(len(names) - 1)]
    ax.barh(labels, medians, color=colors, height=0.55)
    top = max(medians + [s["ttft_seconds"] for s in doc["samples"]])
    for y, name in enumerate(names):
        xs = [s["ttft_seconds"] for s in doc["samples"] if s["path"] == name]
        ax.scatter(xs, [y] * len(xs), color="black", s=14, zorder=3, label="samples" if y == 0 else None)
        ax.text(max(xs + [medians[y]]) + top * 0.02, y, "median %.2f s" % medians[y], va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("seconds to first non-empty streamed token (page cache dropped)")
    speedups = ", ".join("%s %.1fx" % (n, p["speedup_median"]) for n, p in doc["paths"].items())
    ax.set_title("%s: %s faster (medians of %d)" % (doc["recipe"], speedups, doc["vanilla_ttft"]["n"]), fontsize=10)
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
