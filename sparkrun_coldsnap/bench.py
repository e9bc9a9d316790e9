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
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sparkrun_coldsnap import __version__, api
from sparkrun_coldsnap.capsule.capsule import Capsule
from sparkrun_coldsnap.capsule.media import A_UNPACKED_SIZE
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.documents.request import RestoreRequest
from sparkrun_coldsnap.documents.settings import Settings
from sparkrun_coldsnap.errors import ColdsnapError
from sparkrun_coldsnap.host import bandwidth, paths
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
    #: the restore phase's steps (criu restore, CUDA restore), timed from the progress they report
    steps: dict[str, float] = field(default_factory=dict)
    #: bytes each phase moved
    bytes: dict[str, int] = field(default_factory=dict)
    #: the first token of a warm server, as recorded at capture: what validation cannot beat
    first_token_floor: float | None = None
    #: the receipt's account of how weights and files were read (hydrate, weights_memory, ...)
    notes: dict = field(default_factory=dict)


class StepClock(Progress):
    """Progress that also notes when each step began, to time the steps inside a phase."""

    def __init__(self, inner: Progress) -> None:
        super().__init__(quiet=inner.quiet, stream=inner.stream)
        self.marks: list[tuple[float, str]] = []

    def step(self, text: str) -> None:
        self.marks.append((time.monotonic(), text))
        super().step(text)

    def durations(self, end: float) -> dict[str, float]:
        """Each step's seconds until the next began (the last until *end*), named by its first words."""
        out: dict[str, float] = {}
        for (t, text), (t_next, _) in zip(self.marks, self.marks[1:] + [(end, "")]):
            name = " ".join(text.split()[:2])
            out[name] = round(out.get(name, 0.0) + t_next - t, 4)
        return out


def phase_bytes(cap: Capsule, receipt) -> dict[str, int]:
    """What each phase of one restore read or wrote, from its capsule and receipt."""
    layers = cap.layers
    out = {
        "prepare.stage": sum(d.size for d in layers),
        "restore": sum(int((d.annotations or {}).get(A_UNPACKED_SIZE, d.size)) for d in layers),
    }
    for key in ("weights_memory", "weights_cache", "files_cache", "layers_cache"):
        detail = receipt.details.get(key) or {}
        read = detail.get("read", detail.get("bytes"))  # from the disk: a packed copy reads fewer than it writes
        if read:
            out["prepare." + key] = int(read)
    if receipt.weights is not None and receipt.weights.bytes:
        out["hydrate"] = int(receipt.weights.bytes)
    return out


#: what a restore's receipt says that its sample keeps (``notes``): hydration, preparation's
#: reads, the memory fill, and the major faults (waits on the disk) of CRIU and of the restore
NOTED = (
    "hydrate", "hydrate_release", "weights_memory", "weights_cache", "files_cache", "layers_cache", "staged_images",
    "criu_restore_seconds", "criu_restore_major_faults", "activation_major_faults", "page_fill",
)  # fmt: skip

#: the seconds a worker reports for the steps of its hydration from memory
HYDRATE_STEPS = ("open_seconds", "register_seconds", "copy_seconds", "fill_wait_seconds")


def hydrate_steps(notes: Mapping) -> dict[str, float]:
    """The steps inside hydration, from the workers' reports: the slowest worker's, since
    hydration ends when the last one does."""
    reports = [r for r in notes.get("hydrate") or () if isinstance(r, Mapping)]
    return {key.removesuffix("_seconds"): max(float(r[key]) for r in reports if key in r) for key in HYDRATE_STEPS if any(key in r for r in reports)}


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def run_paths(
    vanilla: RestoreRequest, restores: Mapping[str, tuple[RestoreRequest, CapsuleStore]], *, samples: int, progress: Progress,
    drop_cache: bool = True, settings_for: Mapping[str, Settings] | None = None, with_vanilla: bool = True,
    before_each: Callable[[str], None] | None = None,
) -> list[Sample]:  # fmt: skip
    """Alternate a vanilla start and every restore path, *samples* times; *settings_for* gives
    a path settings of its own (the plugin's switches) while it restores. Without
    *with_vanilla*, the restores alone: a check that each path works, with no ratio.
    *before_each* runs before each start and each restore's preparation, given its path's
    name (a bench that empties the engine's compile caches, as on a fresh node)."""
    log_dir = paths.run_dir() / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: list[Sample] = []
    for i in range(samples):
        if with_vanilla:
            if before_each is not None:
                before_each(VANILLA)
            if drop_cache:
                drop_page_cache()
            progress.step("sample %d/%d: vanilla start" % (i + 1, samples))
            v = api.start_vanilla(vanilla, log_path=log_dir / ("vanilla-%d.log" % i), progress=progress)
            v.unit.stop()
            results.append(Sample(VANILLA, i, v.ttft_seconds or 0.0, phases={p.name: p.seconds for p in v.receipt.phases}))
            progress.note("vanilla: first token after %.2f s" % (v.ttft_seconds or 0))
        for name, (req, store) in restores.items():
            time.sleep(1.0)  # let the stopped tree's memory go back first
            if before_each is not None:
                before_each(name)
            if drop_cache:
                drop_page_cache()
            progress.step("sample %d/%d: restore (%s)" % (i + 1, samples, name))
            prepared = api.prepare_restore(req, store=store, settings=(settings_for or {}).get(name), progress=progress)
            clock = StepClock(progress)
            t_start = time.monotonic()
            r = api.activate_restore(prepared, log_path=log_dir / ("restore-%s-%d.log" % (name, i)), progress=clock)
            r.unit.stop()
            phases = {p.name: p.seconds for p in r.receipt.phases}
            restore_end = t_start + phases.get("restore", 0.0)
            results.append(
                Sample(
                    name, i, r.ttft_seconds or 0.0, prepare_seconds=prepared.prepare_seconds, phases=phases,
                    validated=bool(r.receipt.validation and r.receipt.validation.passed), steps=clock.durations(restore_end),
                    bytes=phase_bytes(prepared.capsule, r.receipt), first_token_floor=prepared.capsule.config.validation.request_ttft_seconds,
                    notes={k: r.receipt.details[k] for k in NOTED if k in r.receipt.details},
                )
            )  # fmt: skip
            progress.note("restore (%s): first token after %.2f s (prepared in %.2f s before the clock)" % (name, r.ttft_seconds or 0, prepared.prepare_seconds))
        time.sleep(1.0)
    return results


def run(req: RestoreRequest, *, store: CapsuleStore, samples: int, progress: Progress, drop_cache: bool = True) -> dict:
    """One restore path against vanilla; returns the results document."""
    results = run_paths(req, {req.workload.driver: (req, store)}, samples=samples, progress=progress, drop_cache=drop_cache)
    capsules = {req.workload.driver: {"ref": req.capsule.ref, "digest": store.resolve(req.capsule.ref).descriptor.digest}}
    progress.step("measuring this machine's bandwidths (disk, page cache, fresh memory)")
    measured = bandwidth.measure(largest_file(req.workload.model.path), drop_cache=drop_cache)
    return document(req, results, capsules=capsules, drop_cache=drop_cache, bandwidth=measured)


def largest_file(directory: str | None) -> Path | None:
    """The largest file below *directory* (the weights, for a disk read of some size)."""
    files = [p for p in Path(directory).rglob("*") if p.is_file()] if directory else []
    return max(files, key=lambda p: p.stat().st_size, default=None)


def _medians(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    keys = sorted({k for r in rows for k in r})
    return {k: statistics.median([r[k] for r in rows if k in r]) for k in keys}


#: which of the machine's bandwidths bounds each phase (hydration: host to device where it
#: was measured, else the page cache it copies from; a cold one reads the disk)
BOUND_BY = {
    "prepare.stage": "disk_read", "prepare.weights_cache": "disk_read", "prepare.files_cache": "disk_read", "prepare.weights_memory": "disk_read",
    "prepare.layers_cache": "disk_read",
    "restore": "memory_write", "hydrate": "host_to_device",
}  # fmt: skip


def rates(path: Mapping, bandwidth: Mapping[str, float], first_token_floor: float | None) -> dict:
    """Each phase's bytes and rate beside the machine's bandwidth for it, and the floor: the
    on-clock phases at those bandwidths plus a warm server's first token."""
    phases, moved = path["phases_median"], path["bytes_median"]
    out: dict = {"phases": {}, "bandwidth": dict(bandwidth)}
    floor = first_token_floor or 0.0
    for name, nbytes in moved.items():
        bound = BOUND_BY.get(name)
        if name == "restore" and path.get("page_fill") and "memory_write_parallel" in bandwidth:
            bound = "memory_write_parallel"
        if name == "hydrate" and "host_to_device" not in bandwidth:
            bound = "page_cache_read"
        if name == "hydrate" and not {"prepare.weights_cache", "prepare.weights_memory"} & set(moved) and "disk_read" in bandwidth:
            bound = "disk_read"  # nothing was read ahead: hydration reads the disk
        seconds = phases.get(name)
        row = {"bytes": nbytes, "seconds": seconds, "rate": nbytes / seconds if seconds else None, "bound_by": bound, "machine": bandwidth.get(bound or "")}
        if row["machine"]:
            row["floor_seconds"] = nbytes / row["machine"]
            if not name.startswith("prepare."):
                floor += row["floor_seconds"]
        out["phases"][name] = row
    out["first_token_floor"] = first_token_floor
    out["floor_seconds"] = floor
    # a node with nothing prepared reads the capsule, the files the tree maps and the weights
    # (as preparation read them: a packed copy is fewer bytes) from the disk; the restore can
    # run once the first two are read, beside the weights' read, so the floor is the longer of
    # the two ways
    disk = bandwidth.get("disk_read")
    if disk:
        weights = moved.get("prepare.weights_memory") or moved.get("prepare.weights_cache") or moved.get("hydrate", 0)
        first = moved.get("prepare.layers_cache", moved.get("prepare.stage", 0)) + moved.get("prepare.files_cache", 0)
        memory = out["phases"].get("restore", {}).get("machine") or bandwidth.get("memory_write", float("inf"))
        out["cold_floor_seconds"] = max((first + weights) / disk, first / disk + moved.get("restore", 0) / memory) + (first_token_floor or 0.0)
    return out


def document(
    req: RestoreRequest, results: list[Sample], *, capsules: Mapping[str, dict], drop_cache: bool, extra: Mapping[str, object] | None = None,
    bandwidth: Mapping[str, float] | None = None,
) -> dict:  # fmt: skip
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
            # preparation and activation together: what a node with nothing prepared waits
            "total": summary([(s.prepare_seconds or 0.0) + s.ttft_seconds for s in mine]),
            "steps_median": _medians([s.steps for s in mine]),
            "hydrate_steps_median": _medians([hydrate_steps(s.notes) for s in mine]),
            "bytes_median": {k: int(v) for k, v in _medians([s.bytes for s in mine]).items()},
            # the restored memory written by several threads after criu restore, or by CRIU alone
            "page_fill": any(s.notes.get("page_fill") for s in mine),
        }
        floors = [s.first_token_floor for s in mine if s.first_token_floor]
        if bandwidth:
            out_paths[name]["rates"] = rates(out_paths[name], bandwidth, statistics.median(floors) if floors else None)
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
        "bandwidth": dict(bandwidth or {}),
        **dict(extra or {}),
        "samples": [asdict(s) for s in results],
    }


def table(doc: dict) -> str:
    lines = ["%-52s %8s %8s %8s %3s" % ("", "median", "min", "max", "n")]

    def row(name: str, s: dict) -> None:
        lines.append("%-52s %7.2fs %7.2fs %7.2fs %3d" % (name, s["median"], s["min"], s["max"], s["n"]))

    row("vanilla start -> first token", doc["vanilla_ttft"])
    for name, p in doc["paths"].items():
        row("restore (%s) -> first token" % name, p["ttft"])
        row("  preparation, before the clock (%s)" % name, p["prepare"])
        if "total" in p:
            row("  preparation + restore, nothing prepared (%s)" % name, p["total"])
    for name, p in doc["paths"].items():
        parts = ", ".join("%s %.2fs" % (k, v) for k, v in p["phases_median"].items() if not k.startswith("prepare."))
        lines.append("%s: %.1fx faster than vanilla (medians); restore phases: %s" % (name, p["speedup_median"], parts))
        if p.get("steps_median"):
            lines.append("  inside restore: %s" % ", ".join("%s %.2fs" % kv for kv in p["steps_median"].items()))
        if p.get("hydrate_steps_median"):
            lines.append("  inside hydrate: %s" % ", ".join("%s %.2fs" % kv for kv in p["hydrate_steps_median"].items()))
        lines += rate_lines(p.get("rates"), p["ttft"]["median"], p.get("total", {}).get("median"))
    return "\n".join(lines)


def rate_lines(r: Mapping | None, measured: float, total: float | None) -> list[str]:
    if not r:
        return []
    out = []
    for name, row in r["phases"].items():
        rate = "%.2f GB/s" % (row["rate"] / 1e9) if row.get("rate") else "-"
        machine = "%.2f GB/s %s" % (row["machine"] / 1e9, row["bound_by"].replace("_", " ")) if row.get("machine") else "not measured"
        out.append("  %-24s %8.2f GB %8s   machine: %s" % (name, row["bytes"] / 1e9, rate, machine))
    out.append("  floor to first token %.2fs (measured %.2fs)%s" % (r["floor_seconds"], measured, "" if r.get("first_token_floor") else ", without the first token"))
    if r.get("cold_floor_seconds") and total is not None:
        out.append("  floor with nothing prepared %.2fs (measured preparation + restore %.2fs)" % (r["cold_floor_seconds"], total))
    return out


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
    # long path names wrapped, so the bars keep their width and the title stays over them
    labels = ["vanilla start"] + [textwrap.fill(("%s" if doc.get("lifecycle") else "ColdSnap restore (%s)") % n, 36) for n in doc["paths"]]
    # a restore's preparation + restore (what a node with nothing prepared waits), drawn faint behind it
    totals = [None] + [(p.get("total") or {}).get("median") if not doc.get("lifecycle") else None for p in doc["paths"].values()]
    fig, ax = plt.subplots(figsize=(10, 1.8 + 0.8 * len(names)), dpi=120)
    palette = ["#2b7bb9", "#e07b39", "#4d9e52"]
    colors = ["#9aa5b1"] + [palette[i % len(palette)] for i in range(len(names) - 1)]
    shown = [t for t in totals if t]
    if shown:
        ax.barh(labels, [t or 0.0 for t in totals], color=colors, alpha=0.25, height=0.55, label="preparation + restore")
    ax.barh(labels, medians, color=colors, height=0.55)
    top = max(medians + shown + [s["ttft_seconds"] for s in doc["samples"]])
    for y, name in enumerate(names):
        xs = [s["ttft_seconds"] for s in doc["samples"] if s["path"] == name]
        ax.scatter(xs, [y] * len(xs), color="black", s=14, zorder=3, label="samples" if y == 0 else None)
        text = "median %.2f s" % medians[y] + (" (with preparation %.2f s)" % totals[y] if totals[y] else "")
        ax.text(max(xs + [medians[y], totals[y] or 0.0]) + top * 0.02, y, text, va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("seconds to first non-empty streamed token (page cache dropped)")
    speedups = ", ".join("%s %.1fx" % (n, p["speedup_median"]) for n, p in doc["paths"].items())
    title = "%s: %s faster (medians of %d)" % (doc["recipe"], speedups, doc["vanilla_ttft"]["n"])
    ax.set_title(textwrap.fill(title, 64), fontsize=10)
    ax.set_xlim(0, top * 1.45)
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
