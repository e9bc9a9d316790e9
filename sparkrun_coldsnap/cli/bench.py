"""``sparkrun coldsnap bench RECIPE --samples N``: vanilla start vs restore (or, with ``--load``, the
same load against each), medians and a plot."""

from __future__ import annotations

import time
from pathlib import Path

import click

from sparkrun_coldsnap.cli.common import check_recipe_file, emit_json, host_tuple, open_store, parse_overrides, store_option, target_options
from sparkrun_coldsnap.errors import RequestError


@click.command("bench")
@click.argument("recipe")
@target_options
@store_option
@click.option("--samples", type=click.IntRange(1, 50), default=3, show_default=True, help="Samples of each path.")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None, help="Where bench.json and bench.png go (default: bench-out/<time>).")
@click.option("--keep-page-cache", is_flag=True, help="Do not drop the page cache before each sample (not comparable with published numbers).")
@click.option(
    "--lifecycle", is_flag=True,
    help="Time the lifecycle's transitions instead (sleep and wake on GPU engines, hibernate, wake from hibernation, activate from warm) beside a vanilla start.",
)  # fmt: skip
@click.option(
    "--load", "load", is_flag=False, flag_value="", default=None, metavar="[SPEC]",
    help="Drive the same load with the engine's own serving benchmark against a vanilla start and a restore, --samples rounds of each, "
    "and compare throughput, latencies, errors and the engine's KV cache; SPEC: prompts=64,concurrency=16,input=128,output=64,seed=0 (any subset).",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the results document.")
def bench(recipe, hosts, cluster, options, offline, store, samples, out_dir, keep_page_cache, lifecycle, load, as_json):
    """Measure time to first token: vanilla start against ColdSnap restore of RECIPE.

    Captures the recipe first if its capsule does not exist yet. A recipe placed on several
    hosts is timed as a whole: every rank started, against every unit restored.
    """
    from sparkrun_coldsnap import api, bench_load
    from sparkrun_coldsnap import bench as bench_mod
    from sparkrun_coldsnap.integration import placement, planning
    from sparkrun_coldsnap.progress import Progress

    spec = bench_load.load_spec(load) if load is not None else None
    if spec is not None and lifecycle:
        raise RequestError("bench --load and --lifecycle measure different things: give one of them")
    doc = check_recipe_file(recipe)
    capsule_store = open_store(store, doc)
    progress = Progress(quiet=as_json)
    actx = planning.plan_activation(recipe, hosts=host_tuple(hosts), cluster=cluster, overrides=parse_overrides(options), offline=offline)
    req = placement.restore_request(actx)
    several = len(req.workload.topology.units) > 1
    if several and lifecycle:
        raise RequestError("bench --lifecycle times a workload of one unit, %s places %d: leave out --lifecycle to time its start against its restore" % (recipe, len(req.workload.topology.units)))
    if several and spec is not None:
        raise RequestError("bench --load drives a workload of one unit, %s places %d: leave out --load to time its start against its restore" % (recipe, len(req.workload.topology.units)))
    if spec is not None:
        bench_load.client_for(req)  # refused before anything is captured or started
    if not bench_mod.ensure_capsule(capsule_store, req.capsule.ref):
        progress.step("no capsule %s yet: capturing it first" % req.capsule.ref)
        if several:
            from sparkrun_coldsnap.integration import unit_operations

            unit_operations.capture(actx, placement.capture_request(actx), store=capsule_store, progress=progress)
        else:
            api.capture(placement.capture_request(actx), store=capsule_store, progress=progress)
    target = out_dir or Path("bench-out") / time.strftime("%Y%m%dT%H%M%S")
    if spec is not None:
        result = bench_load.run(req, store=capsule_store, spec=spec, rounds=samples, progress=progress, out_dir=target, drop_cache=not keep_page_cache)
        json_path, png = bench_load.write(result, target)
        if as_json:
            emit_json(result)
            return
        click.echo(bench_load.table(result))
        click.echo("results: %s%s" % (json_path, ("; plot: %s" % png) if png else " (install matplotlib for the plot)"))
        return
    if lifecycle:
        from sparkrun_coldsnap.lifecycle import bench as lifecycle_bench
        from sparkrun_coldsnap.lifecycle.verbs import Where

        where = Where(hosts=host_tuple(hosts), cluster=cluster, overrides=parse_overrides(options), offline=offline)
        result = lifecycle_bench.run(req, recipe=recipe, where=where, store=capsule_store, samples=samples, progress=progress, drop_cache=not keep_page_cache)
    elif several:
        from sparkrun_coldsnap import bench_units
        from sparkrun_coldsnap.integration import unit_operations

        with unit_operations.unit_hosts(actx) as unit_hosts:
            result = bench_units.run(
                req, unit_hosts, store=capsule_store, init_port=unit_operations.init_port(actx), samples=samples, progress=progress, drop_cache=not keep_page_cache,
            )  # fmt: skip
    else:
        result = bench_mod.run(req, store=capsule_store, samples=samples, progress=progress, drop_cache=not keep_page_cache)
    json_path, png = bench_mod.write(result, target)
    if as_json:
        emit_json(result)
        return
    click.echo(lifecycle_bench.table(result) if lifecycle else bench_mod.table(result))
    click.echo("results: %s%s" % (json_path, ("; plot: %s" % png) if png else " (install matplotlib for the plot)"))


COMMANDS = [bench]
