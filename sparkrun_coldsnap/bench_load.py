"""``bench --load``: the same load against a vanilla start and a restore, side by side.

Each round starts the engine the ordinary way, drives the load with the engine's own
serving benchmark (:mod:`sparkrun_coldsnap.engines.serving_bench`: a client the plugin did
not write), reads what the engine says about itself (its KV cache), notes the memory its
process tree holds, and stops it; then restores the capsule (prepared off the clock, as in
:mod:`sparkrun_coldsnap.bench`) and does the same. Rounds interleave, so drift on the host
hits both alike; the document keeps every round and reports medians.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sparkrun_coldsnap import __version__, api, extensions
from sparkrun_coldsnap.api import ServingOutcome
from sparkrun_coldsnap.bench import VANILLA
from sparkrun_coldsnap.capsule.store import CapsuleStore
from sparkrun_coldsnap.documents import settings
from sparkrun_coldsnap.documents.request import RestoreRequest
from sparkrun_coldsnap.engines.base import Endpoint
from sparkrun_coldsnap.engines.serving_bench import EngineReport, LoadResult, LoadSpec, ServingBench
from sparkrun_coldsnap.errors import EngineError, RequestError
from sparkrun_coldsnap.host import paths, process_tree
from sparkrun_coldsnap.host.runner import run as run_tool
from sparkrun_coldsnap.progress import Progress
from sparkrun_coldsnap.weights.page_cache import drop as drop_page_cache

RESTORED = "restored"


@dataclass(frozen=True)
class Client:
    """The engine's benchmark client, found in the engine's environment."""

    bench: ServingBench
    script: Path
    endpoint: Endpoint
    tokenizer: str


def load_spec(text: str) -> LoadSpec:
    """``--load``'s SPEC, or the one-line error that says how to write it."""
    try:
        return LoadSpec.parse(text)
    except ValueError as err:
        raise RequestError("bench --load: %s" % err) from None


def client_for(req: RestoreRequest) -> Client:
    """The load client of *req*'s engine, or a one-line refusal naming the fix."""
    w = req.workload
    adapter = extensions.registry().engine(w.engine)
    if adapter.serving_bench is None:
        raise RequestError("bench --load drives the engine's own serving benchmark, and engine %s has none the plugin knows: time its start with bench RECIPE instead" % w.engine)
    if w.launch.executor != "local" or not w.launch.engine_env:
        raise RequestError(
            "bench --load runs the engine's benchmark from the recipe's engine environment (coldsnap.engine_env), and %s has none (executor %s): "
            "use a host-process recipe with coldsnap.engine_env" % (w.recipe, w.launch.executor)
        )  # fmt: skip
    script = paths.engine_env_dir(w.launch.engine_env) / "bin" / adapter.serving_bench.script
    if not script.exists():
        raise RequestError("the engine environment %s has no %s (the benchmark client): run `sparkrun coldsnap setup --engine %s`" % (w.launch.engine_env, script, w.launch.engine_env))
    return Client(adapter.serving_bench, script, adapter.endpoint(w.launch.command, w.model.id, w.launch.port), w.model.path or w.model.id)


def drive(client: Client, spec: LoadSpec, *, result_file: Path, timeout: float) -> LoadResult:
    """One run of the client against the serving engine; its result document kept at *result_file*."""
    result_file.parent.mkdir(parents=True, exist_ok=True)
    result_file.unlink(missing_ok=True)
    env = settings.current().child_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # random prompts: nothing to download
    argv = [str(client.script), *client.bench.argv(spec, client.endpoint, tokenizer=client.tokenizer, result_file=result_file)]
    done = run_tool(argv, timeout=timeout, env=env, cwd=str(result_file.parent), what="the engine's serving benchmark")
    result_file.with_suffix(".out").write_text(done.stdout + done.stderr)
    try:
        raw = json.loads(result_file.read_text())
    except (OSError, ValueError) as err:
        raise EngineError("the engine's serving benchmark wrote no result document at %s: %s" % (result_file, err)) from err
    return client.bench.result(raw)


def memory_in_use(root_pid: int) -> int:
    """The memory the engine's process tree holds: the sum of its processes' proportional set
    sizes, so a page several of them map (the weights, shared memory) counts once, and a page
    a restore has not brought back yet does not count."""
    total = 0
    for p in process_tree.tree(root_pid):
        try:
            total += p.memory_full_info().pss
        except Exception:  # a process that ended between the listing and the read holds nothing
            continue
    return total


@dataclass
class Round:
    path: str  # "vanilla" or "restored"
    index: int
    load: LoadResult
    engine: EngineReport
    memory_bytes: int  # the process tree's proportional set sizes, after the load
    ttft_seconds: float  # from the start (or restore) to the validation's first token
    reply: str | None  # the validation reply of this start or restore
    validated: bool
    prepare_seconds: float | None = None


def measure(path: str, index: int, serving: ServingOutcome, client: Client, spec: LoadSpec, *, out_dir: Path, timeout: float, prepare_seconds: float | None = None) -> Round:
    """The load driven against a serving engine, what it says of itself, then stopped."""
    try:
        load = drive(client, spec, result_file=out_dir / ("%s-%d.json" % (path, index)), timeout=timeout)
        report = client.bench.report(client.endpoint)
        memory = memory_in_use(serving.root_pid)
    finally:
        serving.unit.stop()
    v = serving.receipt.validation
    return Round(
        path, index, load, report, memory, serving.ttft_seconds or 0.0, v.reply if v else None, bool(v and v.passed), prepare_seconds=prepare_seconds,
    )  # fmt: skip


def run(
    req: RestoreRequest, *, store: CapsuleStore, spec: LoadSpec, rounds: int, progress: Progress, out_dir: Path, drop_cache: bool = True,
    timeout: float = 1800.0, on_round: Callable[[Round], None] | None = None,
) -> dict:  # fmt: skip
    """*rounds* of (vanilla start, load, stop; restore, load, stop); returns the results document."""
    client = client_for(req)
    log_dir = paths.run_dir() / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    raw_dir = out_dir / "client"
    results: list[Round] = []
    for i in range(rounds):
        if drop_cache:
            drop_page_cache()
        progress.step("round %d/%d: vanilla start, then %s" % (i + 1, rounds, spec.label()))
        v = api.start_vanilla(req, log_path=log_dir / ("load-vanilla-%d.log" % i), progress=progress)
        results.append(measure(VANILLA, i, v, client, spec, out_dir=raw_dir, timeout=timeout))
        progress.note(line(results[-1]))
        time.sleep(1.0)  # let the stopped tree's memory go back first
        if drop_cache:
            drop_page_cache()
        progress.step("round %d/%d: restore, then the same load" % (i + 1, rounds))
        prepared = api.prepare_restore(req, store=store, progress=progress)
        r = api.activate_restore(prepared, log_path=log_dir / ("load-restore-%d.log" % i), progress=progress)
        results.append(measure(RESTORED, i, r, client, spec, out_dir=raw_dir, timeout=timeout, prepare_seconds=prepared.prepare_seconds))
        progress.note(line(results[-1]))
        time.sleep(1.0)
    capsule = {"ref": req.capsule.ref, "digest": store.resolve(req.capsule.ref).descriptor.digest}
    return document(req, results, spec=spec, client=client, capsule=capsule, drop_cache=drop_cache)


def line(r: Round) -> str:
    return "%s: %.0f output tokens/s, %.2f requests/s, TTFT p50 %.0f ms, ITL p50 %.1f ms, %d failed" % (
        r.path, r.load.output_tokens_per_second, r.load.requests_per_second, r.load.ttft_ms["p50"], r.load.itl_ms["p50"], r.load.failed,
    )  # fmt: skip


#: the figures compared side by side: name -> how to read it from a round
FIGURES: dict[str, Callable[[Round], float]] = {
    "output_tokens_per_second": lambda r: r.load.output_tokens_per_second,
    "requests_per_second": lambda r: r.load.requests_per_second,
    "ttft_p50_ms": lambda r: r.load.ttft_ms["p50"],
    "ttft_p99_ms": lambda r: r.load.ttft_ms["p99"],
    "itl_p50_ms": lambda r: r.load.itl_ms["p50"],
    "itl_p99_ms": lambda r: r.load.itl_ms["p99"],
    "memory_bytes": lambda r: float(r.memory_bytes),
}


def side(rounds: list[Round], *, cpu: bool) -> dict[str, Any]:
    """One path's medians, totals and what its engine said, over its rounds."""
    out: dict[str, Any] = {
        name: {"median": statistics.median(f(r) for r in rounds), "min": min(f(r) for r in rounds), "max": max(f(r) for r in rounds), "n": len(rounds)}
        for name, f in FIGURES.items()
    }  # fmt: skip
    out["completed"] = sum(r.load.completed for r in rounds)
    out["failed"] = sum(r.load.failed for r in rounds)
    out["errors"] = [e for r in rounds for e in r.load.errors][:5]
    out["kv_cache_blocks"] = sorted({r.engine.kv_cache_blocks for r in rounds}, key=str)
    out["kv_cache_tokens"] = sorted({r.engine.kv_cache_tokens for r in rounds}, key=str)
    # the CPU engine has no CUDA graphs; on a GPU, what the engine reported (None: it did not say)
    out["cuda_graphs"] = "n/a (cpu)" if cpu else sorted({r.engine.cuda_graphs for r in rounds}, key=str)
    out["replies"] = sorted({r.reply or "" for r in rounds})
    out["all_validated"] = all(r.validated for r in rounds)
    return out


def document(req: RestoreRequest, results: list[Round], *, spec: LoadSpec, client: Client, capsule: Mapping[str, str], drop_cache: bool) -> dict:
    cpu = req.workload.driver == "cpu"
    van = side([r for r in results if r.path == VANILLA], cpu=cpu)
    res = side([r for r in results if r.path == RESTORED], cpu=cpu)
    ratios = {name: res[name]["median"] / van[name]["median"] if van[name]["median"] else None for name in FIGURES}
    return {
        "format": 1,
        "kind": "load",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": {"machine": platform.machine(), "kernel": platform.release(), "cpus": os.cpu_count()},
        "tool_version": __version__,
        "recipe": req.workload.recipe,
        "engine": req.workload.engine,
        "driver": req.workload.driver,
        "model": "%s@%s" % (req.workload.model.id, req.workload.model.revision),
        "page_cache_dropped": drop_cache,
        "client": {"script": client.script.name, "argv": client.bench.argv(spec, client.endpoint, tokenizer=client.tokenizer, result_file=Path("ROUND.json"))},
        "load": asdict(spec),
        "capsule": dict(capsule),
        "rounds": len(results) // 2,
        VANILLA: van,
        RESTORED: res,
        # restored median over vanilla median, figure by figure
        "ratio_median": ratios,
        "checks": {
            "no_errors": van["failed"] == 0 and res["failed"] == 0,
            "same_replies": len(set(van["replies"]) | set(res["replies"])) == 1,
            "same_kv_capacity": van["kv_cache_blocks"] == res["kv_cache_blocks"] and len(van["kv_cache_blocks"]) == 1 and van["kv_cache_blocks"] != [None],
            "all_validated": van["all_validated"] and res["all_validated"],
        },
        "samples": [asdict(r) for r in results],
    }


def table(doc: dict) -> str:
    van, res = doc[VANILLA], doc[RESTORED]
    lines = ["%s, %s; medians of %d rounds each (min-max)" % (doc["recipe"], LoadSpec(**doc["load"]).label(), doc["rounds"])]
    lines.append("%-26s %26s %26s %8s" % ("", "vanilla", "restored", "ratio"))
    for name in FIGURES:
        scale, unit = (1e-9, " GB") if name == "memory_bytes" else (1.0, "")
        cells = ["%.1f%s (%.1f-%.1f)" % (s["median"] * scale, unit, s["min"] * scale, s["max"] * scale) for s in (van[name], res[name])]
        ratio = doc["ratio_median"][name]
        lines.append("%-26s %26s %26s %8s" % (name.replace("_", " "), *cells, "%.2f" % ratio if ratio else "-"))
    for key in ("completed", "failed", "kv_cache_blocks", "kv_cache_tokens", "cuda_graphs"):
        lines.append("%-26s %26s %26s" % (key.replace("_", " "), van[key], res[key]))
    checks = doc["checks"]
    lines.append("checks: " + ", ".join("%s %s" % (k.replace("_", " "), "yes" if v else "NO") for k, v in checks.items()))
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> Path | None:
    """Each figure's vanilla and restored rounds as dots beside their medians; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    shown = ["output_tokens_per_second", "requests_per_second", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"]
    fig, axes = plt.subplots(1, len(shown), figsize=(2.3 * len(shown), 3.6), dpi=120)
    colors = {VANILLA: "#9aa5b1", RESTORED: "#2b7bb9"}
    for ax, name in zip(axes, shown):
        for x, p in enumerate((VANILLA, RESTORED)):
            ys = [FIGURES[name](_round(s)) for s in doc["samples"] if s["path"] == p]
            ax.bar(x, doc[p][name]["median"], color=colors[p], width=0.6)
            ax.scatter([x] * len(ys), ys, color="black", s=12, zorder=3)
        ax.set_xticks([0, 1], ["vanilla", "restored"], fontsize=8)
        ax.set_title(name.replace("_", " ").replace("per second", "/s"), fontsize=9)
        ax.tick_params(axis="y", labelsize=8)
    checks = doc["checks"]
    fig.suptitle(
        "%s under load (%s): medians of %d rounds, dots = rounds; errors %d/%d, KV blocks %s/%s%s"
        % (
            doc["recipe"], LoadSpec(**doc["load"]).label(), doc["rounds"], doc[VANILLA]["failed"], doc[RESTORED]["failed"],
            doc[VANILLA]["kv_cache_blocks"], doc[RESTORED]["kv_cache_blocks"], "" if checks["same_replies"] else ", replies differ",
        ),
        fontsize=9,
    )  # fmt: skip
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _round(sample: Mapping[str, Any]) -> Round:
    """A round back from its document form (for the plot)."""
    load = LoadResult(**{**sample["load"], "errors": tuple(sample["load"]["errors"])})
    fields = {k: v for k, v in sample.items() if k not in ("load", "engine")}
    return Round(load=load, engine=EngineReport(**sample["engine"]), **fields)


def write(doc: dict, out_dir: Path) -> tuple[Path, Path | None]:
    out_dir.mkdir(parents=True, exist_ok=True)
    j = out_dir / "bench.json"
    j.write_text(json.dumps(doc, indent=2) + "\n")
    return j, plot(doc, out_dir / "bench.png")
