"""Soak: restore the same capsule N times in a row through sparkrun, validating each.

Each run is what a user does: `sparkrun run RECIPE` (the plugin admits, stages, restores and
validates the capsule: its receipt must say `succeeded` with the recorded reply), one chat
completion asked from outside, then `sparkrun stop RECIPE`, after which no engine process may
remain and the port must be free. The capsule is captured first (into a private store) when it
is missing. Reports passes/runs and the drift of the time to first token across runs (medians of
the first and last tenth, and a least-squares slope), as JSON and a plot.

Run as root on the embedded default, holding the engine lock the test suite uses:

    flock /tmp/coldsnap-engine.lock .venv/bin/python benchmarks/soak.py --runs 100 --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PROMPT = "Reply with one short sentence: what is a cold start?"


def sparkrun(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    cp = subprocess.run([str(BIN / "sparkrun"), *args], capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    if cp.returncode != 0:
        raise RuntimeError("sparkrun %s failed (%d): %s" % (" ".join(args), cp.returncode, (cp.stderr or cp.stdout).strip()[-800:]))
    return cp


def soak_recipe(source: Path, store: Path, directory: Path) -> Path:
    """The recipe with its capsule in *store* (the rest unchanged)."""
    text = source.read_text()
    head = text[: text.index("coldsnap:")]
    block = "coldsnap:\n  engine_env: vllm-cpu\n  capsule:\n    name: soak\n    store: %s\n  validation:\n    prompt: %r\n    max_tokens: 16\n" % (store, PROMPT)
    path = directory / "soak.yaml"
    path.write_text(head + block)
    return path


def tree_of(root_pid: int | None) -> list[psutil.Process]:
    if not root_pid:
        return []
    try:
        root = psutil.Process(root_pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def wait_stopped(procs: list[psutil.Process], port: int, timeout: float = 30) -> bool:
    """The restored tree's processes are gone and the port is free (other engines on the host are not ours)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive and port_free(port):
            return True
        time.sleep(0.1)
    return False


def ask(port: int) -> str:
    r = requests.post(
        "http://127.0.0.1:%d/v1/chat/completions" % port,
        json={"model": "coldsnap/tiny-qwen2", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "temperature": 0},
        timeout=60,
    )
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def newest_receipt(store: Path, seen: set[Path]) -> dict | None:
    fresh = sorted(set((store / "receipts" / "soak").glob("*-restore.json")) - seen)
    if not fresh:
        return None
    seen.update(fresh)
    return json.loads(fresh[-1].read_text())


def one_run(recipe: Path, store: Path, seen: set[Path], expected: str, port: int) -> dict:
    t = time.monotonic()
    row: dict = {"passed": False}
    procs: list[psutil.Process] = []
    try:
        sparkrun("run", str(recipe), "-H", "localhost", "--no-follow")
        row["run_seconds"] = round(time.monotonic() - t, 3)
        receipt = newest_receipt(store, seen)
        if receipt is None:
            raise RuntimeError("sparkrun run wrote no restore receipt")
        procs = tree_of((receipt.get("details") or {}).get("root_pid"))
        v = receipt.get("validation") or {}
        row.update(state=receipt["state"], ttft_seconds=v.get("ttft_seconds"), restore_seconds=_phase(receipt, "restore"), validated=bool(v.get("passed")))
        reply = ask(port)
        row["reply_matches"] = reply == expected
        row["passed"] = receipt["state"] == "succeeded" and row["validated"] and row["reply_matches"]
    except Exception as err:  # noqa: BLE001 - a failed run is counted and named, the soak goes on
        row["error"] = str(err)[:500]
    finally:
        try:
            sparkrun("stop", str(recipe), "-H", "localhost")
        except RuntimeError as err:
            row["stop_error"] = str(err)[:300]
        row["stopped_clean"] = wait_stopped(procs, port)
        row["passed"] = row["passed"] and row["stopped_clean"]
    return row


def _phase(receipt: dict, name: str) -> float | None:
    xs = [p["seconds"] for p in receipt.get("phases") or () if p["name"] == name]
    return round(sum(xs), 4) if xs else None


def slope(ys: list[float]) -> float:
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, statistics.fmean(ys)
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sum((i - mx) ** 2 for i in range(n))


def summarize(rows: list[dict]) -> dict:
    ttft = [r["ttft_seconds"] for r in rows if r.get("ttft_seconds") is not None]
    tenth = max(1, len(ttft) // 10)
    out = {"runs": len(rows), "passes": sum(1 for r in rows if r["passed"])}
    if ttft:
        first, last = statistics.median(ttft[:tenth]), statistics.median(ttft[-tenth:])
        out.update(
            ttft_median_seconds=round(statistics.median(ttft), 3), ttft_min_seconds=round(min(ttft), 3), ttft_max_seconds=round(max(ttft), 3),
            ttft_first_tenth_median=round(first, 3), ttft_last_tenth_median=round(last, 3), drift_seconds=round(last - first, 3),
            slope_seconds_per_run=round(slope(ttft), 5),
        )  # fmt: skip
    return out


def plot(rows: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [i + 1 for i, r in enumerate(rows) if r.get("ttft_seconds") is not None]
    ys = [r["ttft_seconds"] for r in rows if r.get("ttft_seconds") is not None]
    bad = [i + 1 for i, r in enumerate(rows) if not r["passed"]]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(xs, ys, ".", label="restore: activation to first token")
    if ys:
        b = summary["slope_seconds_per_run"]
        m = statistics.fmean(ys) - b * (statistics.fmean(xs))
        ax.plot([xs[0], xs[-1]], [m + b * xs[0], m + b * xs[-1]], "-", label="trend %.4f s/run" % b)
    for x in bad:
        ax.axvline(x, color="red", alpha=0.4)
    ax.set_xlabel("run")
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    ax.set_title("%d/%d restores validated" % (summary["passes"], summary["runs"]))
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "tiny-vllm-cpu.yaml")
    ap.add_argument("--out", type=Path, default=Path("."), help="where soak-<date>.json and .png go")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    if not port_free(args.port):
        print("port %d is in use: stop the workload holding it first" % args.port, file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="coldsnap-soak-"))
    try:
        store = work / "store"
        recipe = soak_recipe(args.recipe, store, work)
        t = time.monotonic()
        sparkrun("coldsnap", "capture", str(recipe), "-H", "localhost", "--receipt", str(work / "capture.json"), timeout=1800)
        capture = json.loads((work / "capture.json").read_text())
        expected = capture["validation"]["reply"]
        print("captured in %.1f s; reply %r" % (time.monotonic() - t, expected), flush=True)
        if not wait_stopped([], args.port):
            raise RuntimeError("the capture's engine did not free port %d" % args.port)
        seen: set[Path] = set()
        rows = []
        for i in range(args.runs):
            row = one_run(recipe, store, seen, expected, args.port)
            rows.append(row)
            print("%3d/%d %s ttft %s s%s" % (i + 1, args.runs, "ok  " if row["passed"] else "FAIL", row.get("ttft_seconds"), " " + row.get("error", "") if not row["passed"] else ""), flush=True)
            if i == 2 and not any(r["passed"] for r in rows):
                print("the first three runs failed: stopping (the set-up is broken, not the restores)", file=sys.stderr)
                break
        summary = summarize(rows)
        date = dt.date.today().isoformat()
        args.out.mkdir(parents=True, exist_ok=True)
        doc = {
            "date": date, "host": socket.gethostname(), "recipe": str(args.recipe.relative_to(ROOT) if args.recipe.is_relative_to(ROOT) else args.recipe),
            "command": "benchmarks/soak.py --runs %d" % args.runs, "capsule": capture["capsule"], "capture_seconds": capture["total_seconds"],
            "summary": summary, "runs": rows,
        }  # fmt: skip
        (args.out / ("soak-%s.json" % date)).write_text(json.dumps(doc, indent=1) + "\n")
        plot(rows, summary, args.out / ("soak-%s.png" % date))
        print(json.dumps(summary, indent=1))
        return 0 if summary["passes"] == summary["runs"] else 1
    finally:
        try:
            sparkrun("stop", str(recipe), "-H", "localhost")  # nothing of ours stays running
        except (RuntimeError, NameError):
            pass
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
