"""The demo's closing lines: the restore's ratio to the first vanilla start and to a warm-cache one,
each labelled, read from the receipts the demo's runs wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "demo_summary.py"


def _receipt(store: Path, name: str, ttft: float) -> None:
    day = store / "receipts" / "2026-12-07"
    day.mkdir(parents=True, exist_ok=True)
    (day / name).write_text(json.dumps({"validation": {"ttft_seconds": ttft, "passed": True}}))


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_the_demo_gives_the_restores_ratio_to_the_first_and_to_a_warm_cache_vanilla_start(tmp_path: Path) -> None:
    store, vanilla = tmp_path / "store", tmp_path / "vanilla"
    _receipt(store, "0001-start.json", 80.0)
    _receipt(store, "0002-restore.json", 1.0)
    _receipt(vanilla, "0003-start.json", 40.0)
    out = _run(str(store), str(vanilla), "empty")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert "vanilla start, first (empty compile cache) -> first token:  80.00 s" in lines
    assert "vanilla start, warm compile cache -> first token:  40.00 s" in lines
    assert "ratio against the warm-cache vanilla start: 40.0x faster" in lines
    assert "ratio against the first vanilla start (empty compile cache): 80.0x faster" in lines


def test_a_first_start_that_found_the_compile_cache_filled_is_not_called_empty(tmp_path: Path) -> None:
    store, vanilla = tmp_path / "store", tmp_path / "vanilla"
    _receipt(store, "0001-start.json", 41.0)
    _receipt(store, "0002-restore.json", 1.0)
    _receipt(vanilla, "0003-start.json", 40.0)
    out = _run(str(store), str(vanilla), "filled")
    assert out.returncode == 0, out.stderr
    assert "empty compile cache" not in out.stdout
    assert "ratio against the first vanilla start (compile cache filled by an earlier run): 41.0x faster" in out.stdout


def test_a_missing_receipt_is_one_line_naming_the_store(tmp_path: Path) -> None:
    store = tmp_path / "store"
    _receipt(store, "0001-start.json", 80.0)
    _receipt(store, "0002-restore.json", 1.0)
    out = _run(str(store), str(tmp_path / "vanilla"), "empty")
    assert out.returncode != 0
    assert out.stderr.strip() == "no start receipt under %s/receipts: run scripts/demo.sh, which writes it" % (tmp_path / "vanilla")
