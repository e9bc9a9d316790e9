"""`sparkrun coldsnap bench` of the two-host recipe, on the two hosts of tests/two_hosts.py.

recipes/tiny-vllm-cpu-two-node.yaml (the CPU vLLM, tensor parallel 2, one rank on each host)
on a sparkrun cluster `two-node` of two hosts made on this machine (network namespaces,
each with its own sshd), in a sparkrun home of its own: the same set-up as the two-host tests,
outside pytest. The bench captures the recipe first when its capsule is not in the store, then
alternates a vanilla start of both ranks and a restore of both units, the page cache dropped on
both hosts before each; bench.json and bench.png go to --out.

Starts engines and CRIU: hold the shared engine lock, as root.

    flock /tmp/coldsnap-engine.lock .venv/bin/python benchmarks/two_host_bench.py --out DIR [--samples 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import BIN, coldsnap_home, hf_home, make_sparkrun_home  # noqa: E402
from test_two_node_run import share_model_cache, two_node_recipe  # noqa: E402
from two_hosts import TwoHosts  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="where bench.json, bench.png and the output go")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--store", type=Path, default=None, help="capsule store (default: a new one under --out: the bench captures first)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.store or args.out / "store"
    with tempfile.TemporaryDirectory(prefix="two-host-bench-") as scratch, TwoHosts(shared_env={"HF_HOME": str(hf_home()), "COLDSNAP_HOME": str(coldsnap_home())}) as hosts:
        sparkrun = make_sparkrun_home(Path(scratch) / "home")
        hosts.configure_sparkrun(sparkrun, "two-node")
        share_model_cache(sparkrun, "two-node")
        recipe = two_node_recipe(Path(scratch), store=store)
        argv = [str(BIN / "sparkrun"), "coldsnap", "bench", str(recipe), "--cluster", "two-node", "--samples", str(args.samples), "--out", str(args.out)]
        print("$ sparkrun coldsnap bench %s --cluster two-node --samples %d --out %s" % (recipe.name, args.samples, args.out), flush=True)
        with open(args.out / "bench-output.txt", "w") as log:
            proc = subprocess.Popen(argv, env=sparkrun.env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:  # shown as it comes (a sample takes minutes) and kept
                sys.stdout.write(line)
                log.write(line)
            rc = proc.wait()
        subprocess.run([str(BIN / "sparkrun"), "stop", str(recipe), "--cluster", "two-node"], env=sparkrun.env, cwd=str(ROOT), capture_output=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
