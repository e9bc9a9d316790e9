"""GPU qualification: real vLLM captured and restored by the project's own drivers.

Runs on the GPU machine (see benchmarks/gpu/README.md). Makes a model of a real
architecture with random weights, captures it with each driver asked for, then
alternates samples: a vanilla start, and a restore by each path (a driver, and for
n610 a weight path), with the page cache dropped before every one; preparation is
kept off the clock and reported. Every restore is validated against the reply
recorded at capture.

    python3 benchmarks/gpu/qualify.py model     --work W --shape 1.5b
    python3 benchmarks/gpu/qualify.py capture   --work W --drivers n610,n580 --out OUT
    python3 benchmarks/gpu/qualify.py samples   --work W --paths n610:native,n610:recovery,n580 --samples 3 --out OUT
    python3 benchmarks/gpu/qualify.py other-gpu --work W --paths n610:native --restore-gpus 1 --out OUT

``--empty-caches`` (capture, samples, smoke) empties the engine's compile and JIT caches before
every capture, vanilla start and restore (``ENGINE_CACHES``), as on a node that never ran the
engine: the n580 template then has only what its capsule carries (capsule/engine_caches.py).

``--tp 2`` runs every step on a unit of two tensor-parallel ranks (benchmarks/gpu/tp2.sh runs
them all); the n610 driver then launches the ranks with collectives that share no device
memory (cuda/ranks.py), and ``ranks`` reports which NCCL transports the ranks used.
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sparkrun_coldsnap import api, bench  # noqa: E402
from sparkrun_coldsnap.capsule.store import CapsuleStore  # noqa: E402
from sparkrun_coldsnap.cuda import nvidia  # noqa: E402
from sparkrun_coldsnap.documents import request as rq  # noqa: E402
from sparkrun_coldsnap.documents import settings  # noqa: E402
from sparkrun_coldsnap.documents.receipts import write_receipt  # noqa: E402
from sparkrun_coldsnap.engines.vllm import VllmAdapter  # noqa: E402
from sparkrun_coldsnap.errors import ColdsnapError  # noqa: E402
from sparkrun_coldsnap.host import bandwidth, paths  # noqa: E402
from sparkrun_coldsnap.host.facts import gpu_facts  # noqa: E402
from sparkrun_coldsnap.host.process_tree import tree_pids  # noqa: E402
from sparkrun_coldsnap.progress import Progress  # noqa: E402

PROMPT = "Reply with one short sentence: what is a cold start?"
PORT = 8000


def model_info(work: Path) -> dict:
    return json.loads((work / "model.json").read_text())


def make_model(work: Path, shape: str, python: str, device: str) -> dict:
    if (work / "model.json").exists():
        return model_info(work)
    # The machine's own torch and transformers: not the plugin's target.
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [python, str(ROOT / "sparkrun_coldsnap" / "setup" / "tiny_model.py"), "--hf-home", str(work / "hf"), "--model-id", "coldsnap/qual-%s" % shape, "--shape", shape, "--device", device],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    info = json.loads(out.stdout.strip().splitlines()[-1])
    (work / "model.json").write_text(json.dumps(info))
    return info


# The same budget for both engines: 30% of the GPU, 2048 tokens of context, no custom all-reduce.
COMMANDS = {
    "vllm": "{python} -m vllm.entrypoints.openai.api_server --model {path} --served-model-name {name} --port {port} --gpu-memory-utilization 0.3 --max-model-len 2048 --disable-custom-all-reduce {extra}",
    # The PyTorch sampler: flashinfer's would JIT-compile its kernels at the first request.
    "sglang": "{python} -m sglang.launch_server --model-path {path} --served-model-name {name} --port {port} --mem-fraction-static 0.3 --context-length 2048 --disable-custom-all-reduce --sampling-backend pytorch {extra}",
}

ENGINE_ENV = {
    "vllm": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"},
    "sglang": {},
}

# Several ranks: the engine's own flag, and NCCL's account of the transport each channel uses.
TP_FLAG = {"vllm": "--tensor-parallel-size", "sglang": "--tp"}
RANKS_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,P2P,NET"}


def workload(info: dict, driver: str, engine_site: str, extra_args: str, python: str, weights: str = "auto", engine: str = "vllm", tp: int = 1) -> rq.Workload:
    if tp > 1:
        extra_args = "%s %s %d" % (extra_args, TP_FLAG[engine], tp)
    command = COMMANDS[engine].format(python=python, path=info["path"], name=info["model_id"], port=PORT, extra=extra_args).strip()
    # The engine's own packages, apart from the plugin's (sparkrun pins another pydantic).
    env = {"PYTHONPATH": engine_site, "HF_HUB_OFFLINE": "1", **ENGINE_ENV[engine], **(RANKS_ENV if tp > 1 else {})}
    return rq.Workload(
        recipe="qual-%s-%s%s" % (engine, info["model_id"].split("-")[-1], "-tp%d" % tp if tp > 1 else ""),
        engine=engine,
        runtime=engine,
        model=rq.ModelRef(id=info["model_id"], revision=info["revision"], path=info["path"]),
        topology=rq.Topology(hosts=("localhost",), tensor_parallel=tp, units=(rq.LaunchUnit(name="solo", host="localhost"),)),
        launch=rq.Launch(executor="local", command=command, env=env, port=PORT),
        driver=driver,
        weights=weights,
    )


def requests_for(args, driver: str, weights: str = "auto") -> tuple[rq.CaptureRequest, rq.RestoreRequest]:
    info = model_info(args.work)
    w = workload(info, driver, args.engine_site, args.extra_args, args.engine_python, weights, args.engine, args.tp)
    v = rq.ValidationSpec(prompt=PROMPT, max_tokens=16, timeout_seconds=300)
    name = rq.CapsuleRef(name="qual-%s-%s%s" % (args.engine, driver, "-tp%d" % args.tp if args.tp > 1 else ""))
    cap = rq.CaptureRequest(workload=w, validation=v, capsule=name, ready_timeout_seconds=1200)
    res = rq.RestoreRequest(workload=w, validation=v, capsule=name, on_missing="fail", workload_name="qual", ready_timeout_seconds=1200)
    return cap, res


#: a path's third part -> the plugin settings it restores with
OPTIONS = {
    "": {},
    # without reading the weights into the page cache during preparation
    "nocache": {"COLDSNAP_WEIGHTS_CACHE": "off"},
    # a node with nothing prepared: preparation starts the reads and goes on; the figure
    # that counts is preparation + restore ("total")
    "cold": {"COLDSNAP_CACHE_IN_BACKGROUND": "1"},
    # the payload in memory registered with CUDA all at once before the first copy (the default)
    "whole": {"COLDSNAP_REGISTER_PIECE_MIB": "0"},
    # in pieces of 1 GiB, four registered at once while the pieces before are copied
    "pieces": {"COLDSNAP_REGISTER_PIECE_MIB": "1024"},
    # in pieces, one at a time
    "serial": {"COLDSNAP_REGISTER_PIECE_MIB": "1024", "COLDSNAP_REGISTER_THREADS": "1"},
    # the CUDA state of the tree's processes restored one after the other, as before
    "serialcuda": {"COLDSNAP_CUDA_RESTORE": "serial"},
    # the big private memory areas written by eight threads after criu restore (page_fill.py;
    # the default since 2026-12-05 on a host of eight CPUs or more)
    "fill": {"COLDSNAP_PAGE_FILL": "8"},
    # every page written by CRIU, as before the fill
    "nofill": {"COLDSNAP_PAGE_FILL": "0"},
    # the native payload copied into memory from the file itself, not from its packed copy
    "raw": {"COLDSNAP_PACKED_PAYLOAD": "off"},
    # from its packed copy (capture made one where COLDSNAP_PACKED_PAYLOAD was on)
    "packed": {"COLDSNAP_PACKED_PAYLOAD": "on"},
}
LABELS = {
    "": "", "nocache": ", no cache", "cold": ", nothing prepared", "whole": ", registered whole", "serial": ", registered on one thread",
    "pieces": ", registered in pieces", "serialcuda": ", CUDA restored serially", "fill": ", memory filled by 8 threads",
    "nofill": ", every page by CRIU", "raw": ", payload read as written", "packed": ", payload read packed",
}  # fmt: skip


def split_path(path: str) -> tuple[str, str, str]:
    """``n610:native`` -> (driver, weights, option); a bare driver takes auto; a third part
    names one of OPTIONS, or several joined by ``+`` (``cold+fill``)."""
    driver, weights, option = (path.split(":") + ["", ""])[:3]
    if any(o not in OPTIONS for o in option.split("+")):
        sys.exit("path %r: the third part may only be one of %s, or several joined by +" % (path, ", ".join(o for o in OPTIONS if o)))
    return driver, weights or "auto", option


def option_settings(option: str) -> dict[str, str]:
    return {k: v for o in option.split("+") for k, v in OPTIONS[o].items()}


def option_label(option: str) -> str:
    return "".join(LABELS[o] for o in option.split("+"))


def engine_log_lines(pattern: str) -> list[str]:
    """Lines of the engine logs of this run (vLLM's own account of what sleep left, say)."""
    out = []
    for log in sorted((paths.run_dir() / "logs").glob("capture-*.log")):
        out += [line.strip()[-200:] for line in log.read_text(errors="replace").splitlines() if pattern in line]
    return out


def engine_cache_dirs() -> list[Path]:
    """Where an engine start leaves what it compiled: vLLM's root (torch.compile artifacts),
    Inductor's, Triton's, FlashInfer's JIT workspace and the tvm-ffi builds of its newer
    releases, PyTorch's C++ extensions, the CUDA driver's PTX cache, each where this environment
    places it (the adapter's variables) or at its default; and the plugin's own root, where n580
    restores put a capsule's caches."""
    home, user = Path.home(), getpass.getuser()
    defaults = {
        "VLLM_CACHE_ROOT": home / ".cache" / "vllm",
        "TORCHINDUCTOR_CACHE_DIR": Path(tempfile.gettempdir()) / ("torchinductor_" + user),
        "TRITON_CACHE_DIR": home / ".triton",
        "FLASHINFER_WORKSPACE_BASE": home,
        "TORCH_EXTENSIONS_DIR": home / ".cache" / "torch_extensions",
        "CUDA_CACHE_PATH": home / ".nv" / "ComputeCache",
    }
    dirs = []
    for var in VllmAdapter.compile_caches:
        where = Path(os.environ[var]) if os.environ.get(var) else defaults[var]
        # FlashInfer's variable names the base its workspace goes under, never to be emptied itself.
        dirs.append(where / ".cache" / "flashinfer" if var == "FLASHINFER_WORKSPACE_BASE" else where)
    return [*dirs, home / ".cache" / "tvm-ffi", settings.current().engine_cache_root]


def empty_engine_caches(before: str) -> None:
    emptied = {}
    for d in engine_cache_dirs():
        if d.is_dir():
            emptied[str(d)] = sum(p.stat().st_size for p in d.rglob("*") if p.is_file() and not p.is_symlink())
            shutil.rmtree(d)
    print("engine caches emptied before %s: %s" % (before, json.dumps({k: round(v / 1e6, 1) for k, v in emptied.items()}) if emptied else "none there"), flush=True)


def cmd_model(args) -> None:
    info = make_model(args.work, args.shape, args.model_python, args.model_device)
    print(json.dumps(info))


def cmd_capture(args) -> None:
    store = CapsuleStore(args.work / "store")
    progress = Progress()
    for driver in args.drivers:
        cap, _ = requests_for(args, driver)
        if args.empty_caches:
            empty_engine_caches("the capture with %s" % driver)
        bench.drop_page_cache()
        try:
            out = api.capture(cap, store=store, progress=progress)
            receipt = out.receipt
        except ColdsnapError as err:
            receipt = err.receipt
            print("capture with %s failed: %s" % (driver, err), flush=True)
        if receipt is not None:
            write_receipt(receipt, args.out / ("capture-%s.json" % driver))
            print("capture %s: %s in %.1f s, phases %s" % (driver, receipt.state, receipt.total_seconds, {p.name: p.seconds for p in receipt.phases}), flush=True)
            print("  zero pages: %s" % json.dumps(receipt.details.get("zero_pages")), flush=True)
            print("  details: %s" % json.dumps(receipt.details)[:600], flush=True)
            if "engine_caches" in receipt.details:
                print("  engine caches: %s" % json.dumps(receipt.details["engine_caches"]), flush=True)
    for line in engine_log_lines("Sleep mode freed"):
        print("  engine: %s" % line, flush=True)


def restores_for(args, store: CapsuleStore) -> tuple[dict, dict, dict]:
    restores, capsules, environ = {}, {}, {}
    for path in args.paths:
        driver, weights, option = split_path(path)
        _, res = requests_for(args, driver, weights)
        try:
            entry = store.resolve(res.capsule.ref)
        except ColdsnapError as err:
            print("no capsule for %s: %s" % (path, err), flush=True)
            continue
        label = (driver if weights == "auto" else "%s %s" % (driver, weights)) + option_label(option)
        restores[label] = (res, store)
        capsules[label] = {"ref": res.capsule.ref, "digest": entry.descriptor.digest}
        environ[label] = settings.Settings.from_environ({**os.environ, **option_settings(option)})
    return restores, capsules, environ


CACHE_NOTE = {
    False: "warm (filled by the captures' starts)",
    True: "empty before every vanilla start and restore (engine_cache_dirs: vLLM, Inductor, Triton, FlashInfer, tvm-ffi, torch extensions, CUDA's PTX cache, the plugin's root)",
}


def cmd_samples(args) -> None:
    store = CapsuleStore(args.work / "store")
    restores, capsules, environ = restores_for(args, store)
    if not restores:
        sys.exit("nothing to measure")
    vanilla = next(iter(restores.values()))[0]
    # Vanilla starts without sleep mode, as a user would run it.
    before = empty_engine_caches if args.empty_caches else None
    new = bench.run_paths(vanilla, restores, samples=args.samples, progress=Progress(), drop_cache=True, settings_for=environ, before_each=before)
    # Samples accumulate across calls (one call may not hold them all): kept beside the store,
    # those with the caches emptied apart from those with them warm.
    kept = args.work / ("samples-empty-caches.json" if args.empty_caches else "samples.json")
    old = [bench.Sample(**s) for s in json.loads(kept.read_text())] if kept.exists() else []
    for s in new:
        s.index += 1 + max([o.index for o in old], default=-1)
    results = old + new
    kept.write_text(json.dumps([s.__dict__ for s in results]))
    g = gpu_facts()
    gpu = {"gpus": [x.name for x in g.gpus], "nvidia_driver": g.nvidia_driver, "cuda": g.cuda_version}
    measured = machine_bandwidth(args)
    doc = bench.document(vanilla, results, capsules=capsules, drop_cache=True, extra={"gpu": gpu, "compile_cache": CACHE_NOTE[args.empty_caches]}, bandwidth=measured)
    path, png = bench.write(doc, args.out)
    for s in new:
        if s.notes:
            print("sample %d %s: %s" % (s.index, s.path, json.dumps(s.notes)[:400]), flush=True)
    print(bench.table(doc))
    print("results: %s %s" % (path, png or ""))


def cmd_smoke(args) -> None:
    """Each path restored --smoke-samples times (default once), no vanilla start: whether it
    works, and its phases, before the samples spend minutes on vanilla starts; the restores'
    samples go to $OUT/smoke.json (no ratio: nothing vanilla ran beside them)."""
    store = CapsuleStore(args.work / "store")
    restores, _, environ = restores_for(args, store)
    if not restores:
        sys.exit("nothing to restore")
    vanilla = next(iter(restores.values()))[0]
    before = empty_engine_caches if args.empty_caches else None
    done = bench.run_paths(vanilla, restores, samples=args.smoke_samples, progress=Progress(), drop_cache=True, settings_for=environ, with_vanilla=False, before_each=before)
    (args.out / "smoke.json").write_text(json.dumps([dataclasses.asdict(s) for s in done], indent=1))
    for s in done:
        total = s.ttft_seconds + (s.prepare_seconds or 0.0)
        print("smoke %s: first token %.2f s, preparation %.2f s, total %.2f s, validated %s" % (s.path, s.ttft_seconds, s.prepare_seconds or 0.0, total, s.validated), flush=True)
        print("  phases: %s" % json.dumps({k: round(v, 3) for k, v in s.phases.items()}), flush=True)
        print("  steps: %s" % json.dumps({k: round(v, 3) for k, v in s.steps.items()}), flush=True)
        print("  notes: %s" % json.dumps(s.notes)[:4000], flush=True)


def machine_bandwidth(args) -> dict[str, float]:
    """Disk, page cache and fresh memory from the plugin's side (on the native payload, the
    largest file a restore reads), host to device in the engine's interpreter."""
    payloads = sorted(paths.coldsnap_home().glob("native/*/rank-0.bin"), key=lambda p: p.stat().st_size)
    sample = payloads[-1] if payloads else bench.largest_file(model_info(args.work)["path"])
    out = bandwidth.measure(sample, drop_cache=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([args.engine_python, str(ROOT / "benchmarks" / "gpu" / "h2d.py")], capture_output=True, text=True, env=env)
    if done.returncode == 0:
        out.update(json.loads(done.stdout.strip().splitlines()[-1]))
    else:
        print("host-to-device not measured: %s" % done.stderr.strip()[-300:], flush=True)
    print("bandwidth (GB/s): %s" % {k: round(v / 1e9, 2) for k, v in out.items()}, flush=True)
    return out


def cmd_bandwidth(args) -> None:
    machine_bandwidth(args)


def cmd_other_gpu(args) -> None:
    """Restore capsules captured on one GPU onto the GPUs of --restore-gpus (this side's
    CUDA_VISIBLE_DEVICES), validate, and record where the driver reports the engine."""
    store = CapsuleStore(args.work / "store")
    restores, capsules, _ = restores_for(args, store)
    os.environ["CUDA_VISIBLE_DEVICES"] = args.restore_gpus
    settings.install(settings.Settings.from_environ())  # the restoring side's GPUs
    log_dir = paths.run_dir() / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    report = {"restore_gpus": args.restore_gpus, "gpus": [g.uuid for g in gpu_facts().gpus], "runs": []}
    for label, (res, _) in restores.items():
        run = {"path": label, "capsule": capsules[label]}
        try:
            prepared = api.prepare_restore(res, store=store, progress=Progress())
            out = api.activate_restore(prepared, log_path=log_dir / ("other-gpu-%s.log" % label.replace(" ", "-")), progress=Progress())
            run.update(ttft_seconds=out.ttft_seconds, validated=bool(out.receipt.validation and out.receipt.validation.passed), gpus_after=nvidia.gpus_of(tree_pids(out.root_pid)))
            run["phases"] = {p.name: p.seconds for p in out.receipt.phases}
            run["weights"] = out.receipt.weights.model_dump(mode="json") if out.receipt.weights else None
            out.unit.stop()
        except ColdsnapError as err:
            run.update(error=str(err), validated=False)
            receipt = err.receipt
            if receipt is not None:
                run["phases"] = {p.name: p.seconds for p in receipt.phases}
        report["runs"].append(run)
        print(json.dumps(run), flush=True)
    (args.out / "other-gpu.json").write_text(json.dumps(report, indent=2))


def cmd_ranks(args) -> None:
    """What the ranks of the last captures used, from NCCL's own log lines (NCCL_DEBUG=INFO):
    every channel must go "via NET/Socket"; P2P, SHM or NVLS would mean memory shared between
    ranks, which the checkpoint cannot carry."""
    channels = engine_log_lines(" via ")
    transports = sorted({line.split(" via ")[1].split()[0] for line in channels})
    report = {"transports": transports, "channels": len(channels), "init": engine_log_lines("NCCL INFO NET/")[:4]}
    (args.out / "ranks.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    if not transports or any(not t.startswith("NET/Socket") for t in transports):
        sys.exit("ranks used %s: expected only NET/Socket" % (transports or "no channel NCCL logged"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=("model", "capture", "samples", "smoke", "other-gpu", "bandwidth", "ranks"))
    ap.add_argument("--work", type=Path, required=True, help="work directory (model, store)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--shape", default="1.5b")
    ap.add_argument("--drivers", type=lambda s: [d for d in s.split(",") if d], default=["n610", "n580"])
    ap.add_argument("--paths", type=lambda s: [d for d in s.split(",") if d], default=["n610:native", "n610:recovery", "n580"], help="driver[:weights] to restore by")
    ap.add_argument("--restore-gpus", default="1", help="other-gpu: CUDA_VISIBLE_DEVICES of the restoring side")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--smoke-samples", type=int, default=1, help="smoke: restores per path")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the unit (one GPU each)")
    ap.add_argument("--engine", choices=sorted(COMMANDS), default="vllm")
    ap.add_argument("--engine-site", default="", help="PYTHONPATH of the engine's carried packages")
    ap.add_argument("--extra-args", default="", help="more engine flags")
    ap.add_argument("--engine-python", default="python3", help="the engine's interpreter")
    ap.add_argument("--model-python", default=sys.executable)
    ap.add_argument("--model-device", default="cuda")
    ap.add_argument("--empty-caches", action="store_true", help="capture, samples, smoke: empty the engine's compile and JIT caches before each capture, start and restore")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    steps = {"model": cmd_model, "capture": cmd_capture, "samples": cmd_samples, "smoke": cmd_smoke, "other-gpu": cmd_other_gpu, "bandwidth": cmd_bandwidth, "ranks": cmd_ranks}
    steps[args.step](args)


if __name__ == "__main__":
    main()
