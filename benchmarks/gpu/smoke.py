"""GPU smoke test of the n610 driver: CUDA checkpoint API + CRIU on a small CUDA server.

    python3 benchmarks/gpu/smoke.py --out OUT
    python3 benchmarks/gpu/smoke.py --out OUT --capture-gpus 0 --restore-gpus 1   # onto the other GPU
Writes smoke.json (each step, its seconds, the checksums, and which GPU held the server
before and after) to OUT.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sparkrun_coldsnap.cuda.nvidia import gpus_of  # noqa: E402
from sparkrun_coldsnap.drivers.n610 import N610Driver  # noqa: E402
from sparkrun_coldsnap.host.facts import host_facts  # noqa: E402
from sparkrun_coldsnap.host.iouring import io_uring_disabled  # noqa: E402
from sparkrun_coldsnap.host.process_tree import kill_tree, tree_pids  # noqa: E402
from sparkrun_coldsnap.launch.local import start_unit  # noqa: E402


def ask(port: int, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return requests.get("http://127.0.0.1:%d/" % port, timeout=30).text.strip()
        except requests.RequestException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--capture-gpus", help="CUDA_VISIBLE_DEVICES for the server at capture")
    ap.add_argument("--restore-gpus", help="CUDA_VISIBLE_DEVICES for the restoring side: the GPUs the server comes back on")
    ap.add_argument("--warm", action="store_true", help="start the CUDA helper before the clock, as a prepared restore does")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"host": host_facts().model_dump()}
    driver = N610Driver()
    report["support"] = driver.support(host_facts()).__dict__
    work = Path("/root/coldsnap-smoke")
    work.mkdir(exist_ok=True)
    t = time.monotonic()
    with io_uring_disabled():
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the machine's own torch, not the plugin's target
        if args.capture_gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = args.capture_gpus
        unit = start_unit("%s %s %d" % (sys.executable, ROOT / "benchmarks/gpu/cuda_workload.py", args.port), env=env, log_path=work / "w.log")
        before = ask(args.port)
    report["start_seconds"] = time.monotonic() - t
    report["checksum_before"] = before
    report["gpus_before"] = gpus_of(tree_pids(unit.root_pid))
    try:
        report["precheck"] = driver.precheck(unit.root_pid)
        t = time.monotonic()
        image = driver.checkpoint(unit.root_pid, work / "images", unit="solo", host="localhost", progress=print)
        report["checkpoint_seconds"] = time.monotonic() - t
        report["image_bytes"] = image.image_bytes
        report["cuda_pids"] = image.driver_data.cuda_pids
        report["gpu_uuids_captured"] = image.driver_data.gpu_uuids
        report["host_gpu_uuids_captured"] = image.driver_data.host_gpu_uuids
        unit.reap()
        report["admission"] = driver.admission(image)
        if args.restore_gpus is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = args.restore_gpus  # the restoring side's choice, as a user would set it
        warm = driver.warm_up(image) if args.warm else None
        if warm is not None:
            _ = warm.driver_version  # wait for its CUDA initialization: off the clock
        report["warm_helper"] = warm is not None
        t = time.monotonic()
        restored = driver.restore(image, work / "images", log_path=work / "r.log", progress=print, warm=warm)
        report["restore_seconds"] = time.monotonic() - t
        after = ask(args.port)
        report["reply_seconds_after_restore"] = time.monotonic() - t
        report["checksum_after"] = after
        report["gpus_after"] = gpus_of(tree_pids(restored.root_pid))
        report["passed"] = after == before
        kill_tree(restored.root_pid)
    except Exception as err:  # noqa: BLE001 - the report says what broke
        report["error"] = "%s: %s" % (type(err).__name__, err)
        kill_tree(unit.root_pid)
    (args.out / "smoke.json").write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
