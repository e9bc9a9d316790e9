"""The demo's last lines: the times to first token of its two vanilla starts and its restore,
read from the receipts the runs wrote, and the restore's ratio to each start, labelled.

Usage: demo_summary.py STORE VANILLA_STORE FIRST_CACHE, where STORE holds the receipts of the
first vanilla start and the restore, VANILLA_STORE those of the second (warm-cache) vanilla start,
and FIRST_CACHE says whether vLLM's compile cache was "empty" or "filled" before the first start.
"""

from __future__ import annotations

import glob
import json
import sys
from typing import Any


def latest(store: str, kind: str) -> dict[str, Any]:
    """The newest receipt of *kind* ("start", "restore") in *store*; one line naming it when none."""
    paths = sorted(glob.glob("%s/receipts/*/*-%s.json" % (store, kind)))
    if not paths:
        raise SystemExit("no %s receipt under %s/receipts: run scripts/demo.sh, which writes it" % (kind, store))
    with open(paths[-1]) as f:
        doc: dict[str, Any] = json.load(f)
    return doc


def summary(first: float, warm: float, restore: float, restore_passed: bool, first_cache: str) -> str:
    """The lines the demo ends with: each vanilla start says what its compile cache was, and the
    restore's ratio is given against both, so the first start's compiling is not taken for the
    cold start every later vanilla start pays."""
    first_label = "empty compile cache" if first_cache == "empty" else "compile cache filled by an earlier run"
    return "\n".join([
        "vanilla start, first (%s) -> first token: %6.2f s" % (first_label, first),
        "vanilla start, warm compile cache -> first token: %6.2f s" % warm,
        "ColdSnap restore -> first token: %6.2f s  (reply identical to capture: %s)" % (restore, restore_passed),
        "ratio against the warm-cache vanilla start: %.1fx faster" % (warm / restore),
        "ratio against the first vanilla start (%s): %.1fx faster" % (first_label, first / restore),
    ])


def main(argv: list[str]) -> None:
    store, vanilla_store, first_cache = argv
    first, warm, restore = latest(store, "start"), latest(vanilla_store, "start"), latest(store, "restore")
    print()
    print(summary(first["validation"]["ttft_seconds"], warm["validation"]["ttft_seconds"],
                  restore["validation"]["ttft_seconds"], restore["validation"]["passed"], first_cache))


if __name__ == "__main__":
    main(sys.argv[1:])
