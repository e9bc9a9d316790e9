"""Where a restore into a new container spends its time, before and after: one timeline per profile.

Reads the ``profile.json`` files ``container_restore_profile.py`` wrote and draws, for each, the
spans read off its samples (the checkpoint going into containerd's content store, containerd
unpacking it, runc and CRIU restoring) and the first token, on one time axis:

    .venv/bin/python benchmarks/container_restore_plot.py "before" OLD/profile.json "after" NEW/profile.json --out PLOT.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPANS = (
    ("checkpoint into containerd's content store", "content_store_write_first", "content_store_write_last", "#e07b39"),
    ("containerd unpacks it for runc", "unpacked_copy_appears", "unpacked_copy_complete", "#c9a227"),
    ("runc + CRIU restore", "runc_first", "runc_last", "#2b7bb9"),
)


def spans(doc: dict) -> list[tuple[str, float, float, str]]:
    t = doc["timeline"]
    out = []
    for label, start, end, color in SPANS:
        if t.get(start) is not None and t.get(end) is not None and t[end] >= t[start]:
            out.append((label, float(t[start]), float(t[end]) - float(t[start]), color))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pairs", nargs="+", help="LABEL PROFILE.json, repeated")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if len(args.pairs) % 2:
        ap.error("give LABEL PROFILE.json pairs")
    rows = [(args.pairs[i], json.loads(Path(args.pairs[i + 1]).read_text())) for i in range(0, len(args.pairs), 2)]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 1.4 + 1.1 * len(rows)), dpi=120)
    seen: set[str] = set()
    for y, (label, doc) in enumerate(rows):
        for name, start, width, color in spans(doc):
            ax.barh(y, width, left=start, color=color, height=0.5, label=None if name in seen else name)
            seen.add(name)
        ttft = doc["ttft_seconds"]
        ax.plot([ttft], [y], marker="|", markersize=22, color="black", label=None if "first token" in seen else "first token")
        seen.add("first token")
        ax.text(ttft + 0.4, y, "first token %.2f s" % ttft, va="center", fontsize=9)
        print("%-8s first token %6.2f s; %s" % (label, ttft, "; ".join("%s %.2f s" % (n, w) for n, _, w, _ in spans(doc))))
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, max(doc["ttft_seconds"] for _, doc in rows) * 1.25)
    ax.set_xlabel("seconds after the restore began (page cache dropped)")
    ax.set_title("restore into a new container: where the time goes", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(args.out)
    print("plot: %s" % args.out)


if __name__ == "__main__":
    main()
