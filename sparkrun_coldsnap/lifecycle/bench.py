"""``bench --lifecycle``: the transitions timed, beside a vanilla start in the same run.

Each sample, in this order, on the recipe's workload (brought up once with ``sparkrun run``):

* ``vanilla``: a vanilla engine start to its first validated token (the baseline);
* ``sleep`` and ``wake_from_sleep`` (GPU engines only: the CPU engine has no sleep mode):
  the release in place, then waking to the first validated token;
* ``hibernate``: the live workload captured and stopped (the whole transition);
* ``wake_from_hibernate``: the page cache dropped, then ``wake`` through ``sparkrun run``: the
  restore's time to first token (its preparation reported apart, as the restore benchmark does);
* ``activate_from_warm``: hibernated again, ``warm`` (reported as its preparation), then
  ``sparkrun run``: the time to first token of the activation alone.

A path's figure is seconds to its first validated token, or for ``sleep`` and ``hibernate`` to
the end of the transition; ratios are the vanilla median over the path's median.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from sparkrun_coldsnap import api
from sparkrun_coldsnap import bench as bench_mod
from sparkrun_coldsnap.bench import VANILLA, Sample
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.documents.receipts import Receipt
from sparkrun_coldsnap.documents.request import RestoreRequest
from sparkrun_coldsnap.errors import ColdsnapError
from sparkrun_coldsnap.host import paths
from sparkrun_coldsnap.lifecycle import records, verbs
from sparkrun_coldsnap.progress import Progress
from sparkrun_coldsnap.weights.page_cache import drop as drop_page_cache


def _phases(receipt: Receipt) -> dict[str, float]:
    return {p.name: p.seconds for p in receipt.phases}


def _restore_sample(path: str, i: int, wake_receipt: Receipt, *, prepare: float | None = None) -> Sample:
    """The restore ``sparkrun run`` made for a wake or an activation, as a sample."""
    restore = Receipt.model_validate(json.loads(Path(str(wake_receipt.details.get("restore_receipt"))).read_text()))
    ttft = restore.validation.ttft_seconds if restore.validation and restore.validation.ttft_seconds else 0.0
    prep = prepare if prepare is not None else float(restore.details.get("prepare_seconds", 0.0))
    return Sample(path, i, ttft, prepare_seconds=prep, phases=_phases(restore), validated=bool(restore.validation and restore.validation.passed))


def run(req: RestoreRequest, *, recipe: str, where: verbs.Where, store: CapsuleStore, samples: int, progress: Progress, drop_cache: bool = True) -> dict:
    """Time every transition the workload's engine has, *samples* times; returns the results document."""
    from sparkrun_coldsnap.integration import planning

    log_dir = paths.run_dir() / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: list[Sample] = []
    name = req.workload_name
    rc = planning.run_recipe(
        recipe, hosts=where.hosts, cluster=where.cluster, overrides=where.overrides or {}, offline=where.offline, require_capsule=True, receipt=None,
        store=str(store.root), dry_run=False,
    )  # fmt: skip
    if rc != 0:
        raise ColdsnapError("sparkrun run %s ended with exit status %d" % (recipe, rc))
    name = current(name)
    can_sleep = verbs.cannot_sleep(records.require(name)) is None
    try:
        for i in range(samples):
            progress.step("sample %d/%d: hibernate the workload, then a vanilla start" % (i + 1, samples))
            if can_sleep:
                _, slept = verbs.sleep(name)
                results.append(Sample("sleep", i, slept.total_seconds, phases=_phases(slept)))
                _, woke = verbs.wake(name)
                ttft = woke.validation.ttft_seconds if woke.validation and woke.validation.ttft_seconds else woke.total_seconds
                results.append(Sample("wake_from_sleep", i, ttft, phases=_phases(woke), validated=bool(woke.validation and woke.validation.passed)))
            _, hib = verbs.hibernate(name, progress=progress)
            results.append(Sample("hibernate", i, hib.total_seconds, phases=_phases(hib)))
            # The port and the cores are free while it is hibernated: the vanilla baseline runs now.
            if drop_cache:
                drop_page_cache()
            v = api.start_vanilla(req, log_path=log_dir / ("lifecycle-vanilla-%d.log" % i), progress=progress)
            v.unit.stop()
            results.append(Sample(VANILLA, i, v.ttft_seconds or 0.0, phases=_phases(v.receipt)))
            time.sleep(1.0)
            if drop_cache:
                drop_page_cache()
            progress.step("sample %d/%d: wake from hibernation" % (i + 1, samples))
            rec, woke = verbs.wake(name)
            name = rec.workload  # a wake is a `sparkrun run`, which a status-aware scheduler names anew
            results.append(_restore_sample("wake_from_hibernate", i, woke))
            verbs.hibernate(name, progress=progress)
            progress.step("sample %d/%d: warm, then activate" % (i + 1, samples))
            _, warmed = verbs.prepare_warm(name, progress=progress)
            rec, woke = verbs.wake(name)
            name = rec.workload
            results.append(_restore_sample("activate_from_warm", i, woke, prepare=warmed.total_seconds))
            progress.note("sample %d: %s" % (i + 1, ", ".join("%s %.2f s" % (s.path, s.ttft_seconds) for s in results if s.index == i)))
    finally:
        left = records.find(name)
        if left is not None and left.root_pid and left.state in ("active", "sleeping"):
            from sparkrun_coldsnap.host.process_tree import kill_tree

            kill_tree(left.root_pid)
            records.remove(left.workload)
    capsules = {"wake_from_hibernate": {"ref": verbs.hibernation_tag(name)}}
    return bench_mod.document(req, results, capsules=capsules, drop_cache=drop_cache, extra={"lifecycle": True})


def current(name: str) -> str:
    """The name the workload *name* planned as is recorded under (a run may have named it anew)."""
    rec = records.find(name)
    if rec is None:
        raise ColdsnapError("the workload sparkrun run started is not recorded here (planned as %s)" % name)
    return rec.workload


WHAT = {
    "sleep": "sleep (release in place) -> done",
    "wake_from_sleep": "wake from sleep -> first token",
    "hibernate": "hibernate (capture live, stop) -> done",
    "wake_from_hibernate": "wake from hibernation -> first token",
    "activate_from_warm": "activate from warm (sparkrun run) -> first token",
}


def table(doc: dict) -> str:
    lines = ["%-52s %8s %8s %8s %3s %8s" % ("", "median", "min", "max", "n", "vs start")]

    def row(name: str, s: dict, ratio: float | None) -> None:
        lines.append("%-52s %7.2fs %7.2fs %7.2fs %3d %8s" % (name, s["median"], s["min"], s["max"], s["n"], "%.1fx" % ratio if ratio else ""))

    row("vanilla start -> first token", doc["vanilla_ttft"], None)
    for name, p in doc["paths"].items():
        row(WHAT.get(name, name), p["ttft"], p["speedup_median"])
        if name in ("wake_from_hibernate", "activate_from_warm"):
            row("  %s, before the clock" % ("preparation" if name == "wake_from_hibernate" else "warm"), p["prepare"], None)
    return "\n".join(lines)
