"""Where the host's tasks wait in the kernel while a command runs: every few milliseconds the
kernel stack of each task that is running or in uninterruptible sleep is read from /proc, and
the samples are counted by command name and the stack's top frames; per process, the seconds
blocked by kind of wait. With the memory counters of /proc/vmstat (compaction stalls, huge-page
faults, major faults) before and after.

    python3 benchmarks/gpu/kernel_waits.py run --out $OUT/waits.json -- bash benchmarks/gpu/floor.sh smoke
    python3 benchmarks/gpu/kernel_waits.py compare --out docs/benchmarks/NAME \\
        --run before=waits-before.json --role before:1227="restored engine" --run after=waits-after.json ...

Diagnostic only (root: the stacks are readable by root alone). ``compare`` writes NAME.json
(seconds blocked per process role and kind of wait, per run) and NAME.png.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import threading
import time
from pathlib import Path

VMSTAT_KEYS = ("compact_stall", "compact_fail", "compact_success", "thp_fault_alloc", "thp_fault_fallback", "pgmajfault", "allocstall_normal", "allocstall_movable", "pgscan_direct")
FRAMES = 6
#: the kind of a wait, by the first frame of its stack that names one
KINDS = (
    ("__iomap_dio_rw", "direct read"),
    ("filemap_fault", "file page fault"),
    ("filemap_get_pages", "file read"),
    ("__wait_on_buffer", "file-system metadata"),
    ("blk_mq_get_tag", "disk queue full"),
)


def vmstat() -> dict[str, int]:
    out = {}
    for line in Path("/proc/vmstat").read_text().splitlines():
        k, _, v = line.partition(" ")
        if k in VMSTAT_KEYS:
            out[k] = int(v)
    return out


def busy_tasks(own: int):
    """(pid, tid, comm, state) of every task running or in uninterruptible sleep."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == own:
            continue
        try:
            tids = os.listdir("/proc/%s/task" % pid)
        except OSError:
            continue
        for tid in tids:
            try:
                stat = Path("/proc/%s/task/%s/stat" % (pid, tid)).read_text()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            state = stat[stat.rindex(")") + 2]
            if state in "RD":
                yield pid, tid, comm, state


def stack_of(pid: str, tid: str) -> str:
    try:
        lines = Path("/proc/%s/task/%s/stack" % (pid, tid)).read_text().splitlines()
    except OSError:
        return "?"
    frames = [line.split("] ", 1)[-1].split("+")[0] for line in lines]
    return " < ".join(frames[:FRAMES]) or "(user space)"


def cmdline_of(pid: str) -> str:
    try:
        return Path("/proc/%s/cmdline" % pid).read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
    except OSError:
        return ""


def sample(stop: threading.Event, every: float, counts: collections.Counter, timeline: list, cmdlines: dict) -> None:
    own, t0 = os.getpid(), time.monotonic()
    while not stop.is_set():
        now = time.monotonic() - t0
        for pid, tid, comm, state in busy_tasks(own):
            stack = stack_of(pid, tid)
            counts["%s [%s] %s" % (comm, state, stack)] += 1
            if state == "D" or comm == "criu":
                timeline.append((round(now, 3), pid, tid, comm, state, stack))
                cmdlines[pid] = cmdline_of(pid) or cmdlines.get(pid, "")  # the last one seen: a restored task ends as itself
        stop.wait(every)


def kind_of(stack: str) -> str:
    for frame, kind in KINDS:
        if frame in stack:
            return kind
    return "other"


def blocked_by_task(doc: dict) -> list[dict]:
    """Per process and kind of wait: seconds blocked (samples in uninterruptible sleep times the
    sampling period, summed over its threads), and when the first and last were seen."""
    every = doc.get("every", 0.005)
    spans: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    comms: dict[str, str] = {}
    for t, pid, _tid, comm, state, stack in doc["timeline"]:
        if state == "D":
            spans[(pid, kind_of(stack))].append(t)
            comms.setdefault(pid, comm)
    out = [
        {"pid": int(pid), "comm": comms[pid], "cmdline": doc.get("cmdlines", {}).get(pid, ""), "kind": kind, "seconds": round(len(ts) * every, 3), "first": min(ts), "last": max(ts)}
        for (pid, kind), ts in spans.items()
    ]  # fmt: skip
    return sorted(out, key=lambda r: -r["seconds"])


def cmd_run(args) -> None:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    thp = {n: Path("/sys/kernel/mm/transparent_hugepage/%s" % n).read_text().strip() for n in ("enabled", "defrag")}
    counts: collections.Counter = collections.Counter()
    timeline: list = []
    cmdlines: dict = {}
    stop = threading.Event()
    before = vmstat()
    sampler = threading.Thread(target=sample, args=(stop, args.every, counts, timeline, cmdlines), daemon=True)
    sampler.start()
    rc = subprocess.call(command)
    stop.set()
    sampler.join()
    after = vmstat()
    doc = {
        "command": command, "exit": rc, "every": args.every, "transparent_hugepage": thp, "vmstat_delta": {k: after.get(k, 0) - before.get(k, 0) for k in VMSTAT_KEYS},
        "busiest": counts.most_common(60), "cmdlines": cmdlines, "timeline": timeline,
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print("transparent huge pages:", thp, "vmstat delta:", doc["vmstat_delta"])
    for key, n in counts.most_common(25):
        print("%6d  %s" % (n, key[:230]))
    for r in blocked_by_task(doc)[:15]:
        print("%7.3f s  %-8s %-18s %-22s %.2f-%.2f  %s" % (r["seconds"], r["pid"], r["comm"][:18], r["kind"], r["first"], r["last"], r["cmdline"][:80]))
    raise SystemExit(rc)


def cmd_compare(args) -> None:
    runs = dict(item.split("=", 1) for item in args.run)
    roles: dict[str, dict[str, str]] = collections.defaultdict(dict)
    for item in args.role:
        where, _, name = item.partition("=")
        label, _, pid = where.partition(":")
        roles[label][pid] = name
    summary: dict = {"every_seconds": {}, "vmstat_delta": {}, "blocked": {}}
    for label, path in runs.items():
        doc = json.loads(Path(path).read_text())
        summary["every_seconds"][label] = doc.setdefault("every", args.every)
        summary["vmstat_delta"][label] = doc["vmstat_delta"]
        rows = []
        for r in blocked_by_task(doc):
            r["role"] = roles[label].get(str(r["pid"]), "other processes")
            rows.append(r)
        summary["blocked"][label] = rows
    Path(args.out + ".json").write_text(json.dumps(summary, indent=1))
    plot(summary, Path(args.out + ".png"), args.title)
    print("%s.json %s.png" % (args.out, args.out))


def plot(summary: dict, png: Path, title: str) -> None:
    """One bar per role and kind of wait (the larger ones), one colour per run. The payload
    copy's own direct reads are left out: its threads wait on the disk by design, and their sum
    over 16 threads would hide the rest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    totals: dict[tuple[str, str], dict[str, float]] = collections.defaultdict(dict)
    for label, rows in summary["blocked"].items():
        for r in rows:
            if r["kind"] == "direct read":
                continue
            key = (r["role"], r["kind"])
            totals[key][label] = totals[key].get(label, 0.0) + r["seconds"]
    keys = sorted((k for k, v in totals.items() if max(v.values()) >= 0.1), key=lambda k: -max(totals[k].values()))
    labels = list(summary["blocked"])
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(keys) + 1.6))
    height = 0.8 / len(labels)
    for i, label in enumerate(labels):
        ys = [n + i * height for n in range(len(keys))]
        values = [totals[k].get(label, 0.0) for k in keys]
        ax.barh(ys, values, height=height, label=label)
        for y, v in zip(ys, values):
            ax.text(v, y, " %.2f s" % v, va="center", fontsize=8)
    ax.set_yticks([n + height * (len(labels) - 1) / 2 for n in range(len(keys))], ["%s: %s" % k for k in keys], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds blocked in the kernel, summed over threads (the copy's direct reads left out)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    run = sub.add_parser("run", help="sample the kernel stacks while a command runs")
    run.add_argument("--out", required=True)
    run.add_argument("--every", type=float, default=0.01, help="seconds between samples")
    run.add_argument("command", nargs=argparse.REMAINDER)
    compare = sub.add_parser("compare", help="seconds blocked per process role and kind of wait, for several runs, with a plot")
    compare.add_argument("--out", required=True, help="path without extension: .json and .png are written")
    compare.add_argument("--run", action="append", required=True, help="LABEL=waits.json")
    compare.add_argument("--role", action="append", default=[], help="LABEL:PID=role name")
    compare.add_argument("--every", type=float, default=0.005, help="the sampling period of runs that did not record it")
    compare.add_argument("--title", default="where the restore's processes waited")
    args = ap.parse_args()
    {"run": cmd_run, "compare": cmd_compare}[args.verb](args)


if __name__ == "__main__":
    main()
