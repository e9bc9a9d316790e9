"""``sparkrun coldsnap capture RECIPE``: start, validate and capture a workload once."""

from __future__ import annotations

from pathlib import Path

import click

from sparkrun_coldsnap.cli.common import check_recipe_file, emit_json, host_tuple, open_store, parse_overrides, store_option, target_options
from sparkrun_coldsnap.cli.documents import one_source, print_document, read_request, request_option
from sparkrun_coldsnap.digests import short
from sparkrun_coldsnap.documents.receipts import save_failure_receipt, save_receipt
from sparkrun_coldsnap.documents.request import CaptureRequest
from sparkrun_coldsnap.errors import ColdsnapError
from sparkrun_coldsnap.progress import Progress


@click.command("capture")
@click.argument("recipe", required=False)
@target_options
@store_option
@request_option
@click.option("--tag", default=None, help="Capsule tag (default: the recipe's coldsnap.capsule.tag, else latest).")
@click.option("--receipt", "receipt_file", type=click.Path(path_type=Path), default=None, help="Write the receipt here (default: beside the capsule).")
@click.option("--dry-run", is_flag=True, help="Print the capture request document this would run (JSON) and change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the receipt as JSON.")
def capture(recipe, hosts, cluster, options, offline, store, request_file, tag, receipt_file, dry_run, as_json):
    """Launch RECIPE's engine, validate it with a real request and capture it into a capsule.

    With --request FILE the capture request document is run as it is, without a recipe
    or sparkrun's placement (exit codes: docs/integrators.md).
    """
    from sparkrun_coldsnap import api

    one_source(recipe, request_file)
    if request_file is not None:
        req = read_request(request_file, CaptureRequest)
        capsule_store = open_store(store)
    else:
        from sparkrun_coldsnap.integration import placement, planning

        doc = check_recipe_file(recipe)
        capsule_store = open_store(store, doc)
        actx = planning.plan_activation(recipe, hosts=host_tuple(hosts), cluster=cluster, overrides=parse_overrides(options), offline=offline)
        req = placement.capture_request(actx)
    assert isinstance(req, CaptureRequest)
    if tag:
        req = req.model_copy(update={"capsule": req.capsule.model_copy(update={"tag": tag}), "request_sha256": None})
    if dry_run:
        print_document(req)
        return
    progress = Progress(quiet=as_json)
    say_if_replacing(capsule_store, req.capsule.ref)
    try:
        if request_file is None and len(req.workload.topology.units) > 1:
            from sparkrun_coldsnap.integration import unit_operations

            out = unit_operations.capture(actx, req, store=capsule_store, progress=progress)
        else:
            out = api.capture(req, store=capsule_store, progress=progress)
    except ColdsnapError as err:
        failed = save_failure_receipt(err, receipt_file, capsule_store.receipts, req.capsule.name)
        if failed is not None:
            err.args = ("%s (receipt: %s)" % (err, failed),)
        raise
    path = save_receipt(out.receipt, receipt_file, capsule_store.receipts, req.capsule.name)
    if as_json:
        emit_json(out.receipt.model_dump(mode="json"))
        return
    cap = out.capsule
    assert cap is not None
    r = out.receipt
    click.echo("captured %s -> %s in %s" % (req.capsule.ref, short(cap.digest), capsule_store.root))
    click.echo("  engine %s, driver %s, weights %s; images %.1f MB, capsule %.1f MB" % (
        cap.config.engine.name, cap.config.driver, cap.config.weights.location, r.details.get("image_bytes", 0) / 1e6, cap.size / 1e6))  # fmt: skip
    click.echo("  vanilla start to first token %.1f s; capture %.1f s in all" % (r.details.get("vanilla_ttft_seconds") or 0, r.total_seconds))
    click.echo("  receipt %s" % path)
    click.echo("restore it with: %s" % ("sparkrun run %s" % recipe if recipe else "sparkrun-coldsnap restore --request RESTORE-REQUEST"))


def say_if_replacing(capsule_store, ref: str) -> None:
    """A capture into a tag that exists moves the tag: say so before the minutes it takes."""
    try:
        old = capsule_store.resolve(ref)
    except ColdsnapError:  # not there (or no store yet): nothing is replaced
        return
    click.echo(
        "[coldsnap] %s is capsule %s: this capture replaces it once the new one is published (it stays listed until then; --tag NAME captures beside it)" % (ref, short(old.descriptor.digest)),
        err=True,
    )


COMMANDS = [capture]
