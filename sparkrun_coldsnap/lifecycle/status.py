"""What ``sparkrun coldsnap status`` reports: every managed workload, its state, what it holds."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import psutil

from sparkrun_coldsnap.host.process_tree import tree_pids
from sparkrun_coldsnap.host.runner import run
from sparkrun_coldsnap.lifecycle import records, settle, verbs, warm
from sparkrun_coldsnap.lifecycle.records import WorkloadRecord


def host_memory(root_pid: int | None) -> int:
    """Resident bytes of the workload's process tree (0 when nothing runs)."""
    total = 0
    for pid in tree_pids(root_pid) if root_pid else []:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    return total


def gpu_memory(root_pid: int | None) -> int | None:
    """Device bytes the tree's processes hold, from ``nvidia-smi`` (None: no NVIDIA tools here)."""
    if not root_pid or shutil.which("nvidia-smi") is None:
        return None
    pids = set(tree_pids(root_pid))
    out = run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"], timeout=30, check=False)
    if out.returncode != 0:
        return None
    total = 0
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in pids and parts[1].isdigit():
            total += int(parts[1]) * 1024 * 1024
    return total


def staged_bytes(rec: WorkloadRecord) -> int:
    if rec.warm is None:
        return 0
    root = Path(rec.warm.staging)
    return sum(f.stat().st_blocks * 512 for f in root.rglob("*") if f.is_file()) if root.is_dir() else 0


def row(rec: WorkloadRecord) -> dict[str, Any]:
    alive = rec.root_pid is not None and psutil.pid_exists(rec.root_pid)
    return {
        "workload": rec.workload,
        "state": rec.state,
        "since": rec.since,
        "recipe": rec.recipe,
        "capsule": rec.capsule_ref,
        "capsule_digest": rec.capsule_digest,
        "engine": rec.engine,
        "driver": rec.driver,
        "port": rec.port,
        "root_pid": rec.root_pid if alive else None,
        "host_memory_bytes": host_memory(rec.root_pid) if alive else 0,
        "gpu_memory_bytes": gpu_memory(rec.root_pid) if alive else None,
        "sleep_level": rec.sleep_level,
        "warm": {
            "staged_bytes": staged_bytes(rec),
            "expires_at": rec.warm.expires_at,
            "weights_cached": rec.warm.weights_cached,
            "tree_pid": rec.warm.tree_pid,
        }
        if rec.warm
        else None,  # fmt: skip
        "transition": rec.transition.model_dump() if rec.transition else None,
        "note": rec.note,
        "last_receipt": rec.last_receipt,
    }


def status(spec: str | None = None, where: verbs.Where = verbs.Where()) -> list[dict[str, Any]]:
    """Rows for *spec* (a recipe or a workload name), else for every managed workload; interrupted
    transitions are settled first, expired warm restores released."""
    if spec:
        chosen = [verbs.locate(spec, where)]  # releases expired warm restores and forgets stopped workloads too
    else:
        verbs.release_expired()
        verbs.forget_stopped()
        verbs.release_stopped_warm()
        chosen = records.all_records()
    out = []
    for rec in chosen:
        if rec.transition is not None and not settle.process_alive(rec.transition.pid):
            try:
                with records.locked(rec.workload):
                    rec = settle.settle(records.require(rec.workload), verbs.capsule_present(rec), warm.release_dir)
            except records.Busy:
                pass
        out.append(row(rec))
    return out


def describe(r: dict[str, Any]) -> str:
    """One workload in a few lines, for people."""
    mib = 1024 * 1024
    held = "host %d MiB" % (r["host_memory_bytes"] // mib)
    if r["gpu_memory_bytes"]:
        held += ", GPU %d MiB" % (r["gpu_memory_bytes"] // mib)
    state = r["state"] + (" (level %d)" % r["sleep_level"] if r["sleep_level"] else "")
    if r["transition"]:
        t = r["transition"]
        state += ", %s to %s in progress (pid %d)" % (t["verb"], t["target"], t["pid"])
    lines = ["%s  %s since %s" % (r["workload"], state, r["since"]), "  recipe %s, %s/%s on port %d" % (r["recipe"], r["engine"], r["driver"], r["port"])]
    lines.append("  capsule %s%s" % (r["capsule"] or "none (started vanilla)", " (%s)" % r["capsule_digest"][:19] if r["capsule_digest"] else ""))
    lines.append("  holds %s%s" % (held, ", pid %d" % r["root_pid"] if r["root_pid"] else ""))
    if r["warm"] and r["warm"].get("tree_pid"):
        lines.append("  warm: process tree restored ahead (pid %d, engine asleep, weights not hydrated), kept until %s" % (r["warm"]["tree_pid"], r["warm"]["expires_at"]))
    elif r["warm"]:
        lines.append("  warm: %d MiB staged, kept until %s%s" % (r["warm"]["staged_bytes"] // mib, r["warm"]["expires_at"], ", weights in the page cache" if r["warm"]["weights_cached"] else ""))
    if r["note"]:
        lines.append("  note: %s" % r["note"])
    return "\n".join(lines)
