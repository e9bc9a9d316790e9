"""``sparkrun coldsnap sleep|wake|hibernate|warm|status``: move a workload between its states."""

from __future__ import annotations

import click

from sparkrun_coldsnap.cli.common import emit_json, host_tuple, parse_overrides, target_options
from sparkrun_coldsnap.documents.receipts import Receipt
from sparkrun_coldsnap.lifecycle import verbs
from sparkrun_coldsnap.lifecycle.records import WorkloadRecord

WORKLOAD = click.argument("workload", metavar="RECIPE|WORKLOAD")
JSON = click.option("--json", "as_json", is_flag=True, help="Print the receipt (status: the rows) as JSON.")


def _where(hosts, cluster, options, offline) -> verbs.Where:
    return verbs.Where(hosts=host_tuple(hosts), cluster=cluster, overrides=parse_overrides(options), offline=offline)


def _done(rec: WorkloadRecord, receipt: Receipt, as_json: bool) -> None:
    if as_json:
        emit_json(receipt.model_dump(mode="json"))
        return
    phases = ", ".join("%s %.2f s" % (p.name, p.seconds) for p in receipt.phases)
    click.echo("%s: %s (%s in %.2f s: %s); receipt %s" % (rec.workload, rec.state, receipt.operation, receipt.total_seconds, phases, rec.last_receipt))


@click.command("sleep")
@WORKLOAD
@click.option("--level", type=click.IntRange(1, 2), default=None, help="1: weights kept in host memory, KV cache dropped; 2: both dropped, weights read again on wake (default: the engine's lowest).")
@target_options
@JSON
def sleep(workload, level, hosts, cluster, options, offline, as_json):
    """Release the workload's accelerator memory in place; the engine process stays (GPU engines only)."""
    rec, receipt = verbs.sleep(workload, level=level, where=_where(hosts, cluster, options, offline))
    _done(rec, receipt, as_json)


@click.command("wake")
@WORKLOAD
@target_options
@JSON
def wake(workload, hosts, cluster, options, offline, as_json):
    """Bring a sleeping, hibernated or warm workload back to active and validate it.

    Sleeping: the engine takes its memory back. Hibernated: its hibernation capsule is
    restored through `sparkrun run`. Warm: the restore prepared ahead is activated.
    """
    rec, receipt = verbs.wake(workload, where=_where(hosts, cluster, options, offline))
    _done(rec, receipt, as_json)


@click.command("hibernate")
@WORKLOAD
@target_options
@JSON
def hibernate(workload, hosts, cluster, options, offline, as_json):
    """Capture the running workload into a capsule (no fresh engine start) and stop it.

    The capsule is tagged hibernated-WORKLOAD: `wake` or `sparkrun run` restores exactly
    that state. A hibernate that fails leaves the workload running.
    """
    from sparkrun_coldsnap.progress import Progress

    rec, receipt = verbs.hibernate(workload, where=_where(hosts, cluster, options, offline), progress=Progress(quiet=as_json))
    _done(rec, receipt, as_json)


@click.command("warm")
@WORKLOAD
@click.option("--keep", "keep_seconds", type=float, default=verbs.DEFAULT_KEEP_SECONDS, show_default=True, help="Seconds to keep the prepared restore before it is released.")
@click.option("--release", "release_it", is_flag=True, help="Drop the prepared restore instead (the workload stays hibernated).")
@click.option(
    "--images-only", is_flag=True,
    help="On GPU drivers, keep the unpacked images only, not the process tree restored ahead (which holds its port and some GPU memory while warm).",
)  # fmt: skip
@target_options
@JSON
def warm(workload, keep_seconds, release_it, images_only, hosts, cluster, options, offline, as_json):
    """Prepare a hibernated workload's restore ahead (admission, staging, weights into the page cache).

    On GPU drivers the process tree is restored ahead too, its engine asleep: a later `wake` or
    `sparkrun run` then only hydrates the weights and validates.
    """
    where = _where(hosts, cluster, options, offline)
    if release_it:
        rec = verbs.release(workload, where=where)
        click.echo("%s: %s (the prepared restore was released)" % (rec.workload, rec.state))
        return
    from sparkrun_coldsnap.progress import Progress

    rec, receipt = verbs.prepare_warm(workload, keep_seconds=keep_seconds, where=where, progress=Progress(quiet=as_json), images_only=images_only)
    _done(rec, receipt, as_json)


@click.command("status")
@click.argument("workload", metavar="[RECIPE|WORKLOAD]", required=False)
@target_options
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def status(workload, hosts, cluster, options, offline, as_json):
    """Every workload this plugin manages here: state, capsule, memory held, since when."""
    from sparkrun_coldsnap.lifecycle.status import describe
    from sparkrun_coldsnap.lifecycle.status import status as rows_of

    rows = rows_of(workload, _where(hosts, cluster, options, offline))
    if as_json:
        emit_json(rows)
        return
    if not rows:
        click.echo("no workloads are managed here yet: `sparkrun run` a recipe with a coldsnap: block")
    for r in rows:
        click.echo(describe(r))


COMMANDS = [sleep, wake, hibernate, warm, status]
